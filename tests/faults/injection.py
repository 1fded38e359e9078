"""Faults injected into one rank's attention kernel, and a small multi-layer CP attention model to run them in.

Everything here runs inside pool workers (``tests.dist_pool``) or recipe workers
(``tests/faults/inject/sitecustomize.py``). A fault replaces the configured
kernel's ``fn`` in ``kernels.KERNELS`` (looked up at every call) by a wrapper that
misbehaves on one rank, at one layer, once.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import cp_blockdiag_sdpa, kernels

# (phase, kind): what the kernel does wrong. Backward faults fail in the gradient computation:
# an exception, or a gradient of the wrong shape (which autograd rejects).
FAULT_TYPES = (("forward", "raise"), ("forward", "no_output"), ("backward", "raise"), ("backward", "bad_grad"))


@dataclass(frozen=True)
class Fault:
    """Misbehave on CP rank ``rank`` in the first kernel call of layer ``layer``.

    Attributes:
        rank: The failing rank.
        layer: Model layer (0-based) whose kernel misbehaves.
        phase: ``forward`` or ``backward``.
        kind: ``raise`` / ``no_output`` (forward), ``raise`` / ``bad_grad`` (backward), or ``sleep``
            (forward: the rank stalls for ``sleep_s`` seconds, like a stuck peer).
        sleep_s: Stall of a ``sleep`` fault.
    """

    rank: int
    layer: int
    phase: str
    kind: str
    sleep_s: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.phase} {self.kind}"


class _FailingGrad(torch.autograd.Function):
    """Identity whose backward misbehaves (once per :class:`Injector`)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, injector: Injector) -> torch.Tensor:
        ctx.injector = injector
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        injector = ctx.injector
        if injector.fired_at is not None:  # a second node of the same layer, or of a discarded recompute
            return grad, None
        injector.fire()
        if injector.fault.kind == "bad_grad":
            return grad[..., :-1], None  # autograd rejects the shape: an exception inside the guarded backward
        raise RuntimeError(f"injected backward failure on rank {injector.fault.rank}")


class Injector:
    """Wraps a kernel ``fn(q, k, v, meta, scale, dropout_p)``; misbehaves per :class:`Fault` on its rank.

    ``layer`` is set by the caller before each attention call (the model, and
    activation-checkpoint recompute, set the layer index; the recipe hook the
    call count), so the fault hits its configured layer once.

    Attributes:
        fired_at: ``time.monotonic()`` when the fault fired (``None``: not yet).
        on_fire: Called with ``fired_at`` when the fault fires.
    """

    def __init__(self, fault: Fault | None, real: Any, rank: int) -> None:
        self.fault = fault if fault is not None and fault.rank == rank else None
        self.real = real
        self.layer = -1
        self.fired_at: float | None = None
        self.on_fire: Callable[[float], None] | None = None

    def fire(self) -> None:
        self.fired_at = time.monotonic()
        if self.on_fire is not None:
            self.on_fire(self.fired_at)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any) -> torch.Tensor | None:
        fault = self.fault
        if fault is None or self.layer != fault.layer or (fault.phase == "forward" and self.fired_at is not None):
            return self.real(q, k, v, *rest)
        if fault.phase == "backward":
            return _FailingGrad.apply(self.real(q, k, v, *rest), self)
        self.fire()
        if fault.kind == "raise":
            raise RuntimeError(f"injected forward failure on rank {fault.rank}")
        if fault.kind == "sleep":
            time.sleep(fault.sleep_s)
            return self.real(q, k, v, *rest)
        return None  # no_output


@contextlib.contextmanager
def injected(backend: str, fault: Fault | None, rank: int) -> Iterator[Injector]:
    """Install an :class:`Injector` as kernel ``backend``'s ``fn`` for the duration."""
    saved = kernels.KERNELS[backend]
    injector = Injector(fault, saved.fn, rank)
    kernels.KERNELS[backend] = replace(saved, fn=injector)
    try:
        yield injector
    finally:
        kernels.KERNELS[backend] = saved


class AttentionStack(torch.nn.Module):
    """``layers`` residual CP attention layers: ``x [1, L, hidden]`` -> ``[1, L, hidden]`` (float64).

    Args:
        layers: Number of attention layers.
        injector: Told which layer is attending (the fault's layer counter).
        checkpointed: Non-reentrant activation checkpointing around every layer.
    """

    HIDDEN, HEADS, KV_HEADS = 16, 4, 2

    def __init__(self, layers: int, injector: Injector, checkpointed: bool = False) -> None:
        super().__init__()
        dim = self.HIDDEN // self.HEADS
        self.q = torch.nn.ModuleList(
            torch.nn.Linear(self.HIDDEN, self.HIDDEN, dtype=torch.float64) for _ in range(layers)
        )
        self.kv = torch.nn.ModuleList(
            torch.nn.Linear(self.HIDDEN, 2 * self.KV_HEADS * dim, dtype=torch.float64) for _ in range(layers)
        )
        self.injector, self.checkpointed, self.dim = injector, checkpointed, dim

    def _layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self.injector.layer = i
        n = x.shape[1]
        q = self.q[i](x).view(1, n, self.HEADS, self.dim).transpose(1, 2)
        k, v = self.kv[i](x).view(1, n, 2 * self.KV_HEADS, self.dim).transpose(1, 2).chunk(2, dim=1)
        out = cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
        return x + out.transpose(1, 2).reshape(1, n, self.HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.q)):
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(self._layer, i, x, use_reentrant=False)
            else:
                x = self._layer(i, x)
        return x


def in_step(group: dist.ProcessGroup, token: int) -> bool:
    """Collective: every rank of ``group`` is at the same ``token`` (a desynchronized group hangs or disagrees)."""
    t = torch.tensor([token, -token], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist() == [token, -token]


def install_from_env(spec: str) -> None:
    """Recipe workers: put the fault ``spec`` (JSON) into the kernel it names, counting kernel calls as layers.

    ``spec``: ``{"backend", "stamp", "rank", "layer", "phase", "kind", "sleep_s"}``; ``layer`` is the
    1-based kernel call on ``rank`` where the fault fires (backward faults wrap every call from
    there on and fire in the first backward that reaches one); when it fires, ``time.monotonic()``
    is written to the file ``stamp``. The rank is read at the first call (the launcher sets
    ``RANK`` after the interpreter started).
    """
    config = json.loads(spec)
    backend, stamp = config.pop("backend"), Path(config.pop("stamp"))
    fault = Fault(**config)
    real = kernels.KERNELS[backend].fn
    calls = [0]
    injector: list[Injector] = []

    def fn(*args: Any) -> torch.Tensor | None:
        if not injector:
            injector.append(Injector(fault, real, int(os.environ.get("RANK", "-1"))))
            injector[0].on_fire = lambda at: stamp.write_text(repr(at))
        calls[0] += 1
        injector[0].layer = min(calls[0], fault.layer)
        return injector[0](*args)

    kernels.KERNELS[backend] = replace(kernels.KERNELS[backend], fn=fn)

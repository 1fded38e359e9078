"""Collective agreement: every rank takes the same path, and one rank's failure makes every rank raise.

Three small collectives, each over the CP group:

- :func:`failed_ranks`: which ranks report a problem (one all-reduce of a ``[world]`` vector);
- :func:`check_step_agreement`: once per step (and call shape), every rank compares
  the step's configuration and document layout with every other rank's and all
  raise the same error on a disagreement, before any path-dependent collective;
- :class:`GuardedKernel`: runs a kernel so that an exception, forward or backward,
  is recorded in a :class:`CallStatus` instead of unwinding one rank alone; the
  runtime then reaches consensus on the status and every rank raises together.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Exceptions that are control flow, not failures: non-reentrant checkpointing stops
# a recompute early by raising through the forward.
_CONTROL_FLOW: tuple[type[BaseException], ...] = (torch.utils.checkpoint._StopRecomputationError,)


def _saved_tensor_hooks_active() -> bool:
    """True under saved-tensor hooks (non-reentrant activation checkpointing, CPU offloading).

    Their tensors are re-materialized per backward graph task, so a kernel graph
    differentiated from inside a backward node would trigger a second recompute
    (with its collectives) on some ranks only. Unknown torch internals count as active.
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _gather_rows(row: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[list[int]]:
    """Every rank's ``row`` (same length everywhere), as one all-reduce of a ``[world, len(row)]`` matrix."""
    world = group_size(group)
    if world == 1:
        return [row]
    table = torch.zeros(world, len(row), dtype=torch.int64, device=device)
    table[dist.get_rank(group)] = torch.tensor(row, dtype=torch.int64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    return table.tolist()


def failed_ranks(ok: bool, group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """Group ranks that reported ``ok=False``; every rank gets the same list."""
    return [r for r, (bad,) in enumerate(_gather_rows([0 if ok else 1], group, device)) if bad]


def fingerprint(value: Any) -> int:
    """A process-independent signed 63-bit hash of ``repr(value)`` (Python's ``hash`` is salted per process)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_step_agreement(fields: dict[str, Any], group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Raise the same ``RuntimeError`` on every rank unless all ranks report identical ``fields``.

    Args:
        fields: What must agree (configuration, sequence lengths, document
            layout, call shapes). Values are compared by fingerprint.
        group: The CP process group.
        device: Device for the collective's tensor.
    """
    names = sorted(fields)
    rows = _gather_rows([fingerprint(fields[n]) for n in names], group, device)
    differing = [n for i, n in enumerate(names) if len({row[i] for row in rows}) > 1]
    if differing:
        groups: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            groups.setdefault(fingerprint([row[names.index(n)] for n in differing]), []).append(rank)
        raise RuntimeError(
            f"block-diagonal CP ranks disagree on {', '.join(differing)} (rank groups that agree: "
            f"{sorted(groups.values())}; this rank has {', '.join(f'{n}={fields[n]!r}' for n in differing)}). "
            "Every CP rank must use the same configuration and the same packed batch; check the launch "
            "arguments and that the data loader feeds identical batches to the ranks of a CP group."
        )


@dataclass
class CallStatus:
    """Failures recorded during one CP attention call (forward and backward), with diagnostics."""

    forward: list[str] = field(default_factory=list)
    backward: list[str] = field(default_factory=list)

    def raise_if_failed(
        self, phase: str, group: dist.ProcessGroup | None, device: torch.device, rank: int, what: str
    ) -> None:
        """Consensus on ``phase``'s failures; every rank raises when any rank failed.

        Args:
            phase: ``"forward"`` or ``"backward"``.
            group: The CP process group.
            device: Device for the collective's tensor.
            rank: This rank (for the message).
            what: Description of the call (path, kernel) for the message.
        """
        mine = getattr(self, phase)
        for diagnostic in mine:
            logger.error("CP attention %s failed on CP rank %d: %s", phase, rank, diagnostic)
        failed = failed_ranks(not mine, group, device)
        if failed:
            own = f"; this rank: {'; '.join(mine)}" if mine else ""
            raise RuntimeError(
                f"block-diagonal CP attention {phase} failed on CP rank(s) {failed} ({what}); every rank raises "
                f"instead of falling back, which would desynchronize the group's collectives{own}"
            )


class GuardedKernel(torch.autograd.Function):
    """Run ``fn(q, k, v)``; an exception (forward or backward) is recorded in ``status`` instead of raised.

    On failure the output (or the input gradients) are zeros of the right shape,
    so this rank keeps issuing the same collectives as its peers until the
    runtime's consensus makes every rank raise. The kernel's own autograd graph
    is built inside the forward and differentiated in the backward.
    """

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        status: CallStatus,
        describe: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        ctx.status, ctx.describe = status, describe
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
        with torch.enable_grad():
            out = _call(fn, status, describe, *inputs)
        ctx.inputs, ctx.out = inputs, out
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs, out = ctx.inputs, ctx.out
        ctx.inputs = ctx.out = None  # free the kernel's graph as soon as it is used
        wanted = [t for t in inputs if t.requires_grad]
        grads: list[torch.Tensor | None] = [None] * 3
        try:
            if out.requires_grad and wanted:
                found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
                grads = [next(found) if t.requires_grad else None for t in inputs]
        except Exception as exc:  # same contract as the forward
            ctx.status.backward.append(f"{type(exc).__name__}: {exc} [{ctx.describe}]")
            grads = [torch.zeros_like(t) if t.requires_grad else None for t in inputs]
        grads = [torch.zeros_like(t) if g is None and t.requires_grad else g for g, t in zip(grads, inputs)]
        return (None, None, None, *grads)


def _call(
    fn: Callable[..., torch.Tensor | None],
    status: CallStatus,
    describe: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """``fn(q, k, v)``; an exception or a missing/misshaped output is recorded and replaced by zeros like ``q``."""
    try:
        out = fn(q, k, v)
    except _CONTROL_FLOW:
        raise
    except Exception as exc:  # reach consensus first; the runtime raises on every rank
        status.forward.append(f"{type(exc).__name__}: {exc} [{describe}]")
        return q.new_zeros(q.shape)
    if not isinstance(out, torch.Tensor) or out.shape != q.shape:
        got = "no output" if out is None else f"output {type(out).__name__} {getattr(out, 'shape', '')}"
        status.forward.append(f"kernel returned {got}, expected a tensor {tuple(q.shape)} [{describe}]")
        return q.new_zeros(q.shape)
    return out


def guarded(
    fn: Callable[..., torch.Tensor | None],
    status: CallStatus,
    describe: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """``fn(q, k, v)`` with failures (an exception, or no output) recorded in ``status``.

    The backward is guarded too (see :class:`GuardedKernel`) unless autograd is
    off or saved-tensor hooks are active (non-reentrant checkpointing); then the
    kernel joins the caller's graph directly and only its forward is guarded: a
    backward failure raises on its rank, and its peers fail at their next
    collective (the process-group timeout bounds the wait).
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)) and not _saved_tensor_hooks_active():
        return GuardedKernel.apply(fn, status, describe, q, k, v)
    return _call(fn, status, describe, q, k, v)

"""A dispatch-level byte counter for layout copies, and the GPU libraries as opaque calls.

:class:`CopyCounter` is a ``TorchDispatchMode`` that sums the bytes every copy-type
aten op writes (``copy_``, ``cat``, ``index_select``, clones from ``contiguous()``,
pads, index copies, ...) while it is active and not paused. :func:`opaque_libraries`
wraps the stand-ins' entry points (flash-attn 2, FA3, TransformerEngine, torch's
``varlen_attn`` and SDPA for its boundary guard) so that what a library does inside
is not counted, as a real CUDA kernel's internals would not be, and records the bytes
of the tensors handed to it and returned: the kernel-format tensors the budget is made of.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Ops that write a tensor's worth of data copied from other tensors: the bytes they write are counted.
_WRITES_OUTPUT = {
    aten.clone,
    aten._to_copy,
    aten.cat,
    aten.stack,
    aten.index_select,
    aten.index,
    aten._unsafe_index,
    aten.gather,
    aten.take,
    aten.constant_pad_nd,
    aten.pad,
    aten.repeat,
    aten.repeat_interleave,
    aten.slice_scatter,
    aten.select_scatter,
    aten.as_strided_scatter,
    aten.expand_copy,
    aten.index_copy,
    aten.index_put,
    aten.index_add,
    aten.masked_scatter,
}
# In-place copies: the bytes of the source they write (argument index).
_WRITES_SOURCE = {aten.copy_: 1, aten.index_copy_: 3, aten.index_put_: 2, aten.index_add_: 3, aten.scatter_: 3}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class CopyCounter(TorchDispatchMode):
    """Bytes (and ops) written by copy-type aten ops while active and not paused.

    Attributes:
        bytes: Total bytes written by copy-type ops.
        ops: ``(op name, bytes)`` of each counted op, in order.
        library: Bytes of the tensors handed to and returned by the opaque library calls.
    """

    bytes: int = 0
    ops: list[tuple[str, int]] = field(default_factory=list)
    library: list[dict[str, int]] = field(default_factory=list)
    _paused: int = 0

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused:
            return out
        packet = func.overloadpacket
        written = 0
        if packet in _WRITES_OUTPUT:
            written = sum(nbytes(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        elif packet in _WRITES_SOURCE:
            source = args[_WRITES_SOURCE[packet]] if len(args) > _WRITES_SOURCE[packet] else None
            if isinstance(source, (list, tuple)):
                source = source[0] if source else None
            written = nbytes(source) if isinstance(source, torch.Tensor) else 0
        if written:
            self.bytes += written
            self.ops.append((str(packet.__name__), written))
        return out

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Count nothing inside (a library's own work, an exchange's staging)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def summary(self) -> dict[str, int]:
        """Bytes per op name."""
        totals: dict[str, int] = {}
        for name, written in self.ops:
            totals[name] = totals.get(name, 0) + written
        return totals


ACTIVE: list[CopyCounter] = []  # the counter the opaque wrappers report to (innermost last)


def _opaque(fn: Callable[..., Any], name: str, first: int = 0) -> Callable[..., Any]:
    """``fn`` whose own work is not counted; the bytes of q, k, v (``args[first:first + 3]``) and out are recorded."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        counter = ACTIVE[-1] if ACTIVE else None
        if counter is None:
            return fn(*args, **kwargs)
        tensors = [a for a in args[first : first + 3] if isinstance(a, torch.Tensor)]
        with counter.paused():
            out = fn(*args, **kwargs)
        result = out[0] if isinstance(out, (tuple, list)) else out
        record = {"in": sum(nbytes(t) for t in tensors), "out": nbytes(result), "fn": name}
        counter.library.append(record)
        return out

    return call


def _patched(owner: Any, name: str, value: Any) -> tuple[Any, str, Any]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    return owner, name, saved


@contextlib.contextmanager
def opaque_libraries() -> Iterator[None]:
    """Wrap every stand-in entry point and the exchange's own staging (call inside ``fake_kernels()``).

    The K/V exchange (its send buffer and collectives) is the exchange's concern, not the
    kernel format's, and the step's agreement check runs once per step: neither is counted.
    """
    import flash_attn
    import flash_attn_interface
    import torch.nn.attention.varlen as varlen
    import transformer_engine.pytorch as te

    from nemo_automodel.components.distributed.blockdiag_cp import consensus, exchange, gpu_kernels

    patches = []
    for module, names in (
        (flash_attn, ("flash_attn_varlen_func", "flash_attn_func")),
        (flash_attn_interface, ("flash_attn_varlen_func", "flash_attn_func")),
        (varlen, ("varlen_attn",)),
    ):
        for name in names:
            patches.append(_patched(module, name, _opaque(getattr(module, name), f"{module.__name__}.{name}")))
    patches.append(_patched(te.DotProductAttention, "forward", _opaque(te.DotProductAttention.forward, "te", 1)))
    patches.append(_patched(gpu_kernels, "_TORCH_SDPA", _opaque(gpu_kernels._TORCH_SDPA, "sdpa")))
    # torch's CausalBias is a tensor subclass that cannot be created under a dispatch mode
    patches.append(_patched(gpu_kernels, "causal_lower_right", _outside_modes(gpu_kernels.causal_lower_right)))
    for name in ("send_buffer", "post", "wait"):
        patches.append(_patched(exchange, name, _uncounted(getattr(exchange, name))))
    # the exchange's backward (reverse collectives) and the library's own backward (inside the guard)
    for owner in (exchange._Post, exchange._Wait, consensus.GuardedKernel):
        patches.append(_patched(owner, "backward", staticmethod(_uncounted(owner.backward))))
    # the step's agreement runs once per step, not per call
    patches.append(_patched(consensus, "check_agreement", _uncounted(consensus.check_agreement)))
    gpu_kernels.reset_caches()
    try:
        yield
    finally:
        for owner, name, saved in reversed(patches):
            setattr(owner, name, saved)
        gpu_kernels.reset_caches()


def _outside_modes(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return call


def _uncounted(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with ACTIVE[-1].paused() if ACTIVE else contextlib.nullcontext():
            return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def counting() -> Iterator[CopyCounter]:
    """A :class:`CopyCounter` active inside (the opaque wrappers report to it)."""
    counter = CopyCounter()
    ACTIVE.append(counter)
    try:
        with counter:
            yield counter
    finally:
        ACTIVE.pop()

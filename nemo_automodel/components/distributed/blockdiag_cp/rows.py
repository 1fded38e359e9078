"""Row splits and joins of attention tensors ``[B, H, L, D]`` in the token-major frame.

Models build ``q``, ``k`` and ``v`` as transposed views of ``[B, L, H, D]`` projections and read the
attention output back through ``transpose(1, 2)``; torch's CPU flash kernel also works in that
token-major frame and copies any other layout into it first. A plain ``torch.cat`` along ``L`` (and
autograd's backward of ``split``, which is a ``cat``) returns a head-major tensor, which the kernel
and then the model each copy back. Splitting and joining along ``L`` as ``[B, L, H, D]`` keeps every
result, forward and backward, token-major, so none of those conversions happen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def token_major(t: torch.Tensor) -> torch.Tensor:
    """``t [B, H, L, D]`` laid out as ``[B, L, H, D]`` (a copy only when it is not already)."""
    return t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)


def split_rows(t: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """``t [B, H, L, D]`` cut along ``L`` into views ``[B, H, n_i, D]`` (``sum(sizes) == L``).

    One piece is ``t`` itself: a split into one piece would still cost a copy in backward.
    """
    if len(sizes) == 1:
        return (t,)
    return tuple(p.transpose(1, 2) for p in t.transpose(1, 2).split(list(sizes), dim=1))


def cat_rows(parts: Sequence[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """``parts [B, H, n_i, D]`` joined along ``L`` (``dim=2``) or ``B`` (``dim=0``) into a token-major tensor."""
    if len(parts) == 1:
        return parts[0]
    frame = 1 if dim == 2 else dim
    return torch.cat([p.transpose(1, 2) for p in parts], dim=frame).transpose(1, 2)


def row_views(t: torch.Tensor, spans: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """Views ``[B, H, n, D]`` of ``t [B, H, L, D]``'s rows ``[start, start + n)`` per ``(start, n)`` in ``spans``.

    Spans may overlap and need not cover ``L``. Unlike slices (each of which gets a zero-filled
    ``t``-sized gradient, then added up) or a ``split`` (which cannot overlap, so a reader of several
    adjacent pieces needs a ``cat``), the gradients of all the views are written into one token-major
    buffer (:class:`_RowViews`). One span of all rows is ``t`` itself.
    """
    if len(spans) == 1 and tuple(spans[0]) == (0, t.shape[2]):
        return (t,)
    return _RowViews.apply(t, tuple(tuple(s) for s in spans))


class _RowViews(torch.autograd.Function):
    """Row views of ``t [B, H, L, D]``; backward writes their gradients into one ``[B, H, L, D]`` buffer.

    The buffer is token-major (the layout of the model's projections) and allocated uninitialized:
    each row is copied from the first gradient that covers it and later ones are added (overlapping
    spans, e.g. keys that are both attended and sent); only rows no gradient covers are zeroed.
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, ...]:
        ctx.spans, ctx.shape, ctx.dtype, ctx.device = spans, t.shape, t.dtype, t.device
        ctx.set_materialize_grads(False)  # an unused view's gradient is not written, not zero-filled
        return tuple(t[:, :, start : start + n] for start, n in spans)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        b, h, length, d = ctx.shape
        buffer = torch.empty(b, length, h, d, dtype=ctx.dtype, device=ctx.device).transpose(1, 2)
        covered: list[tuple[int, int]] = []  # disjoint [start, stop) rows written so far
        for (start, n), grad in zip(ctx.spans, grads):
            if grad is None or not n:
                continue
            for lo, hi, seen in _partition(start, start + n, covered):
                part, rows = buffer[:, :, lo:hi], grad[:, :, lo - start : hi - start]
                part.add_(rows) if seen else part.copy_(rows)
            covered = _union(covered, (start, start + n))
        for lo, hi, seen in _partition(0, length, covered):
            if not seen:
                buffer[:, :, lo:hi].zero_()
        return buffer, None


def _partition(lo: int, hi: int, covered: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """``[lo, hi)`` cut into ``(start, stop, inside covered)`` pieces (``covered``: sorted, disjoint)."""
    out: list[tuple[int, int, bool]] = []
    at = lo
    for a, b in covered:
        a, b = max(a, lo), min(b, hi)
        if a >= b:
            continue
        if at < a:
            out.append((at, a, False))
        out.append((a, b, True))
        at = b
    if at < hi:
        out.append((at, hi, False))
    return out


def _union(covered: list[tuple[int, int]], span: tuple[int, int]) -> list[tuple[int, int]]:
    """``covered`` with ``span`` added, sorted and merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted([*covered, span]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out

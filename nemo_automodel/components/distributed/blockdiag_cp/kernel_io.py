"""Kernel inputs and outputs in each kernel's own format: one pack in and one unpack out per call.

Two formats (:data:`KernelLayout`):

- ``bhsd``: ``[1, H, n, D]`` (the CPU kernels: SDPA takes any strides);
- ``thd``: token-major ``[n, H, D]`` (the GPU varlen libraries): keys and values contiguous,
  queries possibly a strided view that the kernel packs once, straight into the rows it launches.

Models produce q/k/v as ``[1, H, L, D]`` views of token-major projections and read
the output back token-major (``out.transpose(1, 2)``). So for ``thd`` kernels the
queries are packed with at most one copy (none when they are token-major already; by
the kernel, which knows the rows it launches),
the keys and values are assembled token-major straight from the local and received
chunks (the one copy that gathers them), and every group's output is written once
into a token-major ``[L, Hq, Dv]`` buffer whose ``[1, Hq, L, Dv]`` view is returned:
the model's ``transpose(1, 2).contiguous()`` is then free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from nemo_automodel.components.distributed.blockdiag_cp.rows import cat_rows, split_rows

KernelLayout = Literal["bhsd", "thd"]
Rows = tuple[int, int] | torch.Tensor  # a group's local query rows: (start, stop) or an index tensor


def tokens(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, n, D]`` -> the token-major view ``[n, H, D]`` (no copy; ``squeeze``, whose backward is a view too)."""
    return x.squeeze(0).transpose(0, 1)


def packed(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, n, D]`` -> contiguous ``[n, H, D]``: a copy only when ``x`` is not token-major already."""
    return tokens(x).contiguous()


def query_parts(
    query: torch.Tensor, rows: Sequence[Rows], n_real: int, layout: KernelLayout
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each group's queries in the kernel's format, and the padding rows ``[1, Hq, L - n_real, D]``.

    One ``split`` when every group's rows are contiguous (they then tile the real rows in
    order): autograd fills one gradient for it, not one per slice. For ``thd`` these are
    token-major views (the kernel packs them); scattered rows (the balanced layout) are
    gathered with one ``index_select``, straight into the format.
    """
    padding = query[:, :, n_real:]
    if all(isinstance(r, tuple) for r in rows):
        sizes = [r[1] - r[0] for r in rows]  # type: ignore[index]
        if layout == "bhsd":  # token-major (rows.py): the queries' gradients join in the model's layout
            pad = query.shape[2] - n_real
            parts = split_rows(query, [*sizes, pad] if pad else sizes)
            return list(parts[: len(sizes)]), parts[-1] if pad else padding
        return list(tokens(query).split([*sizes, query.shape[2] - n_real], dim=0)[:-1]), padding
    if layout == "bhsd":
        return [query[:, :, r[0] : r[1]] if isinstance(r, tuple) else query.index_select(2, r) for r in rows], padding
    return [
        tokens(query)[r[0] : r[1]] if isinstance(r, tuple) else tokens(query).index_select(0, r) for r in rows
    ], padding


def pack_keys(chunks: Sequence[torch.Tensor], layout: KernelLayout) -> torch.Tensor:
    """A group's keys (or values) from its chunks ``[1, Hkv, n, D]`` in order: ``[1, Hkv, K, D]`` or ``[K, Hkv, D]``.

    For ``thd`` the chunks (local rows and received rows, both token-major in memory when
    the model's projections are) are gathered token-major in one copy.
    """
    if layout == "bhsd":
        return cat_rows(chunks)  # token-major, the CPU flash kernel's own frame (rows.py)
    if len(chunks) == 1:
        return packed(chunks[0])
    return torch.cat([tokens(c) for c in chunks], dim=0)


class _PlaceRows(torch.autograd.Function):
    """Write each group's output rows into one token-major ``[L, Hq, Dv]`` buffer; padding rows are zero.

    The one unpack of a call. ``deps`` (the padding queries, the exchange's anchor, the
    sinks) get zero gradients, so they stay in the graph on every rank (an all-padding
    rank launches no kernel but still runs the exchange's backward).
    """

    @staticmethod
    def forward(
        ctx: Any,
        shape: tuple[int, int, int],
        rows: tuple[Rows, ...],
        layout: KernelLayout,
        like: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        outputs, deps = tensors[: len(rows)], tensors[len(rows) :]
        ctx.rows, ctx.layout = rows, layout
        ctx.deps = [(t.shape, t.dtype, t.device) for t in deps]
        buffer = like.new_empty(shape)
        for out, r in zip(outputs, rows):
            out = tokens(out) if layout == "bhsd" else out
            if isinstance(r, tuple):
                buffer[r[0] : r[1]].copy_(out)
            else:
                buffer.index_copy_(0, r, out)
        buffer[sum(_count(r) for r in rows) :].zero_()  # padding rows come after every real row
        return buffer

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = []
        for r in ctx.rows:
            g = grad[r[0] : r[1]] if isinstance(r, tuple) else grad.index_select(0, r)
            grads.append(g.transpose(0, 1).unsqueeze(0) if ctx.layout == "bhsd" else g)
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.deps]
        return (None, None, None, None, *grads, *zeros)


def _count(rows: Rows) -> int:
    return rows[1] - rows[0] if isinstance(rows, tuple) else rows.numel()


def _pieces(
    outputs: Sequence[torch.Tensor | tuple[torch.Tensor, ...]], rows: Sequence[Rows]
) -> tuple[list[torch.Tensor], list[Rows]]:
    """Each output piece and its local rows: a group's pieces take its rows in order."""
    pieces: list[torch.Tensor] = []
    where: list[Rows] = []
    for out, r in zip(outputs, rows):
        start = 0
        for piece in out if isinstance(out, tuple) else (out,):
            n = piece.shape[0] if piece.dim() == 3 else piece.shape[2]
            pieces.append(piece)
            where.append((r[0] + start, r[0] + start + n) if isinstance(r, tuple) else r[start : start + n])
            start += n
    return pieces, where


def unpack(
    outputs: Sequence[torch.Tensor | tuple[torch.Tensor, ...]],
    rows: Sequence[Rows],
    layout: KernelLayout,
    like: torch.Tensor,
    shape: tuple[int, int, int],
    *deps: torch.Tensor,
) -> torch.Tensor:
    """The call's output ``[1, Hq, L, Dv]``, a view of one token-major ``[L, Hq, Dv]`` buffer.

    Args:
        outputs: Each group's output in the kernel's format: ``[1, Hq, n, Dv]``, or row pieces
            ``[n_i, Hq, Dv]`` (token-major kernels: one per library call, never concatenated).
        rows: Each group's local rows (real rows first; the rest of the ``L`` rows are padding).
        layout: The kernels' format.
        like: A tensor of the output's dtype and device (the query).
        shape: ``(L, Hq, Dv)``.
        deps: Tensors that must stay in the graph with zero gradients.
    """
    pieces, where = _pieces(outputs, rows)
    buffer = _PlaceRows.apply(shape, tuple(where), layout, like, *pieces, *deps)
    return buffer.transpose(0, 1).unsqueeze(0)

"""The CPU-capable kernels: per-document SDPA (``sdpa_varlen``) and one masked SDPA call (``dense``).

Both follow the kernel contract of :mod:`.metadata` (``q [1, Hq, L, D]`` against
packed ``k [1, Hkv, K, D]``, ``v [1, Hkv, K, Dv]``, bottom-right causal per
segment, zero padding rows) and run on any device and floating dtype. They are
registered in :mod:`.kernels`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nemo_automodel.components.distributed.blockdiag_cp.logs import log_once
from nemo_automodel.components.distributed.blockdiag_cp.metadata import VarlenMeta
from nemo_automodel.components.distributed.blockdiag_cp.rows import cat_rows, split_rows, token_major
from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant

logger = logging.getLogger(__name__)

# Torch's SDPA, captured before anything in this package can patch it.
TORCH_SDPA = F.scaled_dot_product_attention

# `sdpa_varlen` handles a segment with earlier keys in row tiles with an explicit
# mask: at most this many rows per tile (the masked-out half of a tile's diagonal
# block is computed anyway, so smaller tiles waste less) and at most this many
# mask elements per call.
_TILE_ROWS = 256
_MASK_BUDGET = 1 << 24
# `_SoftcapTiles` rows per tile: its elementwise passes run over a tile's scores, which at 128 rows stay
# closer to cache (measured on one 3000-token document, 8/4 heads x 64, 1 thread, CPU time vs the fused
# flash kernel: 128 rows 1.70-1.94x, 64 rows 1.89-1.95x, 256 rows 2.11x, 512 rows 2.56-2.64x).
_SOFTCAP_TILE_ROWS = 128
# `_WindowTiles` rows per tile (at most the window - 1). A tile's keys are two triangles of its own row count
# and the full block between them; the flash kernel computes whole blocks of up to 512 keys on its diagonal,
# so short tiles keep the triangles, and their wasted half, small (one 3000-token document, 8/4 heads x 64,
# window 1024, 1 thread, fwd+bwd vs plain causal, whose pairs are 0.57x: tiles of 1023 rows 0.74x, 512 0.76x,
# 256 0.65x, 128 0.65x, 64 0.67x)
_WINDOW_TILE_ROWS = 128
# Most elements of one key block (all of a call's tiles) one `_WindowTiles` flash call takes; a run's tiles are
# cut into calls of at most this many. The flash backward returns key and value gradients the size of its
# key blocks, and the tiles' middle blocks overlap (each key repeats in about (W - 1) / rows tiles), so one
# call per run made transient memory grow with the segment times the window: one 16K-token document, window
# 4096, 8/4 heads x 64, fwd+bwd, peak RSS growth 1048 MiB (q, k, v: 64 MiB), 151 MiB with calls of at most
# 2^20 elements (and 7.1 s -> 5.7 s, 1 thread).
_WINDOW_CALL_ELEMENTS = 1 << 20


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``0`` where allowed, ``-inf`` elsewhere: the fused CPU kernel converts boolean masks to this on every call."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _pad_rows(out: torch.Tensor, local_len: int) -> torch.Tensor:
    """Append zero rows to ``out [1, Hq, n_real, Dv]`` up to ``local_len``."""
    missing = local_len - out.shape[2]
    if missing == 0:
        return out
    return torch.cat((out, out.new_zeros(out.shape[0], out.shape[1], missing, out.shape[3])), dim=2)


def _dense_allowed(meta: VarlenMeta) -> torch.Tensor:
    """Boolean ``[n_real, K]`` mask on the host: same document, key position <= query position, inside the window."""
    q_lens, k_lens = torch.tensor(meta.q_lens), torch.tensor(meta.k_lens)
    doc_q = torch.repeat_interleave(torch.arange(len(meta.q_lens)), q_lens)
    doc_k = torch.repeat_interleave(torch.arange(len(meta.k_lens)), k_lens)
    cu_q = torch.tensor([0, *itertools.accumulate(meta.q_lens)])
    cu_k = torch.tensor([0, *itertools.accumulate(meta.k_lens)])
    # Position inside the document; queries are shifted by the left straddle (bottom-right causal).
    pos_q = torch.arange(meta.n_real) - cu_q[doc_q] + (k_lens - q_lens)[doc_q]
    pos_k = torch.arange(meta.kv_len) - cu_k[doc_k]
    allowed = (doc_q[:, None] == doc_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])
    if meta.window is not None:
        allowed &= pos_k[None, :] > pos_q[:, None] - meta.window
    return allowed


def _dense_mask(meta: VarlenMeta, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``[n_real, K]`` mask of ``meta`` (additive in ``dtype``, or boolean for ``torch.bool``).

    Built once per step on the host and copied once, then shared by every layer
    (building it on the device from the host lists would cost host-device
    copies, i.e. syncs, in every layer).
    """
    key = (str(dtype), str(device))
    if key not in meta._masks:
        allowed = _dense_allowed(meta)
        meta._masks[key] = (allowed if dtype == torch.bool else _additive_mask(allowed, dtype)).to(device)
    return meta._masks[key]


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with explicit scores, for what SDPA cannot express (soft-cap, sinks).

    The order of transformers' eager attention: scaled scores, soft-cap, additive
    ``bias``, mask, softmax in at least fp32 (with the sinks), dropout, values.

    Args:
        q: Queries ``[B, Hq, T, D]``.
        k: Keys ``[B, Hkv, S, D]``.
        v: Values ``[B, Hkv, S, Dv]``.
        allowed: Boolean, broadcastable to ``[B, Hq, T, S]``: which keys each row attends.
        bias: Optional additive mask broadcastable to the scores (a caller's float attention mask).
        scale: Softmax scale (``None``: ``D ** -0.5``).
        dropout_p: Dropout on the attention weights.
        variant: Soft-cap (applied to the scaled scores before masking) and sinks ``[Hq]``
            (one extra logit per head in each row's softmax, with no value).

    Returns:
        ``[B, Hq, T, Dv]``. Scores ``[B, Hq, T, S]`` are materialized: callers tile rows.
    """
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if variant.softcap is not None:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if variant.sinks is not None:
        sink = variant.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat((scores, sink), dim=-1)
    # Softmax in at least fp32, like transformers' eager attention.
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    if variant.sinks is not None:
        probs = probs[..., :-1]  # the sink takes its share of the denominator and adds no value
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


def dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:
    """One masked SDPA call over all real rows; the ``[n_real, K]`` mask is explicit.

    Soft-cap and sinks, which SDPA cannot express, use explicit scores over the same mask.
    """
    rows = q if meta.n_real == q.shape[2] else q[:, :, : meta.n_real]
    if variant.scores_changed:
        allowed = _dense_mask(meta, torch.bool, q.device)
        return _pad_rows(explicit_attention(rows, k, v, allowed, scale, dropout_p, variant), meta.local_len)
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.device.type != "cpu":
        # CUDA's memory-efficient kernel (the one that takes arbitrary masks) has no
        # GQA support; with enable_gqa the dispatcher would pick the math kernel and
        # materialize fp32 scores. Expanding K/V keeps the efficient kernel.
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        gqa = False
    if dropout_p > 0.0 and q.device.type == "cpu":
        log_once(
            logger,
            "dense-cpu-dropout",
            logging.WARNING,
            "dense CP attention with dropout on CPU uses the math SDPA kernel (materializes scores)",
        )
    out = TORCH_SDPA(
        rows,
        k,
        v,
        attn_mask=_dense_mask(meta, q.dtype, q.device),
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=gqa,
    )
    return _pad_rows(out, meta.local_len)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _LseKernel(Protocol):
    """Attention that exposes its log-sum-exp, with a backward that takes the output and log-sum-exp it is given.

    Shapes: ``q [N, Hq, Q, D]``, ``k [N, Hkv, K, D]``, ``v [N, Hkv, K, Dv]``, ``out [N, Hq, Q, Dv]``,
    ``lse [N, Hq, Q]`` (at least fp32). ``backward`` computes the softmax row term from the ``out`` it is
    given, so a caller that rescales rows (the sinks of :class:`_LseAttention`) passes the rescaled output.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of the rows over their keys."""
        ...

    def backward(
        self,
        grad: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` given ``grad [N, Hq, Q, Dv]``, ``out`` and ``lse``."""
        ...


class _LseAttention(torch.autograd.Function):
    """``kernel``'s attention of ``q [N, Hq, Q, D]`` over ``k/v [N, Hkv, K, D|Dv]``, with optional sinks ``[Hq]``.

    A sink joins each row's softmax denominator and carries no value, so with the sink-free kernel's
    ``out`` and ``lse`` the exact result is ``out * a`` with ``a = sigmoid(lse - sink)`` per head. Backward
    calls the kernel's backward with ``a * grad`` and the returned (scaled) output: its probabilities are the
    sink-free ones, and scaling both gives each score the gradient ``a p (g.v - a g.o)`` of the softmax with
    the sink. The sink's own gradient is ``-sum a (1 - a) (g.o)`` over the head's rows. Only q/k/v, the
    output and ``lse`` are saved.
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, kernel: _LseKernel
    ) -> torch.Tensor:
        out, lse = kernel.forward(q, k, v)
        if sinks is not None:
            out = (out * _sink_scale(lse, sinks).unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grad = token_major(grad)  # the flash backward works token-major: any other layout is copied there
        d_sinks = None
        if sinks is not None:
            a = _sink_scale(lse, sinks)  # [N, Hq, Q]
            # g.o with the sink-free o = out / a: -sum a (1 - a) (g.o) = -sum (1 - a) (g.out)
            d_sinks = -((1 - a) * (grad.to(a.dtype) * out).sum(-1)).sum((0, 2)).to(sinks.dtype)
            grad = (grad * a.unsqueeze(-1)).to(q.dtype)
        dq, dk, dv = ctx.kernel.backward(grad, q, k, v, out, lse)
        return dq, dk, dv, d_sinks, None


def _sink_scale(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``sigmoid(lse - sink)`` ``[N, Hq, Q]``: the share of each row's softmax mass its keys keep next to the sink."""
    return torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))


@dataclass(frozen=True)
class _CausalBlocks:
    """Bottom-right causal attention of ``q [N, Hq, Q, D]`` over ``k/v [N, Hkv, P + Q, D]`` without a mask (CPU).

    Split the keys: every row sees all ``P`` prefix keys (one unmasked flash call) and the last ``Q`` keys
    causally (one ``is_causal`` call on a square); the two partial softmaxes merge through their
    log-sum-exps. Backward calls the flash backward per key block with the *merged* output and log-sum-exp,
    which gives each block its exact gradient (the ring-attention identity). Masks would cost memory (SDPA
    saves them) and, on CPU, most of the time.
    """

    scale: float | None

    @staticmethod
    def _blocks(q: torch.Tensor, k: torch.Tensor) -> tuple[_KeyBlock, ...]:
        prefix = k.shape[2] - q.shape[2]
        blocks = (_KeyBlock(0, prefix, "none"), _KeyBlock(prefix, q.shape[2], "causal"))
        return tuple(block for block in blocks if block.length)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [_flash_block(q, *_block_keys(k, v, b), b.mask, self.scale) for b in self._blocks(q, k)]
        return _merge_blocks(parts, q.dtype)

    def backward(
        self,
        grad: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        grads = [
            _flash_block_backward(grad, q, *_block_keys(k, v, b), out, lse, b.mask, self.scale)
            for b in self._blocks(q, k)
        ]
        if len(grads) == 1:
            return grads[0]
        # token-major key gradients (rows.py): the received keys' share then reaches the exchange without a copy
        return grads[0][0] + grads[1][0], *(cat_rows([g[i] for g in grads]) for i in (1, 2))


def _block_keys(k: torch.Tensor, v: torch.Tensor, block: _KeyBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``[B, Hkv, length, D]`` of one key block."""
    keys = slice(block.start, block.start + block.length)
    return k[:, :, keys], v[:, :, keys]


def _cpu_flash_applies(q: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
    """Whether torch's private CPU flash ops can serve the mask-free paths: CPU, no dropout, ``Dv == D``."""
    fused = _CPU_FLASH is not None and _CPU_FLASH_BACKWARD is not None
    return fused and q.device.type == "cpu" and dropout_p == 0.0 and v.shape[3] == q.shape[3]


def _bottom_right_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, dropout_p: float
) -> torch.Tensor:
    """One segment whose ``q [1, Hq, Q, D]`` rows are the last ``Q`` of its ``k [1, Hkv, K, D]`` keys.

    Query row ``i`` sees keys ``[0, K - Q + i]``: SDPA's ``is_causal`` (aligned
    top-left) does not fit. On CPU without dropout: :class:`_CausalBlocks`
    (no mask); elsewhere :func:`_masked_tiles`.
    """
    if _cpu_flash_applies(q, v, dropout_p):
        return _LseAttention.apply(q, k, v, None, _CausalBlocks(scale))
    return _masked_tiles(q, k, v, scale, dropout_p, PLAIN, None)


@dataclass(frozen=True)
class _KeyBlock:
    """Keys of tile 0 of a :class:`_TileRun` (tile ``i``'s start ``i * rows`` later) and how its rows see them.

    Attributes:
        start: First key (segment-relative).
        length: Keys in the block.
        mask: ``"causal"`` (row ``r`` sees keys ``<= r``: top-left ``is_causal``), ``"reversed"`` (row ``r``
            sees keys ``>= r - (rows - length)``: ``is_causal`` once rows and keys are flipped) or ``"none"``.
    """

    start: int
    length: int
    mask: str


@dataclass(frozen=True)
class _TileRun:
    """``count`` consecutive row tiles of one shape of a windowed segment; each tile is one batch entry.

    Tile ``i`` is tile 0 shifted by ``i * rows`` rows and keys: its rows start at ``first_row + i * rows``
    and each of its key blocks at the block's ``start + i * rows``. A block longer than ``rows`` overlaps
    the same block of the next tile.

    Attributes:
        first_row: First query row of tile 0.
        rows: Query rows per tile.
        count: Tiles in the run.
        blocks: The non-empty key blocks of tile 0.
    """

    first_row: int
    rows: int
    count: int
    blocks: tuple[_KeyBlock, ...]


def _window_tile(prefix: int, window: int, first_row: int, rows: int) -> tuple[_KeyBlock, ...]:
    """Key blocks of the tile of ``rows <= window - 1`` query rows starting at ``first_row``.

    Row ``r`` sits at key position ``p = prefix + first_row + r`` and sees keys ``(p - window, p]``. With
    ``c = window - 1`` and ``a = prefix + first_row``, the tile's keys ``[a - c, a + rows)`` split into
    ``[a - c, a - c + rows)``: row ``r`` sees its keys from index ``r`` on, a triangle that reversing rows
    and keys turns into top-left causal (clipping at key 0 drops its earliest keys, the last columns once
    reversed, so reversed row ``r'`` still sees exactly the keys ``<= r'`` that remain);
    ``[a - c + rows, a)``: seen by every row; ``[a, a + rows)``: top-left causal.
    """
    c, a = window - 1, prefix + first_row
    edges = (max(0, a - c), max(0, a - c + rows), a, a + rows)
    kinds = ("reversed", "none", "causal")
    return tuple(_KeyBlock(lo, hi - lo, kind) for lo, hi, kind in zip(edges, edges[1:], kinds) if hi > lo)


def _window_runs(q_len: int, k_len: int, window: int, max_rows: int) -> tuple[_TileRun, ...]:
    """Tiles of ``min(max_rows, window - 1)`` rows over a segment's ``q_len`` rows, consecutive tiles of one
    shape merged.

    Only the tiles whose keys reach back past key 0 are clipped and only the last can be short, so all but a
    few tiles share one run.
    """
    prefix, tile_rows = k_len - q_len, min(max_rows, window - 1)
    runs: list[_TileRun] = []
    for first_row in range(0, q_len, tile_rows):
        rows = min(tile_rows, q_len - first_row)
        blocks = _window_tile(prefix, window, first_row, rows)
        last = runs[-1] if runs else None
        shifted = last is not None and last.rows == rows
        if shifted and blocks == tuple(_KeyBlock(b.start + last.count * rows, b.length, b.mask) for b in last.blocks):
            runs[-1] = _TileRun(last.first_row, rows, last.count + 1, last.blocks)
        else:
            runs.append(_TileRun(first_row, rows, 1, blocks))
    return tuple(runs)


def _tiles(x: torch.Tensor, start: int, length: int, count: int, stride: int | None = None) -> torch.Tensor:
    """``x [B, H, n, ...]``'s ``count`` blocks of ``length`` rows from ``start``, each ``stride`` rows after
    the last (default ``length``: consecutive), stacked tile-major: ``[B * count, H, length, ...]``.

    A view where it can be one (``B == 1``): overlapping blocks (``stride < length``) share memory.
    """
    stride = length if stride is None else stride
    span = x[:, :, start : start + (count - 1) * stride + length]
    return span.unfold(2, length, stride).movedim(-1, 3).transpose(1, 2).flatten(0, 1)


def _untiles(x: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`_tiles`: ``[B * count, H, length, ...]`` -> ``[B, H, count * length, ...]``."""
    return x.unflatten(0, (-1, count)).transpose(1, 2).flatten(2, 3)


def _flash_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention of ``q [N, Hq, T, D]`` over one key block ``k/v [N, Hkv, S, D]``.

    Returns:
        ``(out [N, Hq, T, D], lse [N, Hq, T])``.
    """
    if mask == "reversed":
        out, lse = _CPU_FLASH(q.flip(2), k.flip(2), v.flip(2), 0.0, True, scale=scale)
        return out.flip(2), lse.flip(2)
    return _CPU_FLASH(q, k, v, 0.0, mask == "causal", scale=scale)


def _flash_block_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: str,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one key block given the *merged* ``out [N, Hq, T, D]`` and ``lse [N, Hq, T]``."""
    if mask == "reversed":  # flip every row-indexed tensor and the keys, as in forward; flip the gradients back
        flipped = (t.flip(2) for t in (grad, q, k, v, out, lse))
        return tuple(g.flip(2) for g in _CPU_FLASH_BACKWARD(*flipped, 0.0, True, scale=scale))
    return _CPU_FLASH_BACKWARD(grad, q, k, v, out, lse, 0.0, mask == "causal", scale=scale)


def _merge_blocks(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Merge partial softmaxes ``(out [N, H, T, D], lse [N, H, T])`` over disjoint key blocks into ``(out, lse)``."""
    if len(parts) == 1:
        return parts[0][0].to(dtype), parts[0][1]
    lse = torch.stack([lse for _, lse in parts]).logsumexp(dim=0)
    weights = [torch.exp(part_lse - lse).unsqueeze(-1) for _, part_lse in parts]
    out = parts[0][0] * weights[0]  # then accumulated in place: one output-sized write per further block
    for (part, _), weight in zip(parts[1:], weights[1:]):
        out.addcmul_(part, weight)
    return out.to(dtype), lse


@dataclass(frozen=True)
class _WindowTiles:
    """Bottom-right sliding-window attention of ``q [B, Hq, Q, D]`` over ``k/v [B, Hkv, P + Q, D]`` without a
    mask (CPU): row ``i`` sees keys ``(P + i - W, P + i]``.

    Rows are cut into tiles of ``W - 1`` (:func:`_window_runs`); each tile attends at most three key blocks
    with mask-free flash calls (:func:`_window_tile`), merged through their log-sum-exps, and tiles of one
    shape share one call per block (stacked in the batch dim). Backward calls the flash backward per block
    with the merged output and log-sum-exp, like :class:`_CausalBlocks`. Work is about ``W`` keys per row
    (the flash kernel skips the masked halves).
    """

    window: int
    scale: float | None

    def _runs(self, k: torch.Tensor, q_len: int) -> Iterator[_TileRun]:
        """The tile runs of a segment, each cut into calls of at most ``_WINDOW_CALL_ELEMENTS`` keys' elements."""
        per_key = k.shape[0] * k.shape[1] * k.shape[3]
        for run in _window_runs(q_len, k.shape[2], self.window, _WINDOW_TILE_ROWS):
            longest = max(block.length for block in run.blocks)
            yield from _split_run(run, max(1, _WINDOW_CALL_ELEMENTS // (per_key * longest)))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # written in place, run by run: no list of pieces and no concatenation
        out = q.new_empty(*q.shape[:3], v.shape[3])
        lse = q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))
        for run in self._runs(k, q.shape[2]):
            q_tiles = _tiles(q, run.first_row, run.rows, run.count)
            parts = [_flash_block(q_tiles, *_block_tiles(k, v, b, run), b.mask, self.scale) for b in run.blocks]
            run_out, run_lse = _merge_blocks(parts, q.dtype)
            rows = slice(run.first_row, run.first_row + run.count * run.rows)
            out[:, :, rows] = _untiles(run_out, run.count)
            lse[:, :, rows] = _untiles(run_lse, run.count)
        return out, lse

    def backward(
        self,
        grad: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # A key gets gradient from two tiles: accumulate in at least fp32 so half precision rounds once.
        acc = torch.promote_types(k.dtype, torch.float32)
        dq = torch.empty_like(q)
        dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k, v))
        for run in self._runs(k, q.shape[2]):
            g_t, q_t, o_t, l_t = (_tiles(x, run.first_row, run.rows, run.count) for x in (grad, q, out, lse))
            dq_t = None
            for b in run.blocks:
                gq, gk, gv = _flash_block_backward(g_t, q_t, *_block_tiles(k, v, b, run), o_t, l_t, b.mask, self.scale)
                dq_t = gq if dq_t is None else dq_t + gq
                _overlap_add_(dk, gk, b, run)
                _overlap_add_(dv, gv, b, run)
            dq[:, :, run.first_row : run.first_row + run.count * run.rows] = _untiles(dq_t, run.count)
        return dq, dk.to(k.dtype), dv.to(v.dtype)


def _split_run(run: _TileRun, most: int) -> Iterator[_TileRun]:
    """``run`` as consecutive runs of at most ``most`` tiles (each one flash call per key block)."""
    for first in range(0, run.count, most):
        shift = first * run.rows
        blocks = tuple(_KeyBlock(b.start + shift, b.length, b.mask) for b in run.blocks)
        yield _TileRun(run.first_row + shift, run.rows, min(most, run.count - first), blocks)


def _block_tiles(k: torch.Tensor, v: torch.Tensor, block: _KeyBlock, run: _TileRun) -> tuple[torch.Tensor, ...]:
    """Every tile's keys and values of one key block: ``[B * count, Hkv, length, D]`` each."""
    return tuple(_tiles(x, block.start, block.length, run.count, run.rows) for x in (k, v))


def _overlap_add_(total: torch.Tensor, tiles: torch.Tensor, block: _KeyBlock, run: _TileRun) -> None:
    """Add one key block's per-tile gradients ``[B * count, H, length, D]`` into ``total [B, H, K, D]`` in place.

    Tile ``i``'s block starts ``i * rows`` keys later, so a block longer than ``rows`` overlaps the next
    tile's. It is added in pieces of at most ``rows`` keys: one piece of every tile lands on disjoint key
    ranges, so each piece is one in-place add through a view.
    """
    rows, count = run.rows, run.count
    for offset in range(0, block.length, rows):
        piece = tiles[:, :, offset : offset + rows]  # [B * count, H, n, D], n <= rows
        n, start = piece.shape[2], block.start + offset
        slots = total[:, :, start : start + (count - 1) * rows + n].unfold(2, n, rows)  # [B, H, count, D, n]
        slots += piece.unflatten(0, (-1, count)).permute(0, 2, 1, 4, 3)


def _bottom_right_window(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, dropout_p: float, window: int
) -> torch.Tensor:
    """Segments ``q [B, Hq, Q, D]`` whose rows are the last ``Q`` of ``k [B, Hkv, K, D]``, sliding ``window < K``.

    On CPU without dropout (and ``Dv == D``, ``window >= 2``): :class:`_WindowTiles` (no mask); elsewhere
    :func:`_masked_tiles`. ``window == 1`` (each row sees itself) has no tile of ``window - 1`` rows.
    """
    if _cpu_flash_applies(q, v, dropout_p) and window >= 2:
        return _LseAttention.apply(q, k, v, None, _WindowTiles(window, scale))
    return _masked_tiles(q, k, v, scale, dropout_p, PLAIN, window)


def _grouped_rows(x: torch.Tensor, start: int, stop: int, kv_heads: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``x [N, Hq, Q, ...]`` with each key/value head's query heads stacked:
    ``[N, Hkv, Hq / Hkv * (stop - start), ...]`` (query head ``h`` reads key/value head ``h // (Hq / Hkv)``)."""
    n, heads = x.shape[:2]
    return x[:, :, start:stop].reshape(n, kv_heads, heads // kv_heads * (stop - start), *x.shape[3:])


@dataclass(frozen=True)
class _SoftcapTiles:
    """Soft-capped (and optionally windowed) bottom-right attention in row tiles that keep no scores.

    Shapes as :class:`_LseKernel`; row ``i`` of ``Q`` sees keys ``(K - Q + i - window, K - Q + i]``. Each
    tile of rows computes ``c * tanh(s / c)`` over the keys its rows see, masks only where rows see
    different keys, and keeps its output and log-sum-exp; backward recomputes the tile's scores from
    ``lse`` (flash attention's recompute, with the soft-cap's ``1 - tanh^2`` in the chain). GQA runs as one
    matrix product per key/value head (its query heads stacked as rows), never with repeated keys. Memory is
    one tile's scores (at most ``_MASK_BUDGET`` elements), never ``[Q, K]``. Math in at least fp32.
    """

    softcap: float
    window: int | None
    scale: float | None

    def _tiles(self, q: torch.Tensor, k: torch.Tensor) -> Iterator[tuple[int, int, int, int]]:
        """:func:`_row_tiles` of ``q``'s rows; a tile's scores hold every batch entry and head of its rows."""
        return _row_tiles(q.shape[2], k.shape[2], self.window, _SOFTCAP_TILE_ROWS, q.shape[0] * q.shape[1])

    def _tanh_scores(self, q: torch.Tensor, k: torch.Tensor, tile: tuple[int, int, int, int]) -> torch.Tensor:
        """``tanh(scale * q k^T / c)`` of one tile: ``[N, Hkv, Hq / Hkv * rows, keys]``."""
        a, b, lo, hi = tile
        scale = q.shape[3] ** -0.5 if self.scale is None else self.scale
        # tanh(x) = 2 sigmoid(2x) - 1: torch's CPU tanh takes 2.5x the time of sigmoid plus the two passes
        # (7.8 vs 3.1 ms for 3M fp32 scores, 1 thread), at most 1.5 ulp of 1 off (1.8e-7 vs 3e-8 in fp32)
        rows = _grouped_rows(q, a, b, k.shape[1]) * (2 * scale / self.softcap)
        return torch.matmul(rows, k[:, :, lo:hi].transpose(-1, -2)).sigmoid_().mul_(2).sub_(1)

    def _mask_(self, scores: torch.Tensor, tile: tuple[int, int, int, int], prefix: int) -> torch.Tensor:
        """Set the keys a tile's rows do not see to ``-inf`` (in place): the diagonal triangle, and the
        window's left edge."""
        a, b, lo, hi = tile
        view = scores.unflatten(2, (-1, b - a))  # [N, Hkv, Hq / Hkv, rows, keys]
        if self.window is None:
            hidden = torch.ones(b - a, b - a, dtype=torch.bool, device=scores.device).triu_(1)
            view[..., prefix + a - lo :].masked_fill_(hidden, float("-inf"))
            return scores
        last = prefix + a + torch.arange(b - a, device=scores.device)[:, None]  # last key each row sees
        keys = lo + torch.arange(hi - lo, device=scores.device)[None, :]
        view.masked_fill_((keys > last) | (keys <= last - self.window), float("-inf"))
        return scores

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.promote_types(q.dtype, torch.float32)
        qa, ka, va = (x.to(acc) for x in (q, k, v))
        n, heads, q_len = q.shape[:3]
        out = torch.empty(n, heads, q_len, v.shape[3], dtype=acc, device=q.device)
        lse = torch.empty(n, heads, q_len, dtype=acc, device=q.device)
        prefix = k.shape[2] - q_len
        for tile in self._tiles(q, k):
            a, b, lo, hi = tile
            scores = self._mask_(self._tanh_scores(qa, ka, tile).mul_(self.softcap), tile, prefix)
            top = scores.amax(-1, keepdim=True)
            probs = scores.sub_(top).exp_()  # unnormalized; the output divides once per row
            total = probs.sum(-1, keepdim=True)
            out[:, :, a:b] = torch.matmul(probs, va[:, :, lo:hi]).div_(total).view(n, heads, b - a, -1)
            lse[:, :, a:b] = top.add_(total.log_()).view(n, heads, b - a)
        return out.to(q.dtype), lse

    def backward(
        self,
        grad: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = torch.promote_types(q.dtype, torch.float32)
        qa, ka, va, ga = (x.to(acc) for x in (q, k, v, grad))
        kv_heads, prefix = k.shape[1], k.shape[2] - q.shape[2]
        scale = q.shape[3] ** -0.5 if self.scale is None else self.scale
        row_term = (ga * out.to(acc)).sum(-1, keepdim=True)  # [N, Hq, Q, 1]
        neg_lse = -lse.to(acc).unsqueeze(-1)
        dq = torch.empty_like(qa)
        dk, dv = torch.zeros_like(ka), torch.zeros_like(va)
        one = torch.ones((), dtype=acc, device=q.device)
        for tile in self._tiles(q, k):
            a, b, lo, hi = tile
            tanh = self._tanh_scores(qa, ka, tile)
            # p = exp(c * tanh - lse), the probabilities of the forward
            probs = self._mask_(
                torch.add(_grouped_rows(neg_lse, a, b, kv_heads), tanh, alpha=self.softcap), tile, prefix
            )
            probs.exp_()
            g_rows = _grouped_rows(ga, a, b, kv_heads)
            dv[:, :, lo:hi] += torch.matmul(probs.transpose(-1, -2), g_rows)
            d_scores = torch.matmul(g_rows, va[:, :, lo:hi].transpose(-1, -2))
            d_scores.sub_(_grouped_rows(row_term, a, b, kv_heads)).mul_(probs)
            # through c * tanh(scale * s / c): d/ds = scale * (1 - tanh^2); 1 - tanh^2 in one pass over the
            # tile, and ``scale`` applied to the (much smaller) dq and dk instead of to the tile
            d_scores.mul_(torch.addcmul(one, tanh, tanh, value=-1))
            dq[:, :, a:b] = torch.matmul(d_scores, ka[:, :, lo:hi]).mul_(scale).view(*q.shape[:2], b - a, -1)
            dk[:, :, lo:hi] += torch.matmul(d_scores.transpose(-1, -2), _grouped_rows(qa, a, b, kv_heads) * scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _tile_span(k_len: int, window: int | None, max_rows: int) -> int:
    """Keys a row tile of at most ``max_rows`` rows reads, at most (all ``k_len`` without a window)."""
    return k_len if window is None else min(k_len, window - 1 + max_rows)


def _row_tiles(
    q_len: int, k_len: int, window: int | None, max_rows: int, row_elements: int
) -> Iterator[tuple[int, int, int, int]]:
    """``(first row, stop row, first key, stop key)`` of the row tiles of a bottom-right segment.

    The segment's ``q_len`` rows are the last of its ``k_len`` keys: row ``i`` sees keys
    ``(k_len - q_len + i - window, k_len - q_len + i]`` (``window=None``: from key 0). Each tile reads only
    the keys its rows see and has at most ``max_rows`` rows and ``_MASK_BUDGET`` score (or mask) elements,
    ``row_elements`` per row and key (the batch entries and heads that share its rows). Shared by the
    soft-cap tiles (:class:`_SoftcapTiles`) and the masked fallback (:func:`_masked_tiles`).
    """
    prefix = k_len - q_len
    rows = max(1, min(q_len, max_rows, _MASK_BUDGET // (row_elements * _tile_span(k_len, window, max_rows))))
    for a in range(0, q_len, rows):
        b = min(q_len, a + rows)
        yield a, b, 0 if window is None else max(0, prefix + a - window + 1), prefix + b


def _lse_kernel(
    q: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    window: int | None,
    variant: AttentionVariant,
    scale: float | None,
) -> _LseKernel | None:
    """The mask-free kernel for a soft-cap or sinks call on segments ``q [N, Hq, Q, D]``, or ``None`` (dropout,
    or sinks where the CPU flash op cannot run): soft-cap tiles on any device, sinks over the CPU flash op."""
    if dropout_p > 0.0:
        return None
    if variant.softcap is not None:
        return _SoftcapTiles(float(variant.softcap), window, scale)
    if not _cpu_flash_applies(q, v, dropout_p):
        return None
    if window is None:
        return _CausalBlocks(scale)
    return _WindowTiles(window, scale) if window >= 2 else None


def _masked_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant,
    window: int | None,
) -> torch.Tensor:
    """Segments ``q [B, Hq, Q, D]`` whose rows are the last ``Q`` of ``k [B, Hkv, K, D]``, in row tiles with masks.

    Row ``i`` sees keys ``(K - Q + i - window, K - Q + i]`` (``window=None``: from
    key 0). Each tile reads only the keys its rows see; a tile of ``T`` rows
    computes about ``T^2 / 2`` masked pairs in vain. Plain attention runs as
    masked SDPA, soft-cap and sinks with explicit scores
    (:func:`explicit_attention`). SDPA saves its mask for backward, so when the
    tiles' masks would add up to more than ``_MASK_BUDGET`` elements each tile is
    checkpointed (its mask and scores are rebuilt in backward) and memory stays
    one tile's worth.
    """
    q_len, k_len = q.shape[2], k.shape[2]
    prefix = k_len - q_len
    recompute = torch.is_grad_enabled() and q_len * _tile_span(k_len, window, _TILE_ROWS) > _MASK_BUDGET
    explicit = variant.scores_changed

    def tile(
        q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_row: int, first_key: int
    ) -> torch.Tensor:
        last = prefix + first_row + torch.arange(q_rows.shape[2], device=q.device)  # last key each row sees
        key_pos = first_key + torch.arange(keys.shape[2], device=q.device)
        allowed = key_pos[None, :] <= last[:, None]
        if window is not None:
            allowed &= key_pos[None, :] > last[:, None] - window
        if explicit:
            return explicit_attention(q_rows, keys, values, allowed, scale, dropout_p, variant)
        return TORCH_SDPA(
            q_rows,
            keys,
            values,
            attn_mask=_additive_mask(allowed, q.dtype),
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    outs = []
    for a, b, lo, hi in _row_tiles(q_len, k_len, window, _TILE_ROWS, 1):  # a mask is one [rows, keys] matrix
        args = (q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], a, lo)
        outs.append(checkpoint(tile, *args, use_reentrant=False) if recompute else tile(*args))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def sdpa_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:
    """Per-document SDPA; segments of the same shape share one batched call.

    Square segments (keys start at their first row) run as ``is_causal`` SDPA,
    segments with earlier keys as :func:`_bottom_right_causal`, segments whose
    sliding window is shorter than their keys as :func:`_bottom_right_window`.
    Soft-cap runs as :class:`_SoftcapTiles` and sinks rescale the flash output
    (:class:`_LseAttention`); only with dropout (or sinks where the CPU flash op
    cannot run) do they fall back to explicit scores (:func:`_masked_tiles`).
    Memory stays O(tokens) (the fused kernels skip the masked half), and on
    short rows with many same-shape segments the per-call overhead is paid
    once per shape, not per segment.
    """
    gqa = q.shape[1] != k.shape[1]
    explicit = variant.scores_changed
    # One split per tensor, not a slice per segment: autograd fills one zero gradient per slice.
    # Token-major, like the flash kernels (rows.py).
    padding = q.shape[2] - meta.n_real
    qs = split_rows(q, [*meta.q_lens, padding] if padding else meta.q_lens)
    ks, vs = split_rows(k, meta.k_lens), split_rows(v, meta.k_lens)
    outs: list[torch.Tensor | None] = [None] * len(meta.q_lens)
    for batch in meta.batches:
        qb, kb, vb = (_stacked(parts, batch.indices) for parts in (qs, ks, vs))
        # A window at least as long as the segment's keys hides nothing: plain causal.
        window = meta.window if meta.window is not None and meta.window < batch.k_len else None
        if explicit:
            kernel = _lse_kernel(qb, vb, dropout_p, window, variant, scale)
            if kernel is None:
                ob = _masked_tiles(qb, kb, vb, scale, dropout_p, variant, window)
            else:
                ob = _LseAttention.apply(qb, kb, vb, variant.sinks, kernel)
        elif window is not None:
            ob = _bottom_right_window(qb, kb, vb, scale, dropout_p, window)
        elif batch.k_len == batch.q_len:
            ob = TORCH_SDPA(qb, kb, vb, is_causal=True, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
        else:
            ob = _bottom_right_causal(qb, kb, vb, scale, dropout_p)
        for j, i in enumerate(batch.indices):
            outs[i] = ob[j : j + 1] if len(batch.indices) > 1 else ob
    if padding:
        outs.append(qs[-1].new_zeros(*qs[-1].shape[:3], v.shape[3]))  # [1, Hq, padding, Dv]
    return cat_rows(outs)


def _stacked(parts: tuple[torch.Tensor, ...], indices: tuple[int, ...]) -> torch.Tensor:
    """``parts[i]`` (each ``[1, H, n, D]``) for ``i`` in ``indices``, stacked: ``[len(indices), H, n, D]``."""
    return cat_rows([parts[i] for i in indices], dim=0)

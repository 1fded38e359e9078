"""Single-process float64 reference for block-diagonal causal attention."""

from __future__ import annotations

import torch


def blockdiag_allowed(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[S, S]`` bool: same real document and key position <= query position."""
    ids = doc_ids.reshape(-1)
    pos = torch.arange(ids.numel(), device=ids.device)
    return (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None]) & (ids[:, None] > 0)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Explicit-softmax attention over the full row ``q [1, Hq, S, D]``, ``k/v [1, Hkv, S, D]``.

    Rows of padding (doc id 0) are zero, as in every CP kernel.
    """
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    allowed = blockdiag_allowed(doc_ids)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs @ v


def doc_ids_from_lengths(lengths: list[int], total: int) -> torch.Tensor:
    """``[1, total]`` ids: documents 1..n of the given lengths, then padding (0)."""
    ids = torch.zeros(total, dtype=torch.long)
    pos = 0
    for i, n in enumerate(lengths):
        ids[pos : pos + n] = i + 1
        pos += n
    return ids[None]

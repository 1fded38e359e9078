"""Single-process float64 reference for block-diagonal causal attention."""

from __future__ import annotations

import torch


def blockdiag_allowed(doc_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[S, S]`` bool: same real document, key position <= query position (and > query - ``window``)."""
    ids = doc_ids.reshape(-1)
    pos = torch.arange(ids.numel(), device=ids.device)
    allowed = (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None]) & (ids[:, None] > 0)
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    return allowed


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Explicit attention over the full row ``q [1, Hq, S, D]``, ``k [1, Hkv, S, D]``, ``v [1, Hkv, S, Dv]``.

    Written out term by term (not with the kernels' helpers): scores, the soft-cap
    ``c * tanh(s / c)``, the document/window mask, then weights ``exp(s - m)``
    normalized by their sum plus, with sinks ``[Hq]``, ``exp(sink - m)``.
    Rows of padding (doc id 0) are zero, as in every CP kernel.
    """
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    allowed = blockdiag_allowed(doc_ids, window)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        top = torch.maximum(top, sinks.view(1, -1, 1, 1))
    top = top.nan_to_num(0.0, neginf=0.0)
    weights = torch.exp(scores - top)
    denominator = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + torch.exp(sinks.view(1, -1, 1, 1) - top)
    real = allowed.any(dim=-1)[None, None, :, None]
    return torch.where(real, (weights / denominator.clamp_min(1e-300)) @ v, 0.0)


def doc_ids_from_lengths(lengths: list[int], total: int) -> torch.Tensor:
    """``[1, total]`` ids: documents 1..n of the given lengths, then padding (0)."""
    ids = torch.zeros(total, dtype=torch.long)
    pos = 0
    for i, n in enumerate(lengths):
        ids[pos : pos + n] = i + 1
        pos += n
    return ids[None]

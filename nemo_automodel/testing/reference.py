"""Single-process references: float64 block-diagonal causal attention, and the packer's per-document loops."""

from __future__ import annotations

from typing import Any

import torch

from nemo_automodel.components.datasets.formats import Document


def blockdiag_allowed(doc_ids: torch.Tensor, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """``[S, S]`` bool: same real document, key position <= query position (and > query - ``window``).

    With ``chunk``: also the same chunk of the document (position in the document ``// chunk``).
    """
    ids = doc_ids.reshape(-1)
    pos = torch.arange(ids.numel(), device=ids.device)
    allowed = (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None]) & (ids[:, None] > 0)
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    if chunk is not None:
        first = torch.tensor([ids.tolist().index(d) for d in ids.tolist()], device=ids.device)
        in_chunk = (pos - first) // chunk
        allowed &= in_chunk[:, None] == in_chunk[None, :]
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
    chunk: int | None = None,
) -> torch.Tensor:
    """Explicit attention over the full row ``q [1, Hq, S, D]``, ``k [1, Hkv, S, D]``, ``v [1, Hkv, S, Dv]``.

    Written out term by term (not with the kernels' helpers): scores, the soft-cap
    ``c * tanh(s / c)``, the document/window/chunk mask, then weights ``exp(s - m)``
    normalized by their sum plus, with sinks ``[Hq]``, ``exp(sink - m)``.
    Rows of padding (doc id 0) are zero, as in every CP kernel.
    """
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    allowed = blockdiag_allowed(doc_ids, window, chunk)
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


def segments_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: Any,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``q [1, Hq, L, D]`` over packed ``k [1, Hkv, K, D]``, ``v [1, Hkv, K, Dv]`` -> ``[1, Hq, L, Dv]`` in float64.

    ``meta`` is the group's :class:`~nemo_automodel.components.distributed.blockdiag_cp.metadata.VarlenMeta`;
    rows past ``n_real`` are zero.

    Written from the variant's definition, not from any library's parameters: the
    ``q_len`` rows of a segment are the last of its ``k_len`` keys, so row ``a`` is
    key position ``i = k_len - q_len + a``; it attends keys ``j`` with ``i - W < j <= i``.
    Scores are scaled, soft-capped (``c * tanh(s / c)``), masked, then softmaxed.
    """
    rep = q.shape[1] // k.shape[1]
    pieces = []
    for q0, q_len, k0, k_len in meta.segments():
        i = torch.arange(k_len - q_len, k_len)[:, None]
        j = torch.arange(k_len)[None, :]
        allowed = (j <= i) & ((i - j < window) if window is not None else True)
        qs = q[0, :, q0 : q0 + q_len].double()
        ks = k[0, :, k0 : k0 + k_len].double().repeat_interleave(rep, 0)
        vs = v[0, :, k0 : k0 + k_len].double().repeat_interleave(rep, 0)
        scores = qs @ ks.transpose(1, 2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pieces.append(torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ vs)
    out = torch.cat(pieces, dim=1)  # [Hq, n_real, Dv]
    return torch.nn.functional.pad(out, (0, 0, 0, meta.local_len - meta.n_real))[None]


def fit_to_row_reference(documents: list[Any], seq_len: int, long_documents: str) -> list[Any]:
    """The packer's original per-document fit (the oracle of ``packing.fit_to_row`` over flat arrays): empty
    documents dropped, longer ones ``split`` into ``seq_len`` chunks or ``truncate``d; each a ``Document``."""
    fitted = []
    for doc in documents:
        targets = [True] * len(doc.ids) if doc.targets is None else list(doc.targets)
        stops = [seq_len] if long_documents == "truncate" else range(seq_len, len(doc.ids) + seq_len, seq_len)
        start = 0
        for stop in stops:
            if doc.ids[start:stop]:
                fitted.append(Document(list(doc.ids[start:stop]), targets[start:stop]))
            start = stop
    return fitted


def fill_rows_reference(docs: list[Any], rows: list[list[int]], seq_len: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """``(input_ids, labels, position_ids, seq_ids)`` ``[N, seq_len]``, filled one document at a time (the packer's
    original loop: the oracle of its vectorized fill, and the baseline of ``benchmarks/packing.py --fill``)."""
    shape = (len(rows), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    seq_ids = torch.zeros(shape, dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for doc_number, index in enumerate(members, start=1):
            tokens = torch.tensor(docs[index].ids, dtype=torch.long)
            end = start + len(tokens)
            input_ids[r, start:end] = tokens
            successors = tokens[1:]
            if docs[index].targets is not None:
                keep = torch.tensor(docs[index].targets[1:], dtype=torch.bool)
                successors = torch.where(keep, successors, torch.full_like(successors, -100))
            labels[r, start : end - 1] = successors
            position_ids[r, start:end] = torch.arange(len(tokens))
            seq_ids[r, start:end] = doc_number
            start = end
    return input_ids, labels, position_ids, seq_ids

"""Reference varlen attention shared by the flash-attn and TransformerEngine stand-ins."""

from __future__ import annotations

import itertools

import torch

# The real kernels accept only fp16/bf16 on CUDA; tests widen this to run on CPU in float64.
ALLOWED_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
CALLS: list[dict] = []


def _check_cu(name: str, cu: torch.Tensor, total: int) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous():
        raise TypeError(f"{name} must be a contiguous 1-D int32 tensor")
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(f"{name}={values} must rise from 0 to {total}")
    return values


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float | None,
    bottom_right: bool,
) -> torch.Tensor:
    """``q [Tq, Hq, D]``, ``k/v [Tk, Hkv, D]`` -> ``[Tq, Hq, D]``, causal per segment."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [tokens, heads, dim] tensor, got {tuple(t.shape)}")
        if t.dtype not in ALLOWED_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} is not supported")
    if q.shape[1] % k.shape[1]:
        raise ValueError("query heads must be a multiple of key heads")
    qs, ks = _check_cu("cu_seqlens_q", cu_q, q.shape[0]), _check_cu("cu_seqlens_k", cu_k, k.shape[0])
    if len(qs) != len(ks):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same number of sequences")
    q_lens = [b - a for a, b in itertools.pairwise(qs)]
    k_lens = [b - a for a, b in itertools.pairwise(ks)]
    if max_q < max(q_lens) or max_k < max(k_lens):
        raise ValueError(f"max_seqlen ({max_q}, {max_k}) below the real maxima ({max(q_lens)}, {max(k_lens)})")
    CALLS.append({"q_lens": q_lens, "k_lens": k_lens, "bottom_right": bottom_right})
    rep = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(qs), itertools.pairwise(ks)):
        qi = q[q0:q1].transpose(0, 1)
        ki = k[k0:k1].transpose(0, 1).repeat_interleave(rep, 0)
        vi = v[k0:k1].transpose(0, 1).repeat_interleave(rep, 0)
        shift = (k1 - k0) - (q1 - q0) if bottom_right else 0
        allowed = torch.arange(k1 - k0)[None, :] <= (torch.arange(q1 - q0)[:, None] + shift)
        scores = (qi @ ki.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        outs.append((torch.softmax(scores, -1).nan_to_num(0.0) @ vi).transpose(0, 1))
    return torch.cat(outs, 0)

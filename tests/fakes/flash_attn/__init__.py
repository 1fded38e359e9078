"""Stand-in for flash-attn >= 2.1: ``flash_attn_varlen_func`` with bottom-right causal alignment."""

from __future__ import annotations

import torch
from fake_varlen_core import varlen_attention


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    **kwargs,
) -> torch.Tensor:
    if not isinstance(max_seqlen_q, int) or not isinstance(max_seqlen_k, int):
        raise TypeError("max_seqlen_q/max_seqlen_k must be Python ints")
    if causal is not True:
        raise ValueError("the stand-in only implements causal=True")
    if dropout_p:
        raise ValueError("the stand-in has no dropout")
    return varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, bottom_right=True
    )

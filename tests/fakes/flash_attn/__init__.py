"""Stand-in for flash-attn 2.8.3 (``flash_attn_varlen_func`` and ``flash_attn_func``; same in 2.7.4.post1).

Signatures are the real ones, parameter for parameter, with the real defaults
(flash_attn/flash_attn_interface.py: ``flash_attn_varlen_func`` at line 1370 of
v2.8.3 / 1375 of v2.7.4.post1, ``flash_attn_func`` at 1135 / 1140). A misspelt
keyword fails here as it would there. Semantics: ``fake_varlen_core``.
"""

from __future__ import annotations

import torch
from fake_varlen_core import Segment, attend, check_dtypes, check_heads, record, varlen_segments

__version__ = "2.8.3"


def _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, head_dim):
    if alibi_slopes is not None:
        raise NotImplementedError("the stand-in does not implement alibi_slopes")
    if softcap > 0 and dropout_p > 0:
        raise RuntimeError("Softcapping does not support dropout for now")
    left, right = window_size
    if causal:  # flash_api.cpp: if (is_causal) { window_size_right = 0; }
        right = 0
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    return {"scale": scale, "left": left, "right": right, "softcap": softcap, "dropout_p": dropout_p}


def _result(out, lse, return_attn_probs):
    # S_dmask is only filled with dropout ("for testing only" upstream); the stand-in returns it empty.
    return (out, lse, torch.empty(0, device=out.device)) if return_attn_probs else out


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
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """``q [total_q, Hq, D]``, ``k/v [total_k, Hkv, D]`` -> ``out [total_q, Hq, D]`` (+ ``lse [Hq, total_q]``)."""
    if block_table is not None:
        raise NotImplementedError("the stand-in does not implement block_table")
    check_dtypes(q, k, v)
    check_heads(q.shape[1], k.shape[1], q.shape[2], multiple_of_8=False)
    segments = varlen_segments(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, q.shape[2])
    record("flash_attn_varlen_func", segments, causal=causal, deterministic=deterministic, **options)
    out, lse = attend(q, k, v, segments, **options)
    return _result(out, lse, return_attn_probs)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``q [B, Sq, Hq, D]``, ``k/v [B, Sk, Hkv, D]`` -> ``out [B, Sq, Hq, D]`` (+ ``lse [B, Hq, Sq]``)."""
    check_dtypes(q, k, v)
    check_heads(q.shape[2], k.shape[2], q.shape[3], multiple_of_8=False)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    segments: list[Segment] = [(i * sq, (i + 1) * sq, i * sk, (i + 1) * sk) for i in range(b)]
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, q.shape[3])
    record("flash_attn_func", segments, causal=causal, deterministic=deterministic, **options)
    out, lse = attend(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), segments, **options)
    out = out.unflatten(0, (b, sq))
    return _result(out, lse.unflatten(1, (b, sq)).transpose(0, 1), return_attn_probs)

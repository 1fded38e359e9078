"""Stand-in for FlashAttention-3's ``flash_attn_interface`` (flash-attention ``hopper/``, main at 0251105a).

Signatures are the real ones with the real defaults (hopper/flash_attn_interface.py:
``flash_attn_varlen_func`` line 890, ``flash_attn_func`` line 809). FA3 has no
dropout, does not pad the head dim (``head_size should be a multiple of 8``), and
returns ``(out, softmax_lse)`` only with ``return_attn_probs=True`` (since
2025-08-29; 2.8.x has no such parameter and returns ``out``; releases before
2025-07-11 always returned the pair). Semantics: ``fake_varlen_core``.
"""

from __future__ import annotations

from fake_varlen_core import Segment, attend, check_dtypes, check_heads, record, varlen_segments


def _options(softmax_scale, causal, window_size, softcap, head_dim, unsupported):
    if any(unsupported):
        raise NotImplementedError("the stand-in implements no seqused/qv/descale/attention_chunk")
    left, right = window_size
    if causal:  # hopper/flash_api.cpp: if (is_causal) { window_size_right = 0; }
        right = 0
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    return {"scale": scale, "left": left, "right": right, "softcap": softcap}


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """``q [total_q, Hq, D]``, ``k/v [total_k, Hkv, D]`` -> ``out`` (+ ``lse [Hq, total_q]``)."""
    check_dtypes(q, k, v)
    check_heads(q.shape[1], k.shape[1], q.shape[2], multiple_of_8=True)
    segments = varlen_segments(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    unsupported = (seqused_q is not None, seqused_k is not None, qv is not None, q_descale is not None, attention_chunk)
    options = _options(softmax_scale, causal, window_size, softcap, q.shape[2], unsupported)
    record("fa3.flash_attn_varlen_func", segments, causal=causal, **options)
    out, lse = attend(q, k, v, segments, **options)
    return (out, lse) if return_attn_probs else out


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """``q [B, Sq, Hq, D]``, ``k/v [B, Sk, Hkv, D]`` -> ``out [B, Sq, Hq, D]`` (+ ``lse [B, Hq, Sq]``)."""
    check_dtypes(q, k, v)
    check_heads(q.shape[2], k.shape[2], q.shape[3], multiple_of_8=True)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    segments: list[Segment] = [(i * sq, (i + 1) * sq, i * sk, (i + 1) * sk) for i in range(b)]
    options = _options(softmax_scale, causal, window_size, softcap, q.shape[3], (qv is not None, attention_chunk))
    record("fa3.flash_attn_func", segments, causal=causal, **options)
    out, lse = attend(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), segments, **options)
    out = out.unflatten(0, (b, sq))
    return (out, lse.unflatten(1, (b, sq)).transpose(0, 1)) if return_attn_probs else out

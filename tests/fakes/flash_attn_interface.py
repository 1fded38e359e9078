"""Stand-in for FlashAttention-3's ``flash_attn_interface`` (flash-attention ``hopper/``), build ``machine.ACTIVE.fa3``.

Each build era has its real signatures, parameter for parameter, with the real
defaults (hopper/flash_attn_interface.py at the commits named in machine.FA3_ERAS;
main is 0251105a, ``flash_attn_varlen_func`` line 890, ``flash_attn_func`` line 809),
and the checks of that era's hopper/flash_api.cpp:

- no dropout; ``head_size % 8 == 0`` and ``head_size_v % 8 == 0``, no padding;
- before 2025-01-07: head dims 64/128/256, equal value head dim; Hopper only until 2025-02-16;
- a value head dim of its own: forward for D in (128, 192] with Dv in (96, 128] or D <= 64,
  on Hopper only; backward from 2025-04-24 (before, ``CHECK_SHAPE(v, ..., head_size)``);
- build flags (``machine.ACTIVE.fa3_disabled``, written to ``flash_attn_config``): ``LOCAL``,
  ``SOFTCAP``, ``BACKWARD``, ``VARLEN``, ``FP16`` raise; ``HDIM<n>`` removes a head-dim bucket;
  ``HDIMDIFF64``/``HDIMDIFF192`` leave Dv != D to a kernel of the wrong width (NaN here);
- returns ``(out, softmax_lse)`` before 2025-07-11, ``out`` after, the pair again with
  ``return_attn_probs=True`` (main);
- the private ``_flash_attn_forward``/``_flash_attn_backward`` of each era (below the public functions), which
  sinks use: the forward returns ``softmax_lse``, the backward takes ``out``/``softmax_lse`` and writes
  ``dq``/``dk``/``dv``.

Semantics: ``fake_varlen_core``.
"""

from __future__ import annotations

import uuid

import machine
import torch
from fake_varlen_core import (
    Segment,
    attend,
    backward_from_lse,
    check_dtypes,
    check_heads,
    grads_never_written,
    record,
    varlen_segments,
)

ERA = machine.ACTIVE.fa3
if ERA is None:
    raise ModuleNotFoundError("No module named 'flash_attn_interface'", name="flash_attn_interface")
assert ERA in machine.FA3_ERAS, ERA
_ORDER = machine.FA3_ERAS.index(ERA)
_DISABLED = machine.ACTIVE.fa3_disabled if ERA in ("2.8.3", "main") else frozenset()
_BUCKETS = (64, 96, 128, 192, 256)


def _since(era: str) -> bool:
    return machine.FA3_ERAS.index(era) <= _ORDER


def _check_call(q, k, v, head_dim, head_dim_v, dropout, window_size, softcap, varlen):
    check_dtypes(q, k, v)
    check_heads(q.shape[-2], k.shape[-2], head_dim, multiple_of_8=True)
    if head_dim_v % 8:
        raise RuntimeError("head_size_v should be a multiple of 8")
    capability = machine.capability()
    if capability is not None and (capability != (9, 0) if not _since("2025-04") else capability < (8, 0)):
        raise RuntimeError("FlashAttention only supports Hopper GPUs or newer.")
    if varlen and "VARLEN" in _DISABLED:
        raise RuntimeError("This flash attention build does not support varlen.")
    if q.dtype == torch.float16 and "FP16" in _DISABLED:
        raise RuntimeError("This flash attention build does not support FP16.")
    if window_size[0] >= 0 and "LOCAL" in _DISABLED:
        raise RuntimeError("This flash attention build does not support local attention.")
    if softcap > 0 and "SOFTCAP" in _DISABLED:
        raise RuntimeError("This flash attention build does not support tanh softcapping.")
    if not _since("2025-01"):
        if head_dim not in (64, 128, 256):
            raise RuntimeError("Only support head size 64, 128, and 256 for now")
    elif not any(b >= head_dim and f"HDIM{b}" not in _DISABLED for b in _BUCKETS):
        raise RuntimeError("FlashAttention forward only supports head dimension at most ...")
    if head_dim_v != head_dim:
        if not _since("2025-04"):
            raise RuntimeError(f"v must have shape (..., {head_dim})")
        if not ((128 < head_dim <= 192 and 96 < head_dim_v <= 128) or (head_dim <= 64 and head_dim_v <= 512)):
            raise RuntimeError("If V headdim is different from Q/K dim, we only support ...")
        if capability is not None and capability[0] != 9:
            raise RuntimeError("Only Hopper supports different V headdim")


def _attend(q, k, v, segments, head_dim, head_dim_v, options):
    out, lse = attend(q, k, v, segments, **options)
    if head_dim_v != head_dim:
        if not _since("2.8.3") or max(head_dim, head_dim_v) > 256:
            out = _backward_refused(out, q, k, v, f"v must have shape (..., {head_dim})")
        elif ("HDIMDIFF64" if head_dim <= 64 else "HDIMDIFF192") in _DISABLED:
            out = grads_never_written(out * float("nan"), q, k, v)
    if "BACKWARD" in _DISABLED:
        out = _backward_refused(out, q, k, v, "This flash attention build does not support backward.")
    return out, lse


def _backward_refused(out: torch.Tensor, q, k, v, message: str) -> torch.Tensor:
    return _Refused.apply(out, message, q, k, v)


class _Refused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, message, *inputs):
        ctx.message = message
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(ctx.message)


def _options(softmax_scale, causal, window_size, softcap, head_dim, unsupported):
    if any(unsupported):
        raise NotImplementedError("the stand-in implements no seqused/qv/descale/attention_chunk")
    left, right = window_size
    if causal:  # hopper/flash_api.cpp: if (is_causal) { window_size_right = 0; }
        right = 0
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    return {"scale": scale, "left": left, "right": right, "softcap": softcap}


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, unsupported, **kw):
    window_size, softcap = kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0)
    _check_call(q, k, v, q.shape[2], v.shape[2], 0.0, window_size, softcap, varlen=True)
    segments = varlen_segments(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    options = _options(kw.get("softmax_scale"), kw.get("causal", False), window_size, softcap, q.shape[2], unsupported)
    record("fa3.flash_attn_varlen_func", segments, causal=kw.get("causal", False), **options)
    return _attend(q, k, v, segments, q.shape[2], v.shape[2], options)


def _fixed(q, k, v, unsupported, **kw):
    window_size, softcap = kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0)
    _check_call(q, k, v, q.shape[3], v.shape[3], 0.0, window_size, softcap, varlen=False)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    segments: list[Segment] = [(i * sq, (i + 1) * sq, i * sk, (i + 1) * sk) for i in range(b)]
    options = _options(kw.get("softmax_scale"), kw.get("causal", False), window_size, softcap, q.shape[3], unsupported)
    record("fa3.flash_attn_func", segments, causal=kw.get("causal", False), **options)
    out, lse = _attend(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), segments, q.shape[3], v.shape[3], options)
    return out.unflatten(0, (b, sq)), lse.unflatten(1, (b, sq)).transpose(0, 1)


def _returned(pair, return_attn_probs=None):
    """(out, lse) before 2025-07-11; out from then on; the pair again when return_attn_probs=True (main)."""
    if not _since("2.8.3") or return_attn_probs:
        return pair
    return pair[0]


# ----------------------------------------------------------------------------- 2024-08-29 (7b4e68e0)


def _varlen_2024_08(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    deterministic=False,
    seqused_q=None,
    seqused_k=None,
):
    unsupported = (seqused_q is not None, seqused_k is not None)
    kw = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window_size}
    return _returned(_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, unsupported, **kw))


def _fixed_2024_08(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    deterministic=False,
    descale_q=None,
    descale_k=None,
    descale_v=None,
):
    unsupported = (descale_q is not None,)
    return _returned(_fixed(q, k, v, unsupported, softmax_scale=softmax_scale, causal=causal, window_size=window_size))


# ----------------------------------------------------------------------------- 2025-01-07 (7a802796)


def _varlen_2025_01(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    sink_token_length=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
):
    unsupported = (seqused_q is not None, seqused_k is not None, q_descale is not None, sink_token_length)
    kw = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window_size, "softcap": softcap}
    return _returned(_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, unsupported, **kw))


def _fixed_2025_01(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    sink_token_length=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
):
    unsupported = (q_descale is not None, sink_token_length)
    kw = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window_size, "softcap": softcap}
    return _returned(_fixed(q, k, v, unsupported, **kw))


# ----------------------------------------------------------------------------- 2025-04-10 (909eb7ce) and 2.8.3


def _varlen_2025_04(
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
):
    unsupported = (seqused_q is not None, seqused_k is not None, qv is not None, q_descale is not None, attention_chunk)
    kw = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window_size, "softcap": softcap}
    return _returned(_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, unsupported, **kw))


def _fixed_2025_04(
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
):
    unsupported = (qv is not None, q_descale is not None, attention_chunk)
    kw = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window_size, "softcap": softcap}
    return _returned(_fixed(q, k, v, unsupported, **kw))


# ----------------------------------------------------------------------------- main (0251105a)


def _varlen_main(
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
    """``q [total_q, Hq, D]``, ``k/v [total_k, Hkv, D|Dv]`` -> ``out`` (+ ``lse [Hq, total_q]``)."""
    unsupported = (seqused_q is not None, seqused_k is not None, qv is not None, q_descale is not None, attention_chunk)
    kw = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window_size, "softcap": softcap}
    pair = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, unsupported, **kw)
    return _returned(pair, return_attn_probs)


def _fixed_main(
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
    """``q [B, Sq, Hq, D]``, ``k/v [B, Sk, Hkv, D|Dv]`` -> ``out [B, Sq, Hq, Dv]`` (+ ``lse [B, Hq, Sq]``)."""
    unsupported = (qv is not None, q_descale is not None, attention_chunk)
    kw = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window_size, "softcap": softcap}
    return _returned(_fixed(q, k, v, unsupported, **kw), return_attn_probs)


_FUNCTIONS = {
    "2024-08": (_varlen_2024_08, _fixed_2024_08),
    "2025-01": (_varlen_2025_01, _fixed_2025_01),
    "2025-04": (_varlen_2025_04, _fixed_2025_04),
    "2.8.3": (_varlen_2025_04, _fixed_2025_04),
    "main": (_varlen_main, _fixed_main),
}
flash_attn_varlen_func, flash_attn_func = _FUNCTIONS[ERA]


# ============================================================================= the private pair
# ``_flash_attn_forward``/``_flash_attn_backward`` of each era, parameter for parameter with the real defaults:
# 2024-08 7b4e68e0 (fixed-length only, a separate varlen pair), 2025-01 7a802796, 2025-04 909eb7ce (the same in
# v2.8.3), main 0251105a (``torch.library.custom_op``s since c7697bbf, defaults since 5e114d53, ``out_`` since
# 3fcde4b3). hopper/flash_api.cpp: ``softmax_lse`` is fp32 ``[B, Hq, Sq]`` (fixed) or ``[Hq, total_q]`` (varlen);
# the backward reads it through its raw pointer in that layout, checks ``out``/``dout``/``dq`` dtypes against
# q's and writes the ``dq``/``dk``/``dv`` it is given. float64 inputs (CPU tests only) keep a float64 lse.


def _private_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        if not _since("main"):  # the C++ takes `float softmax_scale` until the custom ops' std::optional<double>
            raise TypeError("fwd(): incompatible function arguments: softmax_scale must be a float")
        return head_dim**-0.5
    return softmax_scale


def _private_segments(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> list[Segment]:
    if cu_seqlens_q is None:
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        return [(i * sq, (i + 1) * sq, i * sk, (i + 1) * sk) for i in range(b)]
    return varlen_segments(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)


def _tokens(*tensors):
    """Fixed-length ``[B, S, H, D]`` tensors as token-major ``[B * S, H, D]`` (varlen ones are already)."""
    return [t.flatten(0, 1) if t.dim() == 4 else t for t in tensors]


def _private_forward(q, k, v, seqlens, softmax_scale, causal, window_size, softcap, unsupported):
    """``(out, softmax_lse, out_accum, softmax_lse_accum)`` as hopper/flash_api.cpp ``mha_fwd`` returns them."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    _check_call(q, k, v, head_dim, head_dim_v, 0.0, window_size, softcap, varlen=seqlens[0] is not None)
    segments = _private_segments(q, k, *seqlens)
    scale = _private_scale(softmax_scale, head_dim)
    options = _options(scale, causal, window_size, softcap, head_dim, unsupported)
    record("fa3._flash_attn_forward", segments, causal=causal, **options)
    with torch.no_grad():
        out, lse = attend(*_tokens(q, k, v), segments, **options)
    if head_dim_v != head_dim and ("HDIMDIFF64" if head_dim <= 64 else "HDIMDIFF192") in _DISABLED:
        out = out * float("nan")  # a kernel of the wrong width
    if q.dim() == 4:
        out, lse = out.unflatten(0, q.shape[:2]), lse.unflatten(1, q.shape[:2]).transpose(0, 1).contiguous()
    return out, lse, torch.empty(0), torch.empty(0)


def _private_backward(tensors, seqlens, softmax_scale, causal, window_size, softcap, unsupported):
    """Write ``dq``/``dk``/``dv`` from the ``out`` and ``softmax_lse`` given; returns ``softmax_d``."""
    dout, q, k, v, out, softmax_lse, dq, dk, dv = tensors
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    _check_call(q, k, v, head_dim, head_dim_v, 0.0, window_size, softcap, varlen=seqlens[0] is not None)
    if "BACKWARD" in _DISABLED:
        raise RuntimeError("This flash attention build does not support backward.")
    if head_dim_v != head_dim and not _since("2.8.3"):
        raise RuntimeError(f"v must have shape (..., {head_dim})")  # the Dv != D backward came on 2025-04-24
    for name, tensor in (("out", out), ("dout", dout)):
        if tensor.dtype != q.dtype:
            raise RuntimeError(f"query and {name} must have the same dtype")
        if tensor.shape[:-1] != q.shape[:-1] or tensor.shape[-1] != head_dim_v:
            raise RuntimeError(f"{name} must have shape {(*q.shape[:-1], head_dim_v)}")
    for name, given, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if given is None:
            raise NotImplementedError("the stand-in needs dq/dk/dv given (the real one allocates them)")
        if given.dtype != q.dtype or given.shape != like.shape:
            raise RuntimeError(f"{name} must have the same dtype and shape as {name[1]}")
    segments = _private_segments(q, k, *seqlens)
    scale = _private_scale(softmax_scale, head_dim)
    options = _options(scale, causal, window_size, softcap, head_dim, unsupported)
    record("fa3._flash_attn_backward", segments, causal=causal, **options)
    # the kernel reads softmax_lse through its data pointer as a contiguous [B, Hq, Sq] / [Hq, total_q]
    raw = softmax_lse.as_strided(softmax_lse.shape, torch.empty(softmax_lse.shape).stride())
    lse = raw.transpose(0, 1).flatten(1, 2) if q.dim() == 4 else raw
    flat = _tokens(dout, q, k, v, out)
    grads = backward_from_lse(*flat[:5], lse, segments, **options)
    for target, grad in zip(_tokens(dq, dk, dv), grads):
        target.copy_(grad)
    return (dout.float() * out.float()).sum(-1)


# ----------------------------------------------------------------------------- 2024-08 (7b4e68e0)


def _forward_2024_08(q, k, v, softmax_scale, causal, window_size, descale_q=None, descale_k=None, descale_v=None):
    raise NotImplementedError("the stand-in does not run the 2024-08 private pair (the kernel refuses it)")


def _backward_2024_08(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size,
                      deterministic=False):  # fmt: skip
    raise NotImplementedError("the stand-in does not run the 2024-08 private pair (the kernel refuses it)")


# ----------------------------------------------------------------------------- 2025-01 (7a802796)


def _forward_2025_01(
    q, k, v, k_new, v_new, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k, max_seqlen_q,
    max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, q_descale, k_descale, v_descale,
    softmax_scale, causal, window_size=(-1, -1), sink_token_length=0, softcap=0.0, rotary_interleaved=True,
    num_splits=1, pack_gqa=None, sm_margin=0,
):  # fmt: skip
    assert sink_token_length == 0, "sink_token_length not supported yet"
    unsupported = (k_new, out, seqused_q, seqused_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, q_descale)
    seqlens = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    unused = [t is not None for t in unsupported]
    return _private_forward(q, k, v, seqlens, softmax_scale, causal, window_size, softcap, unused)


def _backward_2025_01(
    dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q, max_seqlen_k,
    dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), sink_token_length=0, softcap=0.0, deterministic=False,
    sm_margin=0,
):  # fmt: skip
    assert sink_token_length == 0, "sink_token_length not supported yet"
    tensors = (dout, q, k, v, out, softmax_lse, dq, dk, dv)
    seqlens = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    unused = (sequed_q is not None, sequed_k is not None)
    softmax_d = _private_backward(tensors, seqlens, softmax_scale, causal, window_size, softcap, unused)
    return dq, dk, dv, softmax_d


# ----------------------------------------------------------------------------- 2025-04 (909eb7ce) and 2.8.3


def _forward_2025_04(
    q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
    max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
    q_descale, k_descale, v_descale, softmax_scale, causal, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
    rotary_interleaved=True, scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0,
):  # fmt: skip
    unsupported = (k_new, qv, out, seqused_q, seqused_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, q_descale)
    seqlens = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    unused = [t is not None for t in unsupported] + [attention_chunk]
    return _private_forward(q, k, v, seqlens, softmax_scale, causal, window_size, softcap, unused)


def _backward_2025_04(
    dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q, max_seqlen_k,
    dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), softcap=0.0, deterministic=False, sm_margin=0,
):  # fmt: skip
    tensors = (dout, q, k, v, out, softmax_lse, dq, dk, dv)
    seqlens = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    unused = (sequed_q is not None, sequed_k is not None)
    softmax_d = _private_backward(tensors, seqlens, softmax_scale, causal, window_size, softcap, unused)
    return dq, dk, dv, softmax_d


# ----------------------------------------------------------------------------- main (0251105a): custom ops

_NAMESPACE = f"fa3_standin_{uuid.uuid4().hex[:8]}"  # the real "flash_attn_3"; one per import of the stand-in


@torch.library.custom_op(f"{_NAMESPACE}::_flash_attn_forward", mutates_args=())
def _forward_main(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    qv: torch.Tensor | None = None,
    out_: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    page_table: torch.Tensor | None = None,
    kv_batch_idx: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    seqlens_rotary: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: torch.Tensor | None = None,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    unsupported = (k_new, qv, out_, seqused_q, seqused_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, q_descale)
    seqlens = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    unused = [t is not None for t in unsupported] + [attention_chunk]
    window = (window_size_left, window_size_right)
    return _private_forward(q, k, v, seqlens, softmax_scale, causal, window, softcap, unused)


@torch.library.custom_op(f"{_NAMESPACE}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _backward_main(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    sequed_q: torch.Tensor | None = None,
    sequed_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    deterministic: bool = False,
    sm_margin: int = 0,
) -> torch.Tensor:
    tensors = (dout, q, k, v, out, softmax_lse, dq, dk, dv)
    seqlens = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    unused = (sequed_q is not None, sequed_k is not None)
    window = (window_size_left, window_size_right)
    return _private_backward(tensors, seqlens, softmax_scale, is_causal, window, softcap, unused)


_PRIVATE = {
    "2024-08": (_forward_2024_08, _backward_2024_08),
    "2025-01": (_forward_2025_01, _backward_2025_01),
    "2025-04": (_forward_2025_04, _backward_2025_04),
    "2.8.3": (_forward_2025_04, _backward_2025_04),
    "main": (_forward_main, _backward_main),
}
_flash_attn_forward, _flash_attn_backward = _PRIVATE[ERA]

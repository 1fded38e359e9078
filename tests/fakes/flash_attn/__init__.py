"""Stand-in for flash-attn 2 (``flash_attn_varlen_func`` and ``flash_attn_func``), release ``machine.ACTIVE.flash``.

Signatures are the real ones, parameter for parameter, with the real defaults;
they are the same from v2.6.0 to v2.8.3 (flash_attn/flash_attn_interface.py:
``flash_attn_varlen_func`` at line 1370 of v2.8.3 / 1375 of v2.7.4.post1,
``flash_attn_func`` at 1135 / 1140). A misspelt keyword fails here as it would there.

What changes with the release and the device, as the real C++ does it
(csrc/flash_attn/flash_api.cpp and src/flash_bwd_launch_template.h at each tag):

- sm80+ only (``is_sm8x_min``); Blackwell kernels from 2.7.3 (older builds have none);
- ``v`` must have q/k's head dim (``CHECK_SHAPE(v, ..., head_size)``, every 2.x);
- soft-capping has no dropout; before 2.6.2 its backward ignores the tanh (silently wrong);
- the backward for head dims > 192 with dropout: refused off sm80/sm90 up to 2.7.2, and from
  2.7.3 with less than 144 KB of opt-in shared memory nothing writes the gradients (NaN here).

Semantics: ``fake_varlen_core``.
"""

from __future__ import annotations

import machine
import torch
from fake_varlen_core import (
    Segment,
    attend,
    attend_softcap_backward_without_tanh,
    check_dtypes,
    check_heads,
    check_value_shape,
    grads_never_written,
    record,
    varlen_segments,
)

if machine.ACTIVE.flash is None:
    raise ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn")

__version__ = machine.ACTIVE.flash
_RELEASE = machine.release(__version__)


def _check_device(head_dim: int, dropout_p: float) -> None:
    capability = machine.capability()
    if capability is None:
        return
    if capability < (8, 0):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    if capability >= (10, 0) and _RELEASE < (2, 7, 3):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
    if head_dim > 192 and dropout_p > 0 and _RELEASE < (2, 7, 3) and capability not in ((8, 0), (9, 0)):
        raise RuntimeError("FlashAttention backward for head dim > 192 with dropout requires A100/A800 or H100/H800")


def _attend(q, k, v, segments, head_dim, options):
    softcap, dropout_p = options["softcap"], options["dropout_p"]
    if softcap > 0 and _RELEASE < (2, 6, 2):
        options = {key: value for key, value in options.items() if key != "dropout_p"}
        return attend_softcap_backward_without_tanh(q, k, v, segments, **options)
    out, lse = attend(q, k, v, segments, **options)
    device = machine.ACTIVE.device
    if device is not None and -(-head_dim // 8) * 8 > 192 and dropout_p > 0 and device.smem_optin < 144 * 1024:
        out = grads_never_written(out, q, k, v)  # run_mha_bwd_hdim256 launches no dropout kernel
    return out, lse


def _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, head_dim):
    if alibi_slopes is not None:
        raise NotImplementedError("the stand-in does not implement alibi_slopes")
    if softcap > 0 and dropout_p > 0:
        raise RuntimeError("Softcapping does not support dropout for now")
    _check_device(head_dim, dropout_p)
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
    check_value_shape(k, v)
    segments = varlen_segments(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, q.shape[2])
    record("flash_attn_varlen_func", segments, causal=causal, deterministic=deterministic, **options)
    out, lse = _attend(q, k, v, segments, q.shape[2], options)
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
    check_value_shape(k, v)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    segments: list[Segment] = [(i * sq, (i + 1) * sq, i * sk, (i + 1) * sk) for i in range(b)]
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, q.shape[3])
    record("flash_attn_func", segments, causal=causal, deterministic=deterministic, **options)
    out, lse = _attend(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), segments, q.shape[3], options)
    out = out.unflatten(0, (b, sq))
    return _result(out, lse.unflatten(1, (b, sq)).transpose(0, 1), return_attn_probs)

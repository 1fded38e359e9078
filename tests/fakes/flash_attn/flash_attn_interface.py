"""Stand-in for flash-attn 2's private forward/backward pair in ``flash_attn.flash_attn_interface``.

``_flash_attn_varlen_forward``/``_flash_attn_forward`` return the log-sum-exp and
``_flash_attn_varlen_backward``/``_flash_attn_backward`` take ``out`` and ``softmax_lse`` and write
``dq``/``dk``/``dv`` in place. Parameter lists, defaults and return values are the real ones of
``machine.ACTIVE.flash``'s era (flash_attn/flash_attn_interface.py):

- 2.6.x (v2.6.2 lines 48-200): ``window_size`` is a tuple; the forwards return
  ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)``, the backwards ``(dq, dk, dv, softmax_d)``;
- 2.7.0 on (v2.7.0 to v2.8.3): ``torch.library.custom_op``s with ``window_size_left``/``window_size_right``
  ints and a float ``softmax_scale`` (``None`` does not match the schema); the forwards return
  ``(out, softmax_lse, S_dmask, rng_state)``, the backwards ``softmax_d`` (``dq``/``dk``/``dv`` mutated),
  and the C++ refuses head dims that are not multiples of 8 (the public functions pad them first).

The backwards compute from the ``out`` and ``softmax_lse`` they are given (``fake_varlen_core.backward_from_lse``).
The real ``softmax_lse`` is fp32; for float64 inputs (CPU tests only) the stand-ins return it in float64.
"""

from __future__ import annotations

import torch
from fake_varlen_core import (
    Segment,
    attend,
    backward_from_lse,
    check_dtypes,
    check_heads,
    check_value_shape,
    record,
    varlen_segments,
)

import flash_attn

_SPLIT_WINDOW = flash_attn._RELEASE >= (2, 7, 0)


def _check(q, k, v, dropout_p, softmax_scale, softcap, head_dim):
    check_dtypes(q, k, v)
    check_value_shape(k, v)
    if _SPLIT_WINDOW and not isinstance(softmax_scale, float):
        raise TypeError(f"flash_attn::_flash_attn_forward() expected a float softmax_scale, got {softmax_scale!r}")
    if _SPLIT_WINDOW and head_dim % 8:
        raise RuntimeError("query, key, value, and out_ must have a head_size that is a multiple of 8")
    if softcap > 0 and dropout_p > 0:
        raise RuntimeError("Softcapping does not support dropout for now")
    if dropout_p > 0:
        raise NotImplementedError("the stand-in's private pair does not implement dropout (rng_state)")
    flash_attn._check_device(head_dim, dropout_p)


def _window(causal, left, right):
    return left, 0 if causal else right


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k):
    return varlen_segments(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)


def _fixed_segments(q, k) -> list[Segment]:
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    return [(i * sq, (i + 1) * sq, i * sk, (i + 1) * sk) for i in range(b)]


def _forward(q, k, v, segments, scale, causal, left, right, softcap, fn):
    left, right = _window(causal, left, right)
    check_heads(q.shape[-2], k.shape[-2], q.shape[-1], multiple_of_8=_SPLIT_WINDOW)
    record(fn, segments, causal=causal, scale=scale, left=left, right=right, softcap=softcap)
    with torch.no_grad():
        return attend(q, k, v, segments, scale=scale, left=left, right=right, softcap=softcap)


def _backward_into(dout, q, k, v, out, lse, dq, dk, dv, segments, scale, causal, left, right, softcap, fn):
    left, right = _window(causal, left, right)
    record(fn, segments, causal=causal, scale=scale, left=left, right=right, softcap=softcap)
    for name, given, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if given is None or given.shape != like.shape or given.dtype != like.dtype:
            raise RuntimeError(f"{name} must be given with the shape and dtype of its input (the stand-in needs it)")
    grads = backward_from_lse(dout, q, k, v, out, lse, segments, scale=scale, left=left, right=right, softcap=softcap)
    for target, grad in zip((dq, dk, dv), grads):
        target.copy_(grad)
    softmax_d = (dout.float() * out.float()).sum(-1)
    return dq, dk, dv, softmax_d


def _fixed_forward(q, k, v, dropout_p, scale, causal, left, right, softcap, fn):
    """``q [B, Sq, Hq, D]``: ``out [B, Sq, Hq, Dv]`` and ``lse [B, Hq, Sq]``."""
    _check(q, k, v, dropout_p, scale, softcap, q.shape[-1])
    b, sq = q.shape[:2]
    flat = (t.flatten(0, 1) for t in (q, k, v))
    out, lse = _forward(*flat, _fixed_segments(q, k), scale, causal, left, right, softcap, fn)
    return out.unflatten(0, (b, sq)), lse.unflatten(1, (b, sq)).transpose(0, 1)


def _varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, left, right, softcap, fn):
    """``q [Tq, Hq, D]``: ``out [Tq, Hq, Dv]`` and ``lse [Hq, Tq]``."""
    _check(q, k, v, dropout_p, scale, softcap, q.shape[-1])
    segments = _varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    return _forward(q, k, v, segments, scale, causal, left, right, softcap, fn)


def _fixed_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, scale, causal, left, right, softcap, fn):
    """``[B, S, H, D]`` inputs, ``lse [B, Hq, Sq]``: writes ``dq``/``dk``/``dv``, returns ``softmax_d [Hq, B * Sq]``."""
    _check(q, k, v, dropout_p, scale, softcap, q.shape[-1])
    flat = [t.flatten(0, 1) for t in (dout, q, k, v, out, dq, dk, dv)]
    flat_lse = lse.transpose(0, 1).flatten(1, 2)  # [Hq, B * Sq]
    segments = _fixed_segments(q, k)
    *_, softmax_d = _backward_into(*flat[:5], flat_lse, *flat[5:], segments, scale, causal, left, right, softcap, fn)
    return softmax_d


def _varlen_backward(
    dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, left, right, softcap, fn
):
    """``[T, H, D]`` inputs, ``lse [Hq, Tq]``: writes ``dq``/``dk``/``dv``, returns ``softmax_d [Hq, Tq]``."""
    _check(q, k, v, dropout_p, scale, softcap, q.shape[-1])
    segments = _varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    tensors = (dout, q, k, v, out, lse, dq, dk, dv)
    *_, softmax_d = _backward_into(*tensors, segments, scale, causal, left, right, softcap, fn)
    return softmax_d


def _dmask_and_rng() -> tuple[torch.Tensor, torch.Tensor]:
    """The forwards' ``S_dmask`` (empty: no ``return_softmax``) and ``rng_state`` (no dropout)."""
    return torch.empty(0), torch.empty(2, dtype=torch.int64)


# Each era's exact signature as a thin wrapper over the bodies above.
if _SPLIT_WINDOW:

    def _flash_attn_forward(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        return_softmax,
    ):
        window = (window_size_left, window_size_right)
        out, lse = _fixed_forward(q, k, v, dropout_p, softmax_scale, causal, *window, softcap, "_flash_attn_forward")
        return out, lse, *_dmask_and_rng()

    def _flash_attn_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
        block_table=None,
        leftpad_k=None,
        seqused_k=None,
        zero_tensors=False,
    ):
        lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        window = (window_size_left, window_size_right)
        fn = "_flash_attn_varlen_forward"
        out, lse = _varlen_forward(q, k, v, *lengths, dropout_p, softmax_scale, causal, *window, softcap, fn)
        return out, lse, *_dmask_and_rng()

    def _flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        tensors = (dout, q, k, v, out, softmax_lse, dq, dk, dv)
        window = (window_size_left, window_size_right)
        return _fixed_backward(*tensors, dropout_p, softmax_scale, causal, *window, softcap, "_flash_attn_backward")

    def _flash_attn_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
        zero_tensors=False,
    ):
        tensors = (dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        window = (window_size_left, window_size_right)
        fn = "_flash_attn_varlen_backward"
        return _varlen_backward(*tensors, dropout_p, softmax_scale, causal, *window, softcap, fn)

else:

    def _flash_attn_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax
    ):
        out, lse = _fixed_forward(
            q, k, v, dropout_p, softmax_scale, causal, *window_size, softcap, "_flash_attn_forward"
        )
        return out, q, k, v, out, lse, *_dmask_and_rng()

    def _flash_attn_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
        block_table=None,
        leftpad_k=None,
        seqused_k=None,
    ):
        lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        fn = "_flash_attn_varlen_forward"
        out, lse = _varlen_forward(q, k, v, *lengths, dropout_p, softmax_scale, causal, *window_size, softcap, fn)
        return out, q, k, v, out, lse, *_dmask_and_rng()

    def _flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        tensors = (dout, q, k, v, out, softmax_lse, dq, dk, dv)
        fn = "_flash_attn_backward"
        return dq, dk, dv, _fixed_backward(*tensors, dropout_p, softmax_scale, causal, *window_size, softcap, fn)

    def _flash_attn_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        tensors = (dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        fn = "_flash_attn_varlen_backward"
        return dq, dk, dv, _varlen_backward(*tensors, dropout_p, softmax_scale, causal, *window_size, softcap, fn)

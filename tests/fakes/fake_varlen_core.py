"""FlashAttention-family semantics on packed tensors, shared by the flash-attn, FA3 and torch stand-ins.

What the real kernels compute (flash-attn 2.7.4.post1/2.8.3 ``flash_attn_interface.py`` docstrings and
``csrc/flash_attn/flash_api.cpp``; FA3 ``hopper/flash_api.cpp``; torch's bundled copy of flash-attn 2):

- scores ``S = scale * Q K^T`` per segment (GQA: query head ``h`` reads key head ``h // (Hq / Hkv)``);
  with ``softcap > 0``: ``S = softcap * tanh(S / softcap)`` (flash_api.cpp ``params.softcap = scale / softcap``);
- query row ``i`` of a segment with ``sq`` queries and ``sk`` keys sees keys
  ``[i + sk - sq - left, i + sk - sq + right]`` inclusive, a negative bound meaning unbounded;
  ``causal=True`` sets ``right = 0`` (bottom-right alignment since flash-attn 2.1);
- ``softmax_lse`` is the natural log-sum-exp of a row's visible scores (``+inf`` for a row that sees
  nothing, whose output is zero), varlen shape ``[Hq, total_q]``;
- dropout multiplies the probabilities by a keep mask scaled by ``1 / (1 - p)``;
- the LSE output carries no gradient: every real backward (``backward(ctx, dout, *args)``) drops it.

The real kernels take only fp16/bf16 on CUDA; :data:`ALLOWED_DTYPES` widens that so tests run on CPU
in float64. Computation is in float64 for float64 inputs, else float32 (the kernels accumulate in fp32).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

ALLOWED_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
CALLS: list[dict[str, Any]] = []  # one entry per stand-in call: which function, segment lengths, options
Segment = tuple[int, int, int, int]  # (q_start, q_stop, k_start, k_stop)


def check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``query and key must have the same dtype`` etc. (flash_api.cpp), fp16/bf16 widened for CPU tests."""
    if q.dtype not in ALLOWED_DTYPES:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise RuntimeError("Input tensor must have contiguous last dimension")


def check_heads(q_heads: int, k_heads: int, head_dim: int, multiple_of_8: bool) -> None:
    """Head-count and head-dim checks of flash_api.cpp (FA2 pads the head dim in Python; FA3 and torch do not)."""
    if head_dim > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if multiple_of_8 and head_dim % 8:
        raise RuntimeError("head_size should be a multiple of 8")
    if q_heads % k_heads:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def check_value_shape(k: torch.Tensor, v: torch.Tensor) -> None:
    """flash-attn 2 and torch's copy: ``CHECK_SHAPE(v, total_k, num_heads_k, head_size)`` (v's head dim = q's)."""
    if v.shape != k.shape:
        raise RuntimeError(f"v must have shape {tuple(k.shape)}")


def grads_never_written(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``out`` whose backward leaves the input gradients unwritten (``torch.empty``): NaN here, garbage on a GPU."""
    return _Unwritten.apply(out, *inputs)


class _Unwritten(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(t.shape, t.dtype) for t in inputs]
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (None, *(torch.full(shape, float("nan"), dtype=dtype) for shape, dtype in ctx.shapes))


def varlen_segments(
    cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q: Any, max_k: Any
) -> list[Segment]:
    """Validate ``cu_seqlens`` (int32, 1-D, equal length, rising from 0 to the totals) and the maxima.

    The real kernels trust the maxima and offsets (a wrong value reads out of bounds);
    the stand-in raises instead.
    """
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
            raise RuntimeError(f"{name} must have dtype int32")
        if cu.dim() != 1 or not cu.is_contiguous():
            raise RuntimeError(f"{name} must be a contiguous 1-D tensor")
    if cu_q.numel() != cu_k.numel():
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have the same length (batch_size + 1)")
    if not isinstance(max_q, int) or not isinstance(max_k, int):
        raise TypeError("max_seqlen_q/max_seqlen_k must be Python ints")
    qs, ks = cu_q.tolist(), cu_k.tolist()
    for name, values, total in (("cu_seqlens_q", qs, total_q), ("cu_seqlens_k", ks, total_k)):
        if values[0] != 0 or values[-1] != total or any(b < a for a, b in itertools.pairwise(values)):
            raise ValueError(f"{name}={values} must rise from 0 to {total}")
    q_lens = [b - a for a, b in itertools.pairwise(qs)]
    k_lens = [b - a for a, b in itertools.pairwise(ks)]
    if max_q < max(q_lens) or max_k < max(k_lens):
        raise ValueError(f"max_seqlen ({max_q}, {max_k}) below the real maxima ({max(q_lens)}, {max(k_lens)})")
    return [(q0, q1, k0, k1) for (q0, q1), (k0, k1) in zip(itertools.pairwise(qs), itertools.pairwise(ks))]


def record(fn: str, segments: list[Segment], **options: Any) -> None:
    """Remember a call (tests check which function attended which segments)."""
    q_lens = [b - a for a, b, _, _ in segments]
    CALLS.append({"fn": fn, "q_lens": q_lens, "k_lens": [d - c for _, _, c, d in segments], **options})


def visible(sq: int, sk: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """``[sq, sk]`` bool: key ``j`` visible from query ``i`` (bottom-right aligned window, inclusive)."""
    offset = torch.arange(sk, device=device)[None, :] - (torch.arange(sq, device=device)[:, None] + sk - sq)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    return allowed


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scores(qi: torch.Tensor, ki: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    s = qi @ ki.transpose(-1, -2) * scale
    return softcap * torch.tanh(s / softcap) if softcap > 0 else s


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[Segment],
    *,
    scale: float,
    left: int = -1,
    right: int = -1,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [Tq, Hq, D]``, ``k/v [Tk, Hkv, D]`` -> ``(out [Tq, Hq, D], lse [Hq, Tq])``, differentiable in ``out``."""
    rep = q.shape[1] // k.shape[1]
    work = _compute_dtype(q.dtype)
    outs, lses = [], []
    for q0, q1, k0, k1 in segments:
        qi = q[q0:q1].transpose(0, 1).to(work)
        ki = k[k0:k1].transpose(0, 1).repeat_interleave(rep, 0).to(work)
        vi = v[k0:k1].transpose(0, 1).repeat_interleave(rep, 0).to(work)
        s = _scores(qi, ki, scale, softcap).masked_fill(~visible(q1 - q0, k1 - k0, left, right, q.device), -torch.inf)
        lse = torch.logsumexp(s, dim=-1)
        empty = torch.isneginf(lse)
        p = torch.exp(s - lse.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
        if dropout_p > 0:
            p = p * (torch.rand_like(p) >= dropout_p) / (1.0 - dropout_p)
        outs.append((p @ vi).transpose(0, 1))
        lses.append(lse.masked_fill(empty, torch.inf))
    out = torch.cat(outs, 0).to(q.dtype)
    return out, _GradDropped.apply(torch.cat(lses, 1).detach(), out)


def attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[Segment],
    *,
    scale: float,
    left: int = -1,
    right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form gradients of :func:`attend` (no dropout, no softcap), for stand-ins that run below autograd.

    ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``, ``dQ = scale dS K``, ``dK = scale dS^T Q``, ``dV = P^T dO``.
    """
    return _backward(dout, q, k, v, segments, scale=scale, left=left, right=right)


def _backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[Segment],
    *,
    scale: float,
    left: int,
    right: int,
    probabilities: Any = None,
    out: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The closed-form backward; ``probabilities(s_raw, segment index)`` replaces ``softmax(scale * s_raw)``.

    ``out`` (the forward's output, as the real kernels save it) gives ``rowsum(dO * O)``; by default it is ``P V``.
    ``softcap > 0`` chains ``dS`` through ``softcap * tanh(scale * s_raw / softcap)``: ``* (1 - tanh^2)``.
    """
    rep = q.shape[1] // k.shape[1]
    work = _compute_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(t, dtype=work) for t in (q, k, v))
    for index, (q0, q1, k0, k1) in enumerate(segments):
        qi = q[q0:q1].transpose(0, 1).to(work)
        ki = k[k0:k1].transpose(0, 1).repeat_interleave(rep, 0).to(work)
        vi = v[k0:k1].transpose(0, 1).repeat_interleave(rep, 0).to(work)
        doi = dout[q0:q1].transpose(0, 1).to(work)
        hidden = ~visible(q1 - q0, k1 - k0, left, right, q.device)
        if probabilities is None:
            p = torch.softmax(_scores(qi, ki, scale, 0.0).masked_fill(hidden, -torch.inf), dim=-1).nan_to_num(0.0)
        else:
            p = probabilities(qi @ ki.transpose(-1, -2), index).masked_fill(hidden, 0.0)
        oi = p @ vi if out is None else out[q0:q1].transpose(0, 1).to(work)
        ds = p * (doi @ vi.transpose(-1, -2) - (doi * oi).sum(-1, keepdim=True))
        if softcap > 0:
            ds = ds * (1 - torch.tanh(scale * (qi @ ki.transpose(-1, -2)) / softcap) ** 2)
        dq[q0:q1] = (scale * ds @ ki).transpose(0, 1)
        # a key head's gradient sums over the query heads that read it
        dk_i = (scale * ds.transpose(-1, -2) @ qi).unflatten(0, (-1, rep)).sum(1)
        dv_i = (p.transpose(-1, -2) @ doi).unflatten(0, (-1, rep)).sum(1)
        dk[k0:k1] += dk_i.transpose(0, 1)
        dv[k0:k1] += dv_i.transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def backward_from_lse(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segments: list[Segment],
    *,
    scale: float,
    left: int,
    right: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernels' backward computes from the ``out`` and ``lse [Hq, Tq]`` it is *given* (not recomputed).

    ``P = exp(S - lse)`` (``S`` soft-capped), ``dS = P * (dO V^T - rowsum(dO * out))``, chained through the
    soft-cap; a caller passing another ``out`` or ``lse`` gets the gradients of those, as on the GPU.
    """
    work = _compute_dtype(q.dtype)

    def probabilities(s_raw: torch.Tensor, index: int) -> torch.Tensor:
        q0, q1 = segments[index][:2]
        return torch.exp(_scores_from_raw(s_raw, scale, softcap) - lse[:, q0:q1, None].to(work))

    return _backward(
        dout,
        q,
        k,
        v,
        segments,
        scale=scale,
        left=left,
        right=right,
        probabilities=probabilities,
        out=out,
        softcap=softcap,
    )


def _scores_from_raw(s_raw: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    s = s_raw * scale
    return softcap * torch.tanh(s / softcap) if softcap > 0 else s


class _GradDropped(torch.autograd.Function):
    """``value``, attached to ``anchor``'s graph, whose gradient is dropped (the real kernels' LSE output)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


def attend_softcap_backward_without_tanh(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[Segment],
    *,
    scale: float,
    left: int,
    right: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn 2.6.0/2.6.1 with ``softcap``: a right forward and the backward those releases compute.

    ``flash_bwd_kernel.h`` has no soft-cap code before 2.6.2, and ``set_params_fprop``
    sets ``scale_softmax = softcap`` when soft-capping: the backward rebuilds
    ``P = exp(softcap * Q K^T - lse)`` (no tanh, the wrong scale) and scales dQ/dK by
    ``softcap``. Nothing raises.
    """
    out, lse = attend(q, k, v, segments, scale=scale, left=left, right=right, softcap=softcap)
    return _NoTanhBackward.apply(out, q, k, v, lse.detach(), segments, softcap, left, right), lse


class _NoTanhBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *args: Any) -> torch.Tensor:
        q, k, v, lse, segments, softcap, left, right = args
        ctx.save_for_backward(q, k, v, lse, out.detach())
        ctx.options = (segments, softcap, left, right)
        return out.detach().clone()

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, lse, out = ctx.saved_tensors
        segments, softcap, left, right = ctx.options
        work = _compute_dtype(q.dtype)

        def probabilities(s_raw: torch.Tensor, index: int) -> torch.Tensor:
            q0, q1 = segments[index][:2]
            return torch.exp(softcap * s_raw - lse[:, q0:q1, None].to(work))

        grads = _backward(
            dout, q, k, v, segments, scale=softcap, left=left, right=right, probabilities=probabilities, out=out
        )
        return (None, *grads, None, None, None, None, None)

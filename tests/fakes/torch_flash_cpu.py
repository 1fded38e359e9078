"""CPU kernels for ``aten::_flash_attention_forward``/``_backward``, so torch's real ``varlen_attn`` runs on CPU.

``torch.nn.attention.varlen.varlen_attn`` (torch 2.13) is Python down to these two
ops, which exist only for CUDA. Registering CPU implementations of exactly their
schemas keeps everything above them real: the argument checks, ``is_causal =
window_size == (-1, 0)``, the custom op and its autograd registration, the LSE
return. The kernels follow torch's CUDA path (aten/src/ATen/native/transformers/
cuda/attention.cu -> its bundled flash-attn 2 ``mha_varlen_fwd``): window bounds
``value_or(-1)``, ``is_causal`` forces ``window_size_right = 0``, causal bottom-right,
LSE ``[Hq, total_q]`` (float32 there; float64 here for float64 inputs), and the checks of
torch's copy of ``mha_varlen_fwd`` (flash_api.cpp): ``is_sm8x || is_sm90`` with ``is_sm8x =
major == 8``, ``head_size_og % 8 == 0`` ("this is ensured by padding!": nothing pads in
``varlen_attn``), ``<= 256``, v's shape equal to k's.
They run below autograd, so the backward is the closed form of ``fake_varlen_core``.
Once installed they stay for the process (no CPU kernel of these ops exists to restore).

:data:`ERAS` are ``varlen_attn`` as torch 2.10 and 2.11 spelt it (torch/nn/attention/varlen.py),
over the same op: 2.10 takes ``is_causal`` and no scale/window; 2.11 adds keyword-only
``scale``/``window_size`` and no ``enable_gqa`` (and no head-count check: the kernel takes GQA).
"""

from __future__ import annotations

import machine
import torch
from fake_varlen_core import (
    attend,
    attend_backward,
    check_dtypes,
    check_heads,
    check_value_shape,
    record,
    varlen_segments,
)

_LIBRARY: list[torch.library.Library] = []


def _window(is_causal: bool, left: int | None, right: int | None) -> dict[str, int]:
    return {"left": -1 if left is None else left, "right": 0 if is_causal else (-1 if right is None else right)}


def _forward(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
):
    if cum_seq_q is None or seqused_k is not None or alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("the stand-in implements the varlen path without seqused_k/alibi/paging")
    if dropout_p:
        raise NotImplementedError("varlen_attn passes dropout_p=0.0; the stand-in implements no dropout")
    capability = machine.capability()
    if capability is not None and not (capability[0] == 8 or capability == (9, 0)):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    check_dtypes(query, key, value)
    if query.shape[2] % 8:
        raise RuntimeError("head_size must be a multiple of 8, this is ensured by padding!")
    check_heads(query.shape[1], key.shape[1], query.shape[2], multiple_of_8=True)
    check_value_shape(key, value)
    segments = varlen_segments(cum_seq_q, cum_seq_k, query.shape[0], key.shape[0], int(max_q), int(max_k))
    window = _window(is_causal, window_size_left, window_size_right)
    record("aten._flash_attention_forward", segments, is_causal=is_causal, **window)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out, lse = attend(query, key, value, segments, scale=scale, **window)
    rng_state = torch.zeros(2, dtype=torch.uint64)
    return out, lse.detach(), rng_state, torch.empty(0), torch.empty(0)


def _backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    rng_state,
    unused,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
):
    segments = varlen_segments(cum_seq_q, cum_seq_k, query.shape[0], key.shape[0], int(max_q), int(max_k))
    window = _window(is_causal, window_size_left, window_size_right)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return attend_backward(grad_out, query, key, value, segments, scale=scale, **window)


def install() -> None:
    """Register the CPU kernels (idempotent)."""
    if not _LIBRARY:
        library = torch.library.Library("aten", "IMPL")
        library.impl("_flash_attention_forward", _forward, "CPU")
        library.impl("_flash_attention_backward", _backward, "CPU")
        _LIBRARY.append(library)


def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    out, lse, _ = torch.ops.torch_attn._varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal)
    return (out, lse) if return_aux is not None and return_aux.lse else out


def _varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1)):  # fmt: skip
    is_causal = window_size == (-1, 0)
    out, lse, _ = torch.ops.torch_attn._varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, list(window_size)
    )
    return (out, lse) if return_aux is not None and return_aux.lse else out


ERAS = {"2.10": _varlen_2_10, "2.11": _varlen_2_11}

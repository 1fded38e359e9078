"""CPU kernels for ``aten::_flash_attention_forward``/``_backward``, so torch's real ``varlen_attn`` runs on CPU.

``torch.nn.attention.varlen.varlen_attn`` (torch 2.13) is Python down to these two
ops, which exist only for CUDA. Registering CPU implementations of exactly their
schemas keeps everything above them real: the argument checks, ``is_causal =
window_size == (-1, 0)``, the custom op and its autograd registration, the LSE
return. The kernels follow torch's CUDA path (aten/src/ATen/native/transformers/
cuda/attention.cu -> its bundled flash-attn 2 ``mha_varlen_fwd``): window bounds
``value_or(-1)``, ``is_causal`` forces ``window_size_right = 0``, causal bottom-right,
LSE ``[Hq, total_q]`` (float32 there; float64 here for float64 inputs).
They run below autograd, so the backward is the closed form of ``fake_varlen_core``.
Once installed they stay for the process (no CPU kernel of these ops exists to restore).
"""

from __future__ import annotations

import torch
from fake_varlen_core import attend, attend_backward, check_dtypes, check_heads, record, varlen_segments

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
    check_dtypes(query, key, value)
    check_heads(query.shape[1], key.shape[1], query.shape[2], multiple_of_8=False)
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

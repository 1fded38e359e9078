"""Route a HF model's attention through block-diagonal CP.

Two routes, chosen by ``model.attention``:

- ``hf_interface``: :func:`cp_blockdiag_attention` is registered in transformers'
  ``AttentionInterface`` as ``"cp_blockdiag"`` and the model's
  ``config._attn_implementation`` names it. transformers builds no mask for a name
  it has no mask function for, so no ``[L, L]`` mask is ever materialized.
- ``patch_sdpa``: the model keeps its stock ``"sdpa"`` attention and
  :func:`attention_scope` routes ``F.scaled_dot_product_attention`` through CP
  for the duration of a step (forward and backward).

Outside a CP step context both are exactly stock causal SDPA.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from nemo_automodel.components.distributed.blockdiag_cp import cp_blockdiag_sdpa, patch_sdpa

CP_ATTN_IMPLEMENTATION = "cp_blockdiag"
_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"  # read by transformers' sdpa_attention_forward at every call


def cp_blockdiag_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function backed by :func:`cp_blockdiag_sdpa`.

    Args:
        module: The calling attention module (unused).
        query: ``[B, Hq, L, D]`` (``B = 1`` inside a CP step).
        key: ``[B, Hkv, L, D]``.
        value: ``[B, Hkv, L, D]``.
        attention_mask: ``None`` unless the caller passed a 4-D mask; ignored inside a CP step.
        dropout: Attention dropout probability (0 in eval).
        scaling: Softmax scale.

    Returns:
        ``(attn_output [B, L, Hq, D], None)``: no attention weights.
    """
    del module, kwargs
    out = cp_blockdiag_sdpa(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        # Only used outside a CP step (stock SDPA): causal unless a mask says otherwise.
        is_causal=attention_mask is None and query.shape[2] > 1,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def register_cp_attention() -> None:
    """Make ``"cp_blockdiag"`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTN_IMPLEMENTATION, cp_blockdiag_attention)


def attn_implementation_for(route: str) -> str:
    """The HF ``attn_implementation`` for a ``model.attention`` route."""
    return {"hf_interface": CP_ATTN_IMPLEMENTATION, "patch_sdpa": "sdpa", "eager": "eager"}[route]


@contextlib.contextmanager
def _hf_sdpa_keeps_kv_heads() -> Iterator[None]:
    """Make transformers' ``sdpa`` path pass grouped K/V heads as they are (``enable_gqa``).

    Without it, transformers repeats K/V heads only when it built a mask, and it
    builds one only when the local shard holds several documents: CP ranks would
    then exchange K/V with different head counts and the collective would fail.
    """
    previous = os.environ.get(_FORCE_GQA)
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_FORCE_GQA, None)
        else:
            os.environ[_FORCE_GQA] = previous


@contextlib.contextmanager
def _patched_sdpa_scope() -> Iterator[None]:
    with _hf_sdpa_keeps_kv_heads(), patch_sdpa():
        yield


def attention_scope(route: str) -> contextlib.AbstractContextManager[None]:
    """The context to hold around a step's forward and backward for ``route``."""
    return _patched_sdpa_scope() if route == "patch_sdpa" else contextlib.nullcontext()

"""Route a HF model's attention through block-diagonal CP.

Two routes, chosen by ``model.attention``:

- ``hf_interface``: :func:`cp_blockdiag_attention` is registered in transformers'
  ``AttentionInterface`` as ``"cp_blockdiag"`` and the model's
  ``config._attn_implementation`` names it. transformers builds no mask for a name
  it has no mask function for, so no ``[L, L]`` mask is ever materialized.
- ``patch_sdpa``: the model keeps its stock ``"sdpa"`` attention and
  :func:`attention_scope` routes ``F.scaled_dot_product_attention`` through CP
  for the duration of a step (forward and backward); :func:`prepare_attention`
  sets what transformers' ``sdpa`` path needs once, at setup.

Outside a CP step context both are exactly stock causal SDPA; ``hf_interface`` calls with a
sliding window, soft-cap or sinks are then computed exactly by :func:`explicit_attention`.
Inside a step, ``hf_interface`` hands those to the core as an ``AttentionVariant``;
``patch_sdpa`` cannot see them, so the recipe refuses it for models that have them
(:mod:`nemo_automodel.components.models.attention_features`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from nemo_automodel.components.distributed.blockdiag_cp import kernels, outside, patch_sdpa
from nemo_automodel.components.distributed.blockdiag_cp.runtime import attend_row
from nemo_automodel.components.distributed.blockdiag_cp.state import current_row_state
from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant

CP_ATTN_IMPLEMENTATION = "cp_blockdiag"
_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"  # read by transformers' sdpa_attention_forward at every call


# Keywords transformers' attention modules pass (see the ``attention_interface(...)`` calls in
# transformers/models/*/modeling_*.py) that carry no attention semantics for this function, and why.
# Anything not handled here or in ``_HARMLESS_AT`` raises: a dropped keyword would silently change the math.
_HARMLESS: dict[str, str] = {
    # rotary embeddings are applied before the call; document boundaries come from the CP step
    "position_ids": "used for rotary embeddings before attention",
    # the KV cache is updated by the attention module before the call
    "use_cache": "KV-cache bookkeeping, done before attention",
    # gpt-oss forwards its MoE flag through every layer's kwargs
    "output_router_logits": "an MoE router output flag",
    # forwarded through the layers by some models; affects the decoder's outputs only
    "output_hidden_states": "a decoder output flag",
    # loss normalization for gradient accumulation; forwarded through the layers by some models
    "num_items_in_batch": "a loss normalization count",
}
# Keywords that are harmless only at these values: anything else asks for something we do not compute.
_HARMLESS_AT: dict[str, tuple[Any, ...]] = {
    "is_causal": (None, True),  # False would ask for bidirectional attention
    "output_attentions": (None, False),  # True would ask for attention weights, which no CP kernel returns
}


def variant_source(module: torch.nn.Module) -> str:
    """Where an attention call comes from, e.g. ``"MistralForCausalLM layer 3"`` (named in every error)."""
    config = getattr(module, "config", None)
    architectures = getattr(config, "architectures", None) or [type(module).__name__]
    layer = getattr(module, "layer_idx", None)
    return f"{architectures[0]} layer {layer}" if layer is not None else architectures[0]


def attention_chunk(module: torch.nn.Module) -> int | None:
    """The attention chunk size of ``module``'s layer (Llama 4's chunked layers), or ``None``.

    transformers passes no keyword for it: the model builds a chunked causal mask
    (``create_chunked_causal_mask``, from ``config.attention_chunk_size``) for the layers
    whose ``config.layer_types`` entry is ``"chunked_attention"``, and no mask reaches
    this function, so the chunk is read from the same config fields.
    """
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    if not layer_types or layer is None or layer_types[layer] != "chunked_attention":
        return None
    return getattr(config, "attention_chunk_size", None)


def attention_variant(module: torch.nn.Module, kwargs: dict[str, Any]) -> AttentionVariant:
    """The :class:`AttentionVariant` a transformers attention call asks for; every keyword accounted for.

    Args:
        module: The calling attention module (names the source).
        kwargs: The call's keywords besides q/k/v, mask, ``dropout`` and ``scaling``.

    Raises:
        ValueError: for a keyword this function does not know, or a known one at a value it cannot honour,
            naming it and the model class and layer.
    """
    source = variant_source(module)
    rest = dict(kwargs)
    variant = AttentionVariant(
        window=rest.pop("sliding_window", None),
        chunk=attention_chunk(module),
        softcap=rest.pop("softcap", None),
        sinks=rest.pop("s_aux", None),
        source=source,
    )
    for name, value in rest.items():
        if name in _HARMLESS:
            continue
        if name in _HARMLESS_AT and any(value is ok for ok in _HARMLESS_AT[name]):
            continue
        shown = f"{name}={value!r}" if not isinstance(value, torch.Tensor) else f"{name} (a tensor)"
        raise ValueError(
            f"cp_blockdiag attention ({source}): keyword {shown} is not supported; block-diagonal CP never drops "
            "an attention argument. Known: sliding_window, softcap, s_aux, dropout, scaling, "
            f"{', '.join(sorted(_HARMLESS))}, is_causal=True, output_attentions=False"
        )
    return variant


def explicit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    variant: AttentionVariant,
) -> torch.Tensor:
    """Exact eager attention of one unpacked call (outside a CP step: eval, generation).

    Causal with the queries aligned to the last keys (a KV cache holds the earlier
    ones), inside ``variant.window`` or ``variant.chunk``, with its soft-cap and sinks: the core's
    explicit-score attention, as transformers' eager attention of these families.

    Args:
        query: ``[B, Hq, Lq, D]``.
        key: ``[B, Hkv, Lk, D]``.
        value: ``[B, Hkv, Lk, Dv]``.
        attention_mask: Optional 4-D bool (True = attend) or additive mask, combined with the causal one.
        dropout: Dropout on the attention weights.
        scaling: Softmax scale (``None``: ``D ** -0.5``).
        variant: Window, soft-cap and sinks.

    Returns:
        ``[B, Hq, Lq, Dv]``.
    """
    # with a chunk there are no cached keys (cp_blockdiag_attention refuses them), so key 0 is position 0
    q_pos = torch.arange(key.shape[2] - query.shape[2], key.shape[2], device=query.device)[:, None]
    k_pos = torch.arange(key.shape[2], device=query.device)[None, :]
    allowed = k_pos <= q_pos
    if variant.window is not None:
        allowed = allowed & (k_pos > q_pos - variant.window)
    if variant.chunk is not None:
        allowed = allowed & (k_pos // variant.chunk == q_pos // variant.chunk)
    bias = None
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        allowed = allowed & attention_mask
    elif attention_mask is not None:
        bias = attention_mask
    out = kernels.explicit_attention(query, key, value, allowed, scaling, dropout, variant, bias)
    return out.nan_to_num(0.0)  # a row with every key masked (left padding) is zero, not NaN


def _needs_explicit(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, variant: AttentionVariant
) -> bool:
    """Outside a CP step: whether stock SDPA cannot compute the call.

    SDPA cannot express a window, soft-cap or sinks; and its ``is_causal`` aligns
    the mask top-left, wrong when a KV cache holds earlier keys (``Lq != Lk``,
    e.g. chunked prefill), where the queries are the last positions.
    """
    cached = attention_mask is None and 1 < query.shape[2] != key.shape[2]
    return not variant.plain or cached


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
    """transformers ``AttentionInterface`` function: an adapter over the core (``runtime.attend_row``).

    The active row is read once per call from the thread-shared slot and passed to the core
    with the call's variant; outside a row the call is computed exactly here (stock SDPA, or
    :func:`explicit_attention` for what stock SDPA cannot express).

    Every keyword transformers passes is either part of the attention variant
    (``sliding_window``, ``softcap``, ``s_aux``), used (``dropout``, ``scaling``), or
    listed as harmless; any other raises (:func:`attention_variant`).

    Args:
        module: The calling attention module (names the model class and layer in errors).
        query: ``[B, Hq, L, D]`` (``B = 1`` inside a CP step).
        key: ``[B, Hkv, L, D]``.
        value: ``[B, Hkv, L, Dv]`` (``Dv`` may differ from ``D``: MLA).
        attention_mask: ``None`` unless the caller passed a 4-D mask; ignored inside a CP step.
        dropout: Attention dropout probability (0 in eval).
        scaling: Softmax scale.
        **kwargs: ``sliding_window``, ``softcap``, ``s_aux`` and the harmless keywords.

    Returns:
        ``(attn_output [B, L, Hq, Dv], None)``: no attention weights.
    """
    variant = attention_variant(module, kwargs)
    row = current_row_state()
    if row is not None:
        gqa = query.shape[1] != key.shape[1]
        out = attend_row(row, query, key, value, variant=variant, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    if variant.chunk is not None and query.shape[2] != key.shape[2]:
        raise ValueError(
            f"cp_blockdiag attention ({variant.source}): attention_chunk_size={variant.chunk} over "
            f"{key.shape[2] - query.shape[2]} cached keys: where the chunks start depends on the tokens' absolute "
            "positions, which transformers passes neither to attention nor with its (possibly truncated) chunk "
            "cache; generate with attn_implementation='eager' or 'sdpa' (cp_blockdiag computes full rows exactly)"
        )
    if _needs_explicit(query, key, attention_mask, variant):
        out = explicit_attention(query, key, value, attention_mask, dropout, scaling, variant)
    else:  # a plain call stock SDPA computes exactly: causal unless a mask says otherwise
        is_causal = attention_mask is None and query.shape[2] > 1
        call = (query, key, value, attention_mask, dropout, is_causal, scaling, query.shape[1] != key.shape[1])
        out = outside.stock_sdpa("cp_blockdiag attention outside a CP step", "", *call, PLAIN, {})
    return out.transpose(1, 2).contiguous(), None


def register_cp_attention() -> None:
    """Make ``"cp_blockdiag"`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTN_IMPLEMENTATION, cp_blockdiag_attention)


def attn_implementation_for(route: str) -> str:
    """The HF ``attn_implementation`` for a ``model.attention`` route."""
    return {"hf_interface": CP_ATTN_IMPLEMENTATION, "patch_sdpa": "sdpa", "eager": "eager"}[route]


def prepare_attention(route: str) -> None:
    """Once per process, before a model of ``route`` is built: what the route needs from transformers.

    Registers ``"cp_blockdiag"`` (every route: the packing probe and evaluation may use it). For
    ``patch_sdpa``, sets ``TRANSFORMERS_SDPA_FORCE_GQA=1``: transformers' ``sdpa`` path then passes
    grouped K/V heads as they are (``enable_gqa``). Without it, transformers repeats K/V heads only
    when it built a mask, and it builds one only when the local shard holds several documents: CP
    ranks would exchange K/V with different head counts and the collective would fail. Set here, once,
    so no step writes the environment (the value changes no result: grouped heads attend the same keys).
    """
    register_cp_attention()
    if route == "patch_sdpa":
        os.environ[_FORCE_GQA] = "1"


def attention_scope(route: str) -> contextlib.AbstractContextManager[None]:
    """The context to hold around a step's forward and backward for ``route`` (after :func:`prepare_attention`)."""
    return patch_sdpa() if route == "patch_sdpa" else contextlib.nullcontext()

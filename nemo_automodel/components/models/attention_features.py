"""What a model config asks of attention beyond per-document causal softmax: windows, chunks, soft-cap, sinks.

Read from the config with the semantics of transformers' own modeling code, so that
paths which cannot express these features (``model.attention=patch_sdpa``: stock
SDPA sees only a mask, which block-diagonal CP ignores) refuse the model by feature
name instead of silently training a different model.

- Qwen2 / Qwen3: a window only when ``use_sliding_window``, on layers ``>= max_window_layers``
  (as their ``layer_types`` say when present).
- Gemma 2 / 3, gpt-oss (any config with ``layer_types``): ``sliding_window`` on the
  ``"sliding_attention"`` layers.
- Mistral, Phi-3 (any other config): ``sliding_window`` on every layer (``None``: none).
- Gemma 2: ``attn_logit_softcapping``.
- gpt-oss: learned sinks (``s_aux``) on every layer.
- Llama 4: ``attention_chunk_size`` on the ``"chunked_attention"`` layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_SINK_TYPES = ("gpt_oss",)
_EVERY_LAYER_TYPES = ("mistral", "phi3")  # their modeling code slides on every layer, whatever layer_types says


@dataclass(frozen=True)
class AttentionFeatures:
    """The attention features a config implies.

    Attributes:
        windows: ``{layer: sliding window}`` for every windowed layer.
        chunks: ``{layer: attention chunk size}`` for every chunked layer.
        softcap: Attention logit soft-cap (``None``: none).
        sinks: Every layer has learned attention sinks.
    """

    windows: dict[int, int] = field(default_factory=dict)
    chunks: dict[int, int] = field(default_factory=dict)
    softcap: float | None = None
    sinks: bool = False

    def names(self) -> list[str]:
        """The features as a user would name them, e.g. ``["sliding_window=4096 (layers 0-31)"]``."""
        out = [f"sliding_window={w} (layers {_ranges(ls)})" for w, ls in _by_window(self.windows).items()]
        out += [f"attention_chunk_size={c} (layers {_ranges(ls)})" for c, ls in _by_window(self.chunks).items()]
        if self.softcap is not None:
            out.append(f"softcap={self.softcap} (attn_logit_softcapping)")
        if self.sinks:
            out.append("s_aux (attention sinks)")
        return out


def _by_window(windows: dict[int, int]) -> dict[int, list[int]]:
    grouped: dict[int, list[int]] = {}
    for layer, window in sorted(windows.items()):
        grouped.setdefault(window, []).append(layer)
    return grouped


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    start = prev = layers[0]
    for layer in [*layers[1:], None]:
        if layer is not None and layer == prev + 1:
            prev = layer
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if layer is not None:
            start = prev = layer
    return ", ".join(parts)


def _text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs nest it)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _window_layers(config: Any) -> list[int]:
    """Indices of the layers that slide, per the family's own rule."""
    layers = range(int(getattr(config, "num_hidden_layers", 0) or 0))
    if getattr(config, "model_type", None) in _EVERY_LAYER_TYPES:
        return list(layers)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [i for i in layers if i < len(layer_types) and layer_types[i] == "sliding_attention"]
    if getattr(config, "model_type", None) in _QWEN_TYPES:
        if not getattr(config, "use_sliding_window", False):
            return []
        return [i for i in layers if i >= getattr(config, "max_window_layers", 0)]
    return list(layers)


def attention_features(config: Any) -> AttentionFeatures:
    """The sliding windows, chunks, soft-cap and sinks a transformers config implies (empty: plain causal).

    Args:
        config: A ``PretrainedConfig`` (or anything with the same attributes).
    """
    config = _text_config(config)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", None) in _QWEN_TYPES and not getattr(config, "use_sliding_window", False):
        window = None  # Qwen configs keep a sliding_window value that their models ignore without this flag
    windows = {layer: int(window) for layer in _window_layers(config)} if window is not None else {}
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None) or []
    chunks = {i: int(chunk) for i, kind in enumerate(types) if kind == "chunked_attention"} if chunk else {}
    return AttentionFeatures(
        windows=windows,
        chunks=chunks,
        softcap=getattr(config, "attn_logit_softcapping", None),
        sinks=getattr(config, "model_type", None) in _SINK_TYPES,
    )


def check_attention_route(config: Any, route: str) -> None:
    """Refuse a ``model.attention`` route that cannot honour the attention features of ``config``.

    ``patch_sdpa`` routes ``F.scaled_dot_product_attention`` through block-diagonal CP,
    which sees no window, soft-cap or sinks (transformers expresses a window only in the
    mask CP ignores). ``hf_interface`` passes them on (``cp_blockdiag_attention``) and
    ``eager`` is the model's own attention; both are accepted.

    Raises:
        ValueError: naming every feature the route would drop.
    """
    features = attention_features(config).names()
    if route != "patch_sdpa" or not features:
        return
    model = (getattr(config, "architectures", None) or [getattr(config, "model_type", "the model")])[0]
    raise ValueError(
        f"model.attention=patch_sdpa cannot honour {', '.join(features)} of {model}: stock SDPA sees none of "
        "them under block-diagonal CP, so training would silently use plain causal attention; use "
        "model.attention=hf_interface (which passes them to the CP kernels)"
    )

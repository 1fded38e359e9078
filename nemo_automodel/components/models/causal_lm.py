"""Build the causal LM: a local HF checkpoint, or a seeded random Llama of the configured size."""

from __future__ import annotations

import functools
import logging

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

from nemo_automodel.components.config.schema import ModelConfig
from nemo_automodel.components.distributed.blockdiag_cp import CPOptions
from nemo_automodel.components.models.attention_features import check_attention_route
from nemo_automodel.components.models.cp_attention import (
    attention_scope,
    attn_implementation_for,
    prepare_attention,
)
from nemo_automodel.components.models.packing_guard import check_packable_config
from nemo_automodel.components.models.packing_probe import verify_packing_isolation

logger = logging.getLogger(__name__)


def llama_config(cfg: ModelConfig, vocab_size: int) -> LlamaConfig:
    """The ``LlamaConfig`` of a model built from ``cfg``'s size fields."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=False,
        use_cache=False,
    )


def model_shape(config: PretrainedConfig) -> dict[str, int | float]:
    """A loaded model's own values of :class:`ModelConfig`'s size fields (what ``resolved_config.yaml`` records).

    The size fields configure a model built from config; with ``pretrained_path`` the checkpoint's
    ``config.json`` decides the shape, so the record must show that shape, not the unused defaults. A field
    the model's config does not have (another family's naming) is left out.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or {}
    values = {
        "hidden_size": getattr(text, "hidden_size", None),
        "num_layers": getattr(text, "num_hidden_layers", None),
        "num_heads": getattr(text, "num_attention_heads", None),
        "num_kv_heads": getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None),
        "intermediate_size": getattr(text, "intermediate_size", None),
        "rope_theta": rope.get("rope_theta", getattr(text, "rope_theta", None)) if isinstance(rope, dict) else None,
        "max_position_embeddings": getattr(text, "max_position_embeddings", None),
    }
    return {k: v for k, v in values.items() if v is not None}


def pretrained_dtype(path: str) -> torch.dtype | None:
    """The dtype a local checkpoint was saved in (its ``config.json``), or ``None`` when it does not say.

    Training loads every model in float32; the export returns to this dtype (``trainer.export_dtype=auto``).
    """
    dtype = getattr(AutoConfig.from_pretrained(path, local_files_only=True), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def check_model_packable(config: PretrainedConfig, cfg: ModelConfig, seq_len: int | None) -> None:
    """Before loading: refuse a model packed training cannot compute exactly, unless ``model.verify_packing=false``.

    Raises:
        PackingUnsupportedError: naming the model class and every layer type / module found (a ``ValueError``).
    """
    if cfg.verify_packing:
        check_packable_config(config, cfg.attention, seq_len)
        return
    name = (getattr(config, "architectures", None) or [getattr(config, "model_type", "the model")])[0]
    logger.warning(
        "model.verify_packing=false: %s is NOT checked for token mixing outside attention and the packing-isolation "
        "probe does not run; if the model mixes packed documents, training is silently wrong",
        name,
    )


def probe_packing_at_start(
    model: PreTrainedModel, cfg: ModelConfig, cp_mesh: DeviceMesh, options: CPOptions, seq_len: int
) -> None:
    """Collective over ``cp_mesh``, before step 1: the packing-isolation probe, unless ``model.verify_packing=false``.

    ``model`` is on its training device and not yet sharded (identical on every rank).

    Raises:
        PackingLeakError: on every rank, when packed documents influence each other (a ``ValueError``).
    """
    if cfg.verify_packing:
        scope = functools.partial(attention_scope, cfg.attention)
        verify_packing_isolation(
            model, cp_mesh, options=options, attention_scope=scope, route=cfg.attention, seq_len=seq_len
        )


def build_causal_lm(
    cfg: ModelConfig, vocab_size: int, seed: int, activation_checkpointing: bool, seq_len: int | None = None
) -> PreTrainedModel:
    """The fp32 model in train mode, identical on every rank (same ``seed`` -> same weights).

    Args:
        cfg: Model section (``pretrained_path`` loads from disk, never the hub).
        vocab_size: Tokenizer vocabulary (the built model's embedding rows).
        seed: Seeds the random init of a built model.
        activation_checkpointing: Recompute decoder layers in backward (non-reentrant checkpoint).
        seq_len: The packed row length (``data.seq_len``): chunked attention is exact on rows no longer than a
            chunk (``None``: assume longer).

    Raises:
        PackingUnsupportedError: for a model packed training cannot compute exactly (:func:`check_model_packable`).
    """
    prepare_attention(cfg.attention)
    attn = attn_implementation_for(cfg.attention)
    if cfg.pretrained_path is not None:
        # before loading: transformers itself may refuse the route's implementation with a less useful message
        config = AutoConfig.from_pretrained(cfg.pretrained_path, local_files_only=True)
        check_attention_route(config, cfg.attention)
        # SSM / conv / recurrent mixers, ALiBi, interface bypass: by name, before transformers can crash on them
        check_model_packable(config, cfg, seq_len)
        model = AutoModelForCausalLM.from_pretrained(
            cfg.pretrained_path, local_files_only=True, dtype=torch.float32, attn_implementation=attn
        )
        model.config.use_cache = False
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            llama_config(cfg, vocab_size), dtype=torch.float32, attn_implementation=attn
        )
    if not model.config.architectures:  # as save_pretrained records it; CP attention errors name it
        model.config.architectures = [type(model).__name__]
    check_attention_route(model.config, cfg.attention)  # windows, soft-cap, sinks: refused by patch_sdpa
    if model.get_input_embeddings().num_embeddings < vocab_size:
        raise ValueError(
            f"model.pretrained_path={cfg.pretrained_path}: the model has {model.get_input_embeddings().num_embeddings} "
            f"embedding rows but the tokenizer has {vocab_size} tokens; use the model's own tokenizer "
            "(tokenizer.name_or_path=<model dir>)"
        )
    if activation_checkpointing:
        model.activation_checkpointing_enable()
    model.train()
    return model

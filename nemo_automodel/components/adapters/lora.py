"""LoRA adapters on a frozen base, built with Hugging Face ``peft`` (no LoRA layer is written here).

``peft.get_peft_model`` injects the adapters into the Hugging Face model in place and freezes everything
else; the recipe then trains that same module (``PeftModel.get_base_model()``), so FSDP2, block-diagonal CP,
activation checkpointing and validation see an ordinary causal LM whose only trainable parameters are the
adapters' ``lora_A`` / ``lora_B`` (and DoRA's magnitude vectors).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, load_peft_weights, set_peft_model_state_dict

from nemo_automodel.components.config.schema import PeftConfig

logger = logging.getLogger("nemo_automodel.finetune")

# MoE routing gates are linear layers that score experts rather than project activations: never a default target
# (naming one explicitly in peft.target_modules still adapts it).
_ROUTER_LEAVES = frozenset({"gate", "router", "shared_expert_gate"})
# AdamW keeps two moments (exp_avg, exp_avg_sq) per trained parameter, each in the parameter's dtype.
_ADAM_MOMENTS = 2


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder layers (``model.model.layers`` in every supported Hugging Face causal LM)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(
            f"peft=lora: {type(model).__name__} has no decoder layers at model.model.layers; "
            "only Hugging Face causal LMs with that layout are supported"
        )
    return layers


def linear_leaf_names(module: torch.nn.Module) -> list[str]:
    """Sorted leaf names of every ``nn.Linear`` under ``module`` (``q_proj``, ``down_proj``, ``lm_head``, ...)."""
    return sorted({name.rsplit(".", 1)[-1] for name, sub in module.named_modules() if isinstance(sub, torch.nn.Linear)})


def resolve_target_modules(model: torch.nn.Module, requested: list[str] | None) -> list[str]:
    """The linear layers to adapt, by leaf name.

    ``None`` resolves to every linear projection inside the decoder layers (attention and MLP, and MLA's
    low-rank projections; MoE routers excluded). Explicit names must each name a linear layer of the model.

    Raises:
        ValueError: a requested name is no linear layer of the model (the message lists the ones it has).
    """
    in_layers = linear_leaf_names(_decoder_layers(model))
    if requested is None:
        targets = [name for name in in_layers if name not in _ROUTER_LEAVES]
        if not targets:
            raise ValueError(f"peft=lora: {type(model).__name__}'s decoder layers have no linear layer to adapt")
        return targets
    available = linear_leaf_names(model)
    unknown = [name for name in requested if name not in available]
    if unknown:
        raise ValueError(
            f"peft.target_modules: {', '.join(unknown)} matches no linear layer of {type(model).__name__}; "
            f"its linear layers are {', '.join(available)} (e.g. peft.target_modules=[{','.join(in_layers[:2])}], "
            "or null for every attention and MLP projection)"
        )
    return list(dict.fromkeys(requested))


def lora_config(cfg: PeftConfig, targets: list[str], base_path: str) -> LoraConfig:
    """``peft``'s ``LoraConfig`` for ``cfg`` (``base_path`` is recorded as the adapter's base model)."""
    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        use_dora=cfg.use_dora,
        use_rslora=cfg.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_path,
    )


def attach_lora(model: torch.nn.Module, config: LoraConfig) -> PeftModel:
    """Inject the adapters into ``model`` in place (everything else frozen) and return the ``PeftModel``."""
    base_path = config.base_model_name_or_path
    peft_model = get_peft_model(model, config)
    # get_peft_model records the model's own name_or_path (empty for a model built from config): keep ours
    peft_model.peft_config["default"].base_model_name_or_path = base_path
    return peft_model


def _check_saved_adapter(path: str, config: LoraConfig) -> None:
    """Raise unless the adapter saved in ``path`` has this run's rank, scaling and targets."""
    saved = LoraConfig.from_pretrained(path)
    pairs = {
        "peft.r": (saved.r, config.r),
        "peft.alpha": (float(saved.lora_alpha), float(config.lora_alpha)),
        "peft.use_dora": (bool(saved.use_dora), bool(config.use_dora)),
        "peft.use_rslora": (bool(saved.use_rslora), bool(config.use_rslora)),
        "peft.target_modules": (sorted(saved.target_modules or []), sorted(config.target_modules or [])),
    }
    for key, (theirs, ours) in pairs.items():
        if theirs != ours:
            raise ValueError(
                f"peft.adapter_path={path}: the saved adapter has {key}={theirs} but this run asks for {ours}; "
                f"set {key}={theirs} to continue training it"
            )


def load_saved_adapter(peft_model: PeftModel, path: str) -> None:
    """Continue training the adapter saved in ``path`` (PEFT format): its weights replace the fresh init.

    Raises:
        ValueError: ``path`` holds no adapter, or one whose r/alpha/targets differ from this run's.
    """
    if not (Path(path) / "adapter_config.json").is_file():
        raise ValueError(
            f"peft.adapter_path={path} holds no adapter_config.json; point it at a PEFT adapter directory "
            "(e.g. <run_dir>/adapter)"
        )
    config = peft_model.peft_config["default"]
    _check_saved_adapter(path, config)
    result = set_peft_model_state_dict(peft_model, load_peft_weights(path, device="cpu"))
    missing = [key for key in result.missing_keys if ".lora_" in key]
    if missing:
        raise ValueError(f"peft.adapter_path={path} lacks adapter weights, e.g. {missing[0]}")


def parameter_summary(model: torch.nn.Module) -> str:
    """Trainable vs total parameters and the AdamW state bytes LoRA saves against full fine-tuning."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    state_full = sum(_ADAM_MOMENTS * p.numel() * p.element_size() for p in params)
    state_lora = sum(_ADAM_MOMENTS * p.numel() * p.element_size() for p in params if p.requires_grad)
    mib = 2**20
    return (
        f"trainable {trainable:,} of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%); "
        f"optimizer state {state_lora / mib:.2f} MiB instead of {state_full / mib:.2f} MiB for full fine-tuning "
        f"({(state_full - state_lora) / mib:.2f} MiB saved)"
    )


def setup_lora(model: torch.nn.Module, cfg: PeftConfig, base_path: str) -> PeftModel:
    """Resolve the targets, inject the adapters (loading ``cfg.adapter_path`` if set) and log what was done.

    Raises:
        ValueError: unknown targets, or a saved adapter that does not fit (see :func:`load_saved_adapter`).
    """
    targets = resolve_target_modules(model, cfg.target_modules)
    peft_model = attach_lora(model, lora_config(cfg, targets, base_path))
    if cfg.adapter_path is not None:
        load_saved_adapter(peft_model, cfg.adapter_path)
    logger.info(
        "LoRA (peft): r=%d alpha=%g dropout=%g%s%s on %s (%s); base %s%s",
        cfg.r,
        cfg.alpha,
        cfg.dropout,
        " DoRA" if cfg.use_dora else "",
        " rsLoRA" if cfg.use_rslora else "",
        ", ".join(targets),
        "default: every attention and MLP projection" if cfg.target_modules is None else "peft.target_modules",
        base_path,
        f"; adapter continued from {cfg.adapter_path}" if cfg.adapter_path else "",
    )
    logger.info("LoRA: %s", parameter_summary(model))
    return peft_model

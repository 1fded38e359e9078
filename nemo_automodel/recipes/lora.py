"""The fine-tuning recipe's LoRA glue: refuse what cannot run, pin the base, inject the adapters.

``recipes/finetune.py`` calls :func:`check_quantize` with the other start-up checks and
:func:`start_lora` right after building the model (before FSDP2 shards it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import PeftModel

from nemo_automodel.components.adapters.lora import setup_lora
from nemo_automodel.components.checkpoint.adapter import BaseModel, base_fingerprint
from nemo_automodel.components.checkpoint.hf_export import export_config, export_hf
from nemo_automodel.components.config.schema import FinetuneConfig, PeftConfig
from nemo_automodel.components.datasets.tokenizer import HFTokenizer

# Where a LoRA run on a model built from config (no model.pretrained_path) saves its base, for the adapter.
BASE_DIR = "base"


def check_quantize(cfg: PeftConfig, device: torch.device) -> None:
    """Refuse ``peft.quantize=4bit`` (QLoRA) before anything is loaded.

    4-bit base weights are bitsandbytes' CUDA kernels: on CPU, or without the library, the run cannot
    honour the setting. With both present the recipe still refuses it: sharding bitsandbytes' packed
    4-bit parameters with FSDP2 over ``dp x cp`` is untested here (docs/lora.md).

    Raises:
        ValueError: always, when ``peft.quantize`` is not ``none``, naming what is missing.
    """
    if cfg.quantize == "none":
        return
    if device.type != "cuda":
        raise ValueError(
            f"peft.quantize={cfg.quantize} (QLoRA) needs a CUDA GPU (bitsandbytes' 4-bit kernels) but this run is "
            f"on {device.type}; use peft.quantize=none (LoRA on the full-precision base)"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            f"peft.quantize={cfg.quantize} (QLoRA) needs the bitsandbytes library: pip install bitsandbytes, "
            "or use peft.quantize=none"
        )
    raise ValueError(
        f"peft.quantize={cfg.quantize}: FSDP2 sharding of bitsandbytes' 4-bit base weights is not supported by "
        "this recipe yet (docs/lora.md); use peft.quantize=none"
    )


@dataclass(frozen=True)
class LoraRun:
    """A LoRA run's adapters (``peft_model``; the recipe trains ``peft_model.get_base_model()``) and base."""

    peft_model: PeftModel
    base: BaseModel


def _save_built_base(model: torch.nn.Module, tokenizer: Any, out_dir: Path, rank: int) -> None:
    """Collective: rank 0 saves a base built from config (float32, HF format) for the adapter to point at."""
    config = export_config(model.config, torch.float32, tokenizer.eos_id, tokenizer.pad_id, built=True)
    export_hf(model, config, out_dir, rank, torch.float32, weights=model.state_dict() if rank == 0 else {})
    if rank == 0 and isinstance(tokenizer, HFTokenizer):
        tokenizer.save_pretrained(out_dir)


def start_lora(config: FinetuneConfig, model: torch.nn.Module, tokenizer: Any, run_dir: Path, rank: int) -> LoraRun:
    """Collective: fingerprint the (unsharded) base, save it when built from config, inject the adapters.

    Raises:
        ValueError: on every rank, for unknown target modules or a saved adapter that does not fit.
    """
    path = config.model.pretrained_path or str(run_dir / BASE_DIR)
    if config.model.pretrained_path is None:
        _save_built_base(model, tokenizer, Path(path), rank)
    fingerprint = [base_fingerprint(model.state_dict()) if rank == 0 else None]
    dist.broadcast_object_list(fingerprint, src=0)  # every rank built the same weights; one rank hashes them
    # peft draws lora_A's init from the global RNG, which rank 0 alone advanced above (the base export builds a
    # model): reseed so every rank draws the same adapters (FSDP2 keeps each rank's own shard of its init)
    torch.manual_seed(config.trainer.seed)
    peft_model = setup_lora(model, config.peft, path)
    return LoraRun(peft_model, BaseModel(path, fingerprint[0]))

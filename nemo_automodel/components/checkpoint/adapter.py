"""Checkpoints and outputs of a LoRA run: the adapter and its optimizer state, never the frozen base.

A LoRA checkpoint is an ordinary DCP checkpoint (``dcp.py``) saved with
``StateDictOptions(ignore_frozen_params=True)``, so only the adapters and their AdamW state are written,
plus ``base_model.json``: the base's path and a fingerprint of its weights (SHA-256 over every tensor's
name, dtype, shape and bytes). Resuming rebuilds the base, checks it has that fingerprint, then loads the
adapters. At the end rank 0 writes ``adapter/`` in PEFT format and, for the HF export, merges the adapters
into the base (``merge_and_unload``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, PretrainedConfig

from nemo_automodel.components.adapters.lora import attach_lora

logger = logging.getLogger("nemo_automodel.finetune")

BASE_MODEL_FILE = "base_model.json"
ADAPTER_DIR = "adapter"
# Only the trainable parameters (the adapters) and their optimizer state go into a LoRA checkpoint.
SAVE_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# strict=False: the frozen base is absent from the checkpoint by design; dcp.load still fails on a missing adapter.
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def base_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor of a base model's state dict, in name order (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def base_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's own state dict inside a LoRA model's (adapters dropped, ``base_layer`` unwrapped)."""
    return {key.replace(".base_layer.", "."): value for key, value in state.items() if ".lora_" not in key}


@dataclass(frozen=True)
class BaseModel:
    """The frozen base a LoRA run trains on: where it is and its fingerprint (:func:`base_fingerprint`)."""

    path: str
    fingerprint: str

    def record(self) -> dict[str, Any]:
        """The ``base_model.json`` written into every checkpoint."""
        return {"path": self.path, "fingerprint": self.fingerprint}


def check_resume(checkpoint: Path, base: BaseModel | None) -> None:
    """Raise unless ``checkpoint`` fits this run: a LoRA checkpoint for a LoRA run on the same base weights.

    Raises:
        ValueError: full fine-tuning vs LoRA mismatch, or a base whose weights differ from the checkpoint's.
    """
    record_file = checkpoint / BASE_MODEL_FILE
    if base is None:
        if record_file.is_file():
            raise ValueError(
                f"{checkpoint} holds LoRA adapters, not a full model: add peft=lora to continue it, "
                "or start a new run dir (trainer.resume=never)"
            )
        return
    if not record_file.is_file():
        raise ValueError(
            f"{checkpoint} holds a full fine-tuning checkpoint: peft=lora cannot continue it; drop peft=lora, "
            "or start a new run dir (trainer.resume=never)"
        )
    saved = json.loads(record_file.read_text())
    if saved["fingerprint"] != base.fingerprint:
        raise ValueError(
            f"{checkpoint} was trained on base model {saved['path']} (fingerprint {saved['fingerprint'][:16]}), "
            f"but this run's base {base.path} has different weights (fingerprint {base.fingerprint[:16]}): "
            "point model.pretrained_path at the checkpoint's base, or start a new run dir (trainer.resume=never)"
        )


def _fresh_peft_model(peft_model: PeftModel, hf_config: PretrainedConfig) -> PeftModel:
    """An unsharded CPU copy of the training model's architecture with the same adapters (weights random)."""
    base = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    return attach_lora(base, peft_model.peft_config["default"])


def save_outputs(
    model: torch.nn.Module,
    peft_model: PeftModel,
    hf_config: PretrainedConfig,
    base: BaseModel,
    out_dir: Path,
    rank: int,
    merge: bool,
) -> tuple[Path | None, dict[str, torch.Tensor] | None]:
    """Collective: write ``out_dir`` (PEFT format) on rank 0; return it and, with ``merge``, the merged weights.

    Rank 0 gathers the full trained model, checks that the base weights are bit-identical to the ones the run
    started from (their fingerprint), rebuilds the model unsharded on CPU, saves the adapter with
    ``PeftModel.save_pretrained`` and, with ``merge``, returns ``merge_and_unload()``'s state dict (what the HF
    export writes). Other ranks return ``(None, {})`` (``{}``: the export has nothing to gather on them).

    Raises:
        RuntimeError: on rank 0, when the base weights changed during training.
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None, {} if merge else None
    after = base_fingerprint(base_state(full))
    if after != base.fingerprint:
        raise RuntimeError(
            f"LoRA training changed the frozen base weights (fingerprint {base.fingerprint[:16]} -> {after[:16]})"
        )
    logger.info("LoRA: base weights bit-identical to the start (fingerprint %s)", after[:16])
    cpu_model = _fresh_peft_model(peft_model, hf_config)
    cpu_model.get_base_model().load_state_dict(full)
    cpu_model.save_pretrained(out_dir)
    logger.info("LoRA adapter (PEFT format, base %s): %s", base.path, out_dir)
    return out_dir, cpu_model.merge_and_unload().state_dict() if merge else None

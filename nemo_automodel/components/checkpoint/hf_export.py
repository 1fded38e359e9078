"""Export the trained weights as a HF ``save_pretrained`` directory (safetensors) on rank 0."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, PretrainedConfig


def export_hf(model: torch.nn.Module, config: PretrainedConfig, out_dir: Path, rank: int) -> Path | None:
    """Collective: gather full weights to rank 0's CPU; rank 0 writes ``out_dir`` and returns it.

    The export is a fresh model of ``config`` with stock ``sdpa`` attention, so it
    loads anywhere without this package.
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    export_config = config.__class__.from_dict(config.to_dict())
    export = AutoModelForCausalLM.from_config(export_config, attn_implementation="sdpa", dtype=torch.float32)
    export.load_state_dict(full)
    export.save_pretrained(out_dir)
    return out_dir

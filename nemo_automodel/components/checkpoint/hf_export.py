"""Export the trained weights as a HF ``save_pretrained`` directory (safetensors) on rank 0.

The export is what ``AutoModelForCausalLM.from_pretrained(dir)`` + ``generate`` need,
without this package: the model's own config (its attention settings, e.g.
``sliding_window`` and ``layer_types``, as the model was built), stock ``sdpa``
attention, ``use_cache: true`` (training turns the KV cache off; generation wants
it), the model's dtype (a bf16 checkpoint is exported as bf16 unless
``trainer.export_dtype`` says otherwise), EOS/padding ids that match the
tokenizer, and the tokenizer itself when it is a HF one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig

# In the run dir: the step the HF export holds, written after it is complete (a rerun of a complete run
# exports only when this does not name its step).
EXPORT_RECORD = "export.json"

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(setting: str, source: torch.dtype | None) -> torch.dtype:
    """``trainer.export_dtype``: ``auto`` keeps the model's source dtype (float32 when built from config)."""
    if setting == "auto":
        return source or torch.float32
    return EXPORT_DTYPES[setting]


def _eos_ids(configured: int | list[int] | None, eos_id: int | None) -> int | list[int] | None:
    """The model's EOS id(s) plus the tokenizer's, so generation stops where training taught it to."""
    ids = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    if eos_id is not None and eos_id not in ids:
        ids.append(eos_id)
    return None if not ids else ids[0] if len(ids) == 1 else ids


def export_config(
    config: PretrainedConfig, dtype: torch.dtype, eos_id: int | None, pad_id: int, built: bool
) -> PretrainedConfig:
    """A copy of the trained model's config for inference (module docstring).

    Args:
        config: The trained model's config.
        dtype: The export dtype.
        eos_id: The tokenizer's EOS id.
        pad_id: The tokenizer's padding id.
        built: The model was built from config (its default special-token ids mean nothing: the tokenizer's rule).
    """
    out = config.__class__.from_dict(config.to_dict())
    out.use_cache = True
    out.dtype = dtype
    if built:
        out.bos_token_id = None
        out.eos_token_id = eos_id
    else:
        out.eos_token_id = _eos_ids(out.eos_token_id, eos_id)
    if out.pad_token_id is None:
        out.pad_token_id = pad_id
    return out


def export_hf(
    model: torch.nn.Module,
    config: PretrainedConfig,
    out_dir: Path,
    rank: int,
    dtype: torch.dtype = torch.float32,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path | None:
    """Collective: gather full weights to rank 0's CPU; rank 0 writes ``out_dir`` (``dtype``) and returns it.

    Args:
        config: The export config (:func:`export_config`).
        weights: The full weights to write instead of gathering ``model``'s (LoRA: the merged model on
            rank 0, ``{}`` elsewhere); given on every rank or on none.
    """
    full = weights
    if full is None:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    try:
        export = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    except ValueError:  # a family without an SDPA path (Gemma 2): eager, which every family has
        export = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    export.load_state_dict(full)
    export.generation_config = GenerationConfig.from_model_config(config)
    export.generation_config.use_cache = True
    export.save_pretrained(out_dir)
    return out_dir


def record_export(run_dir: Path, step: int, path: Path) -> None:
    """Rank 0, after the export is written: ``run_dir/export.json`` names its step and directory."""
    (run_dir / EXPORT_RECORD).write_text(json.dumps({"step": step, "path": str(path)}) + "\n")


def exported_at(run_dir: Path, step: int) -> bool:
    """Whether a complete export of ``step`` exists (``export.json`` names it and its directory is there)."""
    record = run_dir / EXPORT_RECORD
    if not record.is_file():
        return False
    done = json.loads(record.read_text())
    return done["step"] == step and Path(done["path"]).is_dir()

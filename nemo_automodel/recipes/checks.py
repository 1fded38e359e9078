"""Checks that need the file system or the device; run before training, so a bad input never hangs a peer."""

from __future__ import annotations

from pathlib import Path

import torch

from nemo_automodel.components.config.schema import FinetuneConfig, bf16_autocast
from nemo_automodel.components.datasets.sources import resolve_files
from nemo_automodel.components.distributed.blockdiag_cp.kernels import kernel_unavailable_reason


def check_paths(cfg: FinetuneConfig) -> None:
    """Raise a ``ValueError`` naming the field when a configured input does not exist.

    The hub is never contacted: model and tokenizer paths must be local directories.
    """
    if cfg.data.source != "synthetic":
        if cfg.data.path is None:
            raise ValueError(
                f"data.path is required with data={cfg.data.source}: pass data.path=/path/to/train.jsonl "
                "(a json/jsonl/parquet/arrow file, a directory of them or a glob)"
            )
        resolve_files(cfg.data.path, cfg.data.split)
        if cfg.data.validation is not None and cfg.data.validation_fraction is None:
            resolve_files(cfg.data.validation, None, "data.validation")
    for field, path in (
        ("model.pretrained_path", cfg.model.pretrained_path),
        ("tokenizer.name_or_path", cfg.tokenizer.name_or_path),
    ):
        if path is not None and not Path(path).is_dir():
            raise ValueError(
                f"{field}={path}: no such directory; pass a local HF directory (save_pretrained output) - "
                "models are never downloaded"
            )
    if cfg.model.pretrained_path is not None:
        check_positions(cfg.model.pretrained_path, cfg.data.seq_len)


def check_positions(pretrained_path: str, seq_len: int) -> None:
    """``data.seq_len`` must fit the pretrained model's position table (a document may fill a whole row).

    Raises:
        ValueError: naming both values and the fix.
    """
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(pretrained_path, local_files_only=True), "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"data.seq_len={seq_len} exceeds the max_position_embeddings={limit} of model.pretrained_path="
            f"{pretrained_path}: a document filling a row would use positions the model never learned; lower "
            f"data.seq_len to {limit} or less"
        )


def used_run_dir(run_dir: Path) -> bool:
    """Whether an earlier run trained in ``run_dir`` (it has metrics or checkpoints)."""
    checkpoints = run_dir / "checkpoints"
    return (run_dir / "metrics.jsonl").exists() or (checkpoints.is_dir() and any(checkpoints.iterdir()))


def check_run_dir(cfg: FinetuneConfig, run_dir: Path) -> None:
    """``trainer.resume=never`` refuses a run dir an earlier run used, instead of mixing or overwriting its outputs."""
    if cfg.trainer.resume == "never" and used_run_dir(run_dir):
        raise ValueError(
            f"trainer.resume=never but the run dir {run_dir} holds an earlier run (metrics.jsonl / checkpoints/); "
            "pass a new hydra.run.dir, or trainer.resume=auto to continue that run"
        )


def check_attn_backend(cfg: FinetuneConfig, device: torch.device) -> None:
    """An explicit ``cp.attn_backend`` must run on ``device`` in the training dtype; only ``auto`` picks one.

    Raises:
        ValueError: naming the kernel, why it cannot run, and the fix.
    """
    backend = cfg.cp.attn_backend
    if backend == "auto":
        return
    dtype = torch.bfloat16 if bf16_autocast(cfg.trainer.bf16, device) else torch.float32
    reason = kernel_unavailable_reason(backend, dtype, device)
    if reason is not None:
        raise ValueError(
            f"cp.attn_backend={backend} cannot run here ({reason}); use cp.attn_backend=auto to pick the fastest "
            "kernel that runs, or name one that does (sdpa_varlen runs everywhere)"
        )

"""Checks that need the file system; run before any process group exists, so a bad path never hangs a peer."""

from __future__ import annotations

from pathlib import Path

from nemo_automodel.components.config.schema import FinetuneConfig


def check_paths(cfg: FinetuneConfig) -> None:
    """Raise a ``ValueError`` naming the field when a configured input does not exist.

    The hub is never contacted: model and tokenizer paths must be local directories.
    """
    if cfg.data.source == "jsonl":
        if cfg.data.path is None:
            raise ValueError("data.path is required with data=jsonl: pass data.path=/path/to/file.jsonl")
        if not Path(cfg.data.path).is_file():
            raise ValueError(
                f"data.path={cfg.data.path}: no such file (expected JSONL with one {{'text': ...}} a line)"
            )
    for field, path in (
        ("model.pretrained_path", cfg.model.pretrained_path),
        ("tokenizer.name_or_path", cfg.tokenizer.name_or_path),
    ):
        if path is not None and not Path(path).is_dir():
            raise ValueError(
                f"{field}={path}: no such directory; pass a local HF directory (save_pretrained output) - "
                "models are never downloaded"
            )

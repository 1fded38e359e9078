"""What a resumed run may differ in from its checkpoint, and the refusals that name the way out."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from nemo_automodel.components.config.errors import InputError
from nemo_automodel.components.config.schema import FinetuneConfig, OptimConfig, to_plain_dict
from nemo_automodel.components.datasets.packing import PackedRows


def check_resume_step(max_steps: int, checkpoint: Path, step: int) -> None:
    """Refuse ``trainer.max_steps`` below the checkpoint's step: nothing to train, and not the model asked for.

    Raises:
        InputError: naming both steps and the two ways out.
    """
    if step > max_steps:
        raise InputError(
            f"trainer.max_steps={max_steps} but {checkpoint} is already complete at step {step}; raise "
            f"trainer.max_steps above {step} to continue, or pass a new hydra.run.dir to train {max_steps} steps "
            "from scratch"
        )


# Recorded but never refused: the optimizer's settings are applied from the resumed step on; a new
# dp/cp layout reshards the checkpoint (DCP). Everything else recorded is refused when it changed.
_APPLIED_PREFIX = "optim."
_RESHARDED = ("cp.size", "dist.dp")
# The model's attention route does not change its weights; the cache dir does not change the data.
_NOT_RECORDED = {"model.attention", "data.cache_dir"}
_HASH_ROWS = 1024


def rows_sha256(rows: PackedRows) -> str:
    """SHA-256 of the packed training rows (tokens and document ids): what the row schedule indexes into."""
    digest = hashlib.sha256()
    for tensor in (rows.input_ids, rows.seq_ids):
        # hashed as int64 (the dtype rows were stored in before int32 storage, so older checkpoints still match),
        # in blocks of rows: no int64 copy of the whole dataset
        for block in tensor.split(_HASH_ROWS):
            digest.update(block.long().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_fingerprint(config: FinetuneConfig, rows: PackedRows, dp: int) -> dict[str, Any]:
    """What a resumed run must match (model, tokenizer, data and peft settings, rows) or may change (optimizer, dp/cp).

    A flat ``{"section.key": value}`` dict, stored in each checkpoint's trainer state.
    """
    plain = to_plain_dict(config)
    flat = {
        f"{section}.{key}": value
        for section in ("model", "tokenizer", "data", "optim", "peft")
        for key, value in plain[section].items()
        if f"{section}.{key}" not in _NOT_RECORDED
    }
    return {**flat, "data.rows_sha256": rows_sha256(rows), "cp.size": config.cp.size, "dist.dp": dp}


def compare_fingerprints(old: dict[str, Any], new: dict[str, Any], checkpoint: Path, step: int) -> list[str]:
    """The settings the resumed run applies (``optim.*``) or reshards (dp/cp), as log lines; refuse the rest.

    Raises:
        InputError: listing every refused key with its checkpoint and current values, and the way out.
    """
    changed = {k: (old[k], new.get(k)) for k in old if json.dumps(old[k]) != json.dumps(new.get(k))}
    refused = {k: v for k, v in changed.items() if not k.startswith(_APPLIED_PREFIX) and k not in _RESHARDED}
    if refused:
        lines = "; ".join(f"{k}: {_show(a)} in the checkpoint, {_show(b)} now" for k, (a, b) in sorted(refused.items()))
        hint = " (the data files' contents changed)" if set(refused) == {"data.rows_sha256"} else ""
        raise InputError(
            f"resuming {checkpoint} (step {step}) with settings that change what the run trains on{hint}: {lines}. "
            "Set them back to the checkpoint's values to continue this run, or pass a new hydra.run.dir to start "
            "a new one with them"
        )
    return [
        f"{k}: {_show(a)} in the checkpoint, {_show(b)} now: "
        + ("resharded" if k in _RESHARDED else f"the new value applies from step {step + 1} on")
        for k, (a, b) in sorted(changed.items())
    ]


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def apply_optim_settings(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: OptimConfig
) -> None:
    """After loading a checkpoint: the configured lr / betas / eps / weight decay win over the loaded ones.

    The checkpoint's optimizer and scheduler states carry the old values (``base_lrs``, each param
    group's ``lr`` and hyper-parameters); the schedule's shape comes from the current config already.
    """
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, schedule in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(
            initial_lr=cfg.lr,
            lr=cfg.lr * schedule(scheduler.last_epoch),
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
    # get_last_lr() reads this cache, which the loaded state filled with the old values
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]

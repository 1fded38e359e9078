"""Atomic ``torch.distributed.checkpoint`` saves and resume.

Layout under ``<run_dir>/checkpoints``::

    step_00000100/            a complete checkpoint (only ever created by a rename)
        .metadata, *.distcp   model + optimizer (DCP, sharded: any world size can load the tensors)
        trainer_state.json    step, rows consumed, scheduler, topology
        rng_rank<r>.pt        python/numpy/torch RNG of rank r
        manifest.json         size and SHA-256 of every other file (written last; ``manifest.py``)
    .tmp-step_00000200/       a save in progress (ignored, removed by the next save or resume)
    .tmp-deleting-step_.../   an old checkpoint being deleted (ignored, removed by the next save or resume)
    damaged-step_00000300/    a checkpoint that failed verification on resume (kept to inspect)

A save writes everything into the temp dir, waits for every rank, and rank 0
renames it to ``step_<N>``; only then are checkpoints beyond ``keep`` deleted,
each renamed aside before its files go. A crash mid-save therefore leaves the
previous checkpoints untouched, every ``step_*`` directory is complete, and the
latest complete checkpoint is simply the highest ``step_*`` directory. A resume loads
the newest one that passes verification (:func:`newest_intact`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from nemo_automodel.components.checkpoint.manifest import MANIFEST, damage, set_aside, write_manifest
from nemo_automodel.components.training.rng import rng_state, set_rng_state

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class TrainerState:
    """The non-tensor state of a checkpoint (``trainer_state.json``).

    ``fingerprint``: the run's settings a resume compares (``resume.run_fingerprint``; empty in older checkpoints).
    """

    step: int
    rows_consumed: int
    scheduler: dict[str, Any]
    world: int
    dp: int
    cp: int
    fingerprint: dict[str, Any] = field(default_factory=dict)


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step:08d}"


def _checkpoints(root: Path) -> list[Path]:
    """Every ``step_*`` directory under ``root`` that is a checkpoint (trainer state or manifest), oldest first."""
    if not root.is_dir():
        return []
    done = [
        p
        for p in root.iterdir()
        if p.name.startswith(_PREFIX) and ((p / TRAINER_STATE).is_file() or (p / MANIFEST).is_file())
    ]
    return sorted(done, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint with the highest step under ``root`` (temp dirs never count; not verified)."""
    found = _checkpoints(root)
    return found[-1] if found else None


def newest_intact(root: Path, rank: int) -> Path | None:
    """Collective: the newest checkpoint under ``root`` that passes verification (``manifest.py``).

    A damaged newer one is named with the failed check, moved aside by rank 0 and skipped with a warning.
    Rank 0 also removes leftover temp dirs (the run-dir lock guarantees no live run owns them).
    """
    if rank == 0:
        for stale in root.glob(f"{_TMP_PREFIX}*") if root.is_dir() else ():
            shutil.rmtree(stale)
    for path in reversed(_checkpoints(root)):
        problem = damage(path)
        if problem is None:
            return path
        if rank == 0:
            aside = set_aside(path)
            logger.warning(
                "checkpoint %s is damaged: %s; moved aside to %s, trying the previous one", path, problem, aside
            )
        dist.barrier()  # every rank sees it moved before listing again
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: Path,
    state: TrainerState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    keep: int,
    rank: int,
    options: StateDictOptions | None = None,
    records: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Collective: save atomically (module docstring); return the final directory.

    Args:
        options: What ``get_state_dict`` saves (LoRA: only the trainable adapters, ``checkpoint/adapter.py``).
        records: Extra JSON files (name -> content) rank 0 writes into the checkpoint (LoRA: the base model).
    """
    final = checkpoint_dir(root, state.step)
    tmp = root / f"{_TMP_PREFIX}{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_TMP_PREFIX}*"):  # left by a crash mid-save
            shutil.rmtree(stale)
        tmp.mkdir()
    dist.barrier()
    with _disk_full_named(root):
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        if rank == 0:
            (tmp / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=1))
            for name, record in (records or {}).items():
                (tmp / name).write_text(json.dumps(record, indent=1))
    dist.barrier()  # every rank's files are in tmp
    write_manifest(tmp, rank)  # the last file: the rename below publishes the checkpoint with it
    if rank == 0:
        if final.exists():  # the same step saved again (e.g. preempted right after a periodic save)
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _prune(root, keep)
    dist.barrier()
    return final


# Below this many free bytes after a failed write, the failure is taken to be a full disk: torch's zip
# writer reports ENOSPC as "unexpected pos ..." without the errno.
_NEARLY_FULL_BYTES = 1 << 20


def _is_disk_full(exc: BaseException, root: Path) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(root).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


@contextlib.contextmanager
def _disk_full_named(root: Path) -> Iterator[None]:
    """Re-raise a write that failed on a full disk as ``OSError(ENOSPC, "no space left on <root>" ...)``."""
    try:
        yield
    except Exception as exc:
        if not _is_disk_full(exc, root):
            raise
        raise OSError(
            errno.ENOSPC,
            f"no space left on {root} while writing a checkpoint (the previous checkpoint is intact): free space "
            "there, lower trainer.keep_checkpoints, or point hydra.run.dir at a larger file system",
        ) from exc


def _remove(path: Path) -> None:
    """Delete a checkpoint directory; a crash midway never leaves it half deleted under a ``step_*`` name.

    ``rmtree`` removes files one by one, so a process killed during it would leave
    a ``step_*`` directory that still has its trainer state but lacks tensors: it
    would look complete. Renaming it to a temp name first (atomic) makes it stop
    being a checkpoint before anything is deleted; the next save removes leftovers.
    """
    doomed = path.with_name(f"{_TMP_PREFIX}deleting-{path.name}")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def _prune(root: Path, keep: int) -> None:
    for old in _checkpoints(root)[:-keep]:
        _remove(old)


def read_trainer_state(path: Path) -> TrainerState:
    """The checkpoint's ``trainer_state.json`` (step, rows consumed, scheduler, topology)."""
    return TrainerState(**json.loads((path / TRAINER_STATE).read_text()))


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    options: StateDictOptions | None = None,
) -> TrainerState:
    """Collective: load model, optimizer and this rank's RNG from ``path``; return the trainer state.

    The scheduler state is in the returned state (the caller owns the scheduler). ``options``: as saved
    (LoRA: ``checkpoint/adapter.py``).
    """
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state_dict = {"model": model_sd, "optim": optim_sd}
    dcp.load(state_dict, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"], options=options
    )
    trainer_state = read_trainer_state(path)
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        logger.warning("%s has no RNG state for rank %d (world size changed?): keeping the fresh seed", path, rank)
    return trainer_state

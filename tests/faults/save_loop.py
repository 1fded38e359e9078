"""Checkpoint forever with the recipe's ``save_checkpoint``, resuming like ``trainer.resume=auto``; killed by the test.

    python -m tests.faults.save_loop ROOT          # verify every complete checkpoint, resume from the latest, save on
    python -m tests.faults.save_loop ROOT --check  # verify only

Step ``n``'s model and optimizer state are a pure function of ``n``, so a
checkpoint can be checked exactly. Prints ``checked <steps>``, then
``resumed <n>`` (or ``fresh``) and ``saved <n>`` after each save returned;
exits 3 if any complete-looking checkpoint is wrong or unloadable.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_automodel.components.checkpoint.dcp import (
    TRAINER_STATE,
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

KEEP = 2


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Three linear layers (~1.5 MB with AdamW state): large enough that a save takes a while."""
    model = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(3)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 128)).sum().backward()
    optimizer.step()  # creates the optimizer state a checkpoint carries
    return model, optimizer


def _set_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Parameters and Adam moments that encode ``step``."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(step + i / 10)
            optimizer.state[p]["exp_avg"].fill_(-step)


def _encodes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
    return all(
        bool((p == step + i / 10).all()) and bool((optimizer.state[p]["exp_avg"] == -step).all())
        for i, p in enumerate(model.parameters())
    )


def check_all(root: Path) -> list[int]:
    """Load every complete-looking checkpoint (``step_*`` with a trainer state); the steps that load correctly.

    Raises:
        SystemExit(3): a complete-looking checkpoint does not load, or holds another step's state.
    """
    good = []
    for path in sorted(root.glob("step_*")) if root.is_dir() else []:
        if not (path / TRAINER_STATE).is_file():
            continue
        model, optimizer = _model()
        try:
            state = load_checkpoint(path, model, optimizer, rank=0)
        except Exception as exc:
            sys.exit(f"checkpoint {path.name} looks complete but does not load: {type(exc).__name__}: {exc}")
        if not _encodes(model, optimizer, state.step) or path.name != f"step_{state.step:08d}":
            sys.exit(f"checkpoint {path.name} holds the wrong state (trainer state step {state.step})")
        good.append(state.step)
    return good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    print(f"checked {check_all(args.root)}", flush=True)
    if args.check:
        return
    model, optimizer = _model()
    latest = latest_checkpoint(args.root)
    start = load_checkpoint(latest, model, optimizer, rank=0).step if latest else 0
    print(f"resumed {start}" if latest else "fresh", flush=True)
    for step in itertools.count(start + 1):
        _set_step(model, optimizer, step)
        save_checkpoint(args.root, TrainerState(step, step, {}, 1, 1, 1), model, optimizer, KEEP, rank=0)
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()

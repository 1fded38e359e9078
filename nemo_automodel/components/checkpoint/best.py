"""``trainer.keep_best``: the checkpoint with the lowest validation loss, kept apart from the rotation.

Layout under the run dir::

    best/step_<N>/     a complete checkpoint (the same atomic save as checkpoints/, keeping one)
    best/best.json     {"step", "val_loss", "checkpoint"} of it

``best/`` is outside ``checkpoints/``, so ``trainer.keep_checkpoints`` never deletes it and
``trainer.resume=auto`` never resumes from it; a resumed run reads ``best.json`` and keeps
replacing the best only with a lower validation loss.
"""

from __future__ import annotations

import json
from pathlib import Path

BEST_DIR = "best"
BEST_FILE = "best.json"


def read_best(run_dir: Path) -> tuple[int, float] | None:
    """``(step, validation loss)`` of the kept best checkpoint, or ``None``."""
    path = run_dir / BEST_DIR / BEST_FILE
    if not path.is_file():
        return None
    best = json.loads(path.read_text())
    return int(best["step"]), float(best["val_loss"])


def write_best(run_dir: Path, step: int, val_loss: float, checkpoint: Path) -> None:
    """Record the best checkpoint (rank 0, after its save completed)."""
    record = {"step": step, "val_loss": val_loss, "checkpoint": str(checkpoint)}
    (run_dir / BEST_DIR / BEST_FILE).write_text(json.dumps(record) + "\n")

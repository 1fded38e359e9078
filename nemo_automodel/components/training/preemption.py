"""Graceful stop on SIGTERM / SIGUSR1: finish the step, checkpoint, exit with :data:`EXIT_PREEMPTED`.

The contract (also in the README):

- exit 0: training reached ``trainer.max_steps`` (checkpoint and HF export written);
- exit :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``): a signal arrived, the current step
  finished, a complete checkpoint was saved and ``preempted.json`` names it; requeue the
  same command (with the same ``hydra.run.dir``) and ``trainer.resume=auto`` continues;
- anything else: a failure.

Signals may reach ranks at different times (or only some ranks), so every step all
ranks agree on "stop now" (a flag in the step's one all-reduce) and stop after the same step.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from types import FrameType

EXIT_PREEMPTED = 75
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_MARKER = "preempted.json"


class PreemptionFlag:
    """Records SIGTERM/SIGUSR1 while installed; the previous handlers are restored on :meth:`uninstall`."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.signal_name = signal.Signals(signum).name

    def install(self) -> PreemptionFlag:
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            for sig in PREEMPT_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def write_preempted_marker(run_dir: Path, step: int, checkpoint: Path, signal_name: str | None) -> None:
    """``run_dir/preempted.json``: which signal stopped the run and where its checkpoint is."""
    marker = {"step": step, "checkpoint": str(checkpoint), "signal": signal_name or "peer rank"}
    (run_dir / PREEMPTED_MARKER).write_text(json.dumps(marker) + "\n")


def clear_preempted_marker(run_dir: Path) -> None:
    (run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)


def preempted_marker_step(run_dir: Path) -> int | None:
    """The step named by ``preempted.json``, or ``None`` when the run was not preempted."""
    path = run_dir / PREEMPTED_MARKER
    return json.loads(path.read_text())["step"] if path.exists() else None


def combined_exit_code(codes: list[int]) -> int:
    """One exit code for several jobs (a ``-m`` sweep): a failure wins over a preemption, which wins over 0."""
    failures = [c for c in codes if c not in (0, EXIT_PREEMPTED)]
    if failures:
        return failures[0]
    return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0

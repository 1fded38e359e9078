"""Graceful stop on SIGTERM / SIGUSR1 / the first Ctrl-C: finish the step, checkpoint, exit :data:`EXIT_PREEMPTED`.

The contract (also in docs/recipe.md):

- exit 0: training reached ``trainer.max_steps`` (checkpoint and HF export written);
- exit :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``): a signal arrived, the current step
  finished, a complete checkpoint was saved and ``preempted.json`` names it; requeue the
  same command (with the same ``hydra.run.dir``) and ``trainer.resume=auto`` continues;
- anything else: a failure.

Signals may reach ranks at different times (or only some ranks), so every step all
ranks agree on "stop now" (a flag in the step's one all-reduce) and stop after the same step.

Ctrl-C (SIGINT) stops the same way the first time; a second one aborts at once
(``KeyboardInterrupt``). A terminal's Ctrl-C reaches the launcher and its workers
together, and the launcher forwards its copy to the workers too: a SIGINT within
:data:`SIGINT_REPEAT_S` of the first is that same key press, not a second one.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

EXIT_PREEMPTED = 75
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PREEMPTED_MARKER = "preempted.json"
# A second SIGINT sooner than this after the first is the launcher's forwarded copy of the same Ctrl-C.
SIGINT_REPEAT_S = 1.0


class PreemptionFlag:
    """Records SIGTERM/SIGUSR1/SIGINT while installed; the previous handlers are restored on :meth:`uninstall`.

    Args:
        clock: Seconds, monotonic (a seam for tests of the Ctrl-C rules).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._clock = clock
        self._first_interrupt: float | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if signum == signal.SIGINT:
            now = self._clock()
            if self._first_interrupt is not None and now - self._first_interrupt >= SIGINT_REPEAT_S:
                raise KeyboardInterrupt("second Ctrl-C: aborting without a checkpoint")
            if self._first_interrupt is None:
                self._first_interrupt = now
        self.signal_name = self.signal_name or signal.Signals(signum).name

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

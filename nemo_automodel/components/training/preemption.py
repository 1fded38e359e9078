"""Graceful stop on SIGTERM / SIGUSR1 / the first Ctrl-C: finish the step, checkpoint, exit :data:`EXIT_PREEMPTED`.

The contract (also in docs/recipe.md):

- exit 0: training reached ``trainer.max_steps`` (checkpoint and HF export written);
- exit :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``): a signal arrived, the current step
  finished, a complete checkpoint was saved and ``preempted.json`` names it; requeue the
  same command (with the same ``hydra.run.dir``) and ``trainer.resume=auto`` continues;
- anything else: a failure.

Signals may reach ranks at different times (or only some ranks), so all ranks agree on
"stop now" (a flag in the step's one all-reduce, read when that all-reduce starts) and
stop after the same step: the step in flight when the signal arrived. Outside a step the
flag is agreed where the recipe can act on it: before each validation batch (the pass is
cut short), after a periodic or best save, and after the final save (the HF export is
left to the requeued run, which finds the run complete and exports). The handler stays
installed until the export is written, so a signal never kills a save half way.

The first signal is acknowledged at once on the rank that received it (a log line naming
the signal). A second signal aborts at once (``KeyboardInterrupt``): a save in progress is
abandoned in its temp dir and the previous checkpoint stays intact. A terminal's Ctrl-C
reaches the launcher and its workers together, and the launcher forwards its copy to the
workers too: a signal within :data:`SIGINT_REPEAT_S` of the first is that same one, not a
second one.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

logger = logging.getLogger("nemo_automodel.finetune")

EXIT_PREEMPTED = 75
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PREEMPTED_MARKER = "preempted.json"
# A second signal sooner than this after the first is the launcher's forwarded copy of the same one.
SIGINT_REPEAT_S = 1.0


class PreemptionFlag:
    """Records SIGTERM/SIGUSR1/SIGINT while installed; the previous handlers are restored on :meth:`uninstall`.

    Args:
        clock: Seconds, monotonic (a seam for tests of the repeat rules).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._clock = clock
        self._first_at: float | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        now, name = self._clock(), signal.Signals(signum).name
        if self._first_at is not None:
            if now - self._first_at >= SIGINT_REPEAT_S:
                second = "second Ctrl-C" if signum == signal.SIGINT else f"second signal ({name})"
                message = f"{second}: aborting; the previous complete checkpoint is kept"
                logger.error("%s", message)  # said here: peers fail on the broken collective, naming no cause
                raise KeyboardInterrupt(message)
            return  # the launcher's forwarded copy of the first signal
        self._first_at, self.signal_name = now, name
        logger.warning(
            "%s received: finishing the step or save in flight, then checkpoint and exit %d (a second signal "
            "aborts, keeping the previous checkpoint)",
            name,
            EXIT_PREEMPTED,
        )

    def is_set(self) -> bool:
        """Whether this rank received a signal (read at the moment a step's all-reduce starts)."""
        return self.signal_name is not None

    def agreed(self, group: dist.ProcessGroup, device: torch.device) -> bool:
        """Collective over ``group``: whether any rank received a signal (one all-reduce of one flag)."""
        return any_rank(self.is_set(), group, device)

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


def report_preempted(run_dir: Path, step: int, checkpoint: Path, signal_name: str | None, pending: str) -> None:
    """Rank 0, stopping on a signal: write ``preempted.json`` and say what the requeued run will do.

    Args:
        pending: What is left for the requeued run, e.g. ``"steps 8-20"`` or ``"the HF export"``.
    """
    write_preempted_marker(run_dir, step, checkpoint, signal_name)
    logger.warning(
        "preempted (%s) after step %d: checkpoint %s saved; exit %d = requeue me (%s left)",
        signal_name or "signal on a peer rank",
        step,
        checkpoint,
        EXIT_PREEMPTED,
        pending,
    )


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


def any_rank(flag: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Collective over ``group``: whether ``flag`` is set on any rank (one one-element all-reduce, one host sync)."""
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())

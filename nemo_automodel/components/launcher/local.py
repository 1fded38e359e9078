"""Start ``world`` local workers with ``torch.distributed.launcher.api.elastic_launch`` (torchrun's machinery).

The parent resolved the config once; each worker receives it as a plain dict plus
the one run dir, so no worker composes Hydra or makes its own output directory.
SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1 to the parent are forwarded to the workers
by the elastic agent, which then waits ``dist.shutdown_timeout_s`` for them to
checkpoint before killing them. A worker that stops for any reason other than
success must *exit* with its code rather than return it: the agent only collects
return values on success, and a returned value would leave the worker waiting
for the agent to read it. The parent's exit code is 0 when every worker
finished, :data:`EXIT_PREEMPTED` when rank 0 recorded a complete preemption
checkpoint (``preempted.json``), :data:`EXIT_INPUT_ERROR` when a worker stopped on
a config or data error (its message is already on the console; the tracebacks go
to the log files only), and 1 (or ``128 + signal``) otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nemo_automodel.components.config.errors import EXIT_INPUT_ERROR, log_to_files_only
from nemo_automodel.components.config.schema import DistConfig
from nemo_automodel.components.training.metrics import LOG_FILE
from nemo_automodel.components.training.preemption import EXIT_PREEMPTED, preempted_marker_step

logger = logging.getLogger(__name__)

# The elastic agent's default set plus SIGUSR1 (Slurm's usual pre-timeout signal).
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local_workers(
    nproc: int, entrypoint: Callable[..., int], args: tuple[Any, ...], dist_cfg: DistConfig, run_dir: Path
) -> int:
    """Run ``entrypoint(*args)`` on ``nproc`` local processes; return the job's exit code (module docstring)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    port = dist_cfg.master_port or free_port()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"finetune-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
        shutdown_timeout=dist_cfg.shutdown_timeout_s,
        signals_to_handle=FORWARDED_SIGNALS,
    )
    logger.info("starting %d local workers (elastic_launch, rendezvous 127.0.0.1:%d)", nproc, port)
    try:
        with _input_error_exits_to_files():
            results = elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as exc:
        if _preempted(run_dir, "a signal to the workers"):
            return EXIT_PREEMPTED
        if exc.get_first_failure()[1].exitcode == EXIT_INPUT_ERROR:
            logger.error("stopped by the config or data error above (tracebacks: finetune.log in %s)", run_dir)
            log_to_files_only(logger.makeRecord(logger.name, logging.ERROR, __file__, 0, exc.format_msg(), (), None))
            return EXIT_INPUT_ERROR
        log_to_files_only(logger.makeRecord(logger.name, logging.ERROR, __file__, 0, exc.format_msg(), (), None))
        logger.error("%s", worker_failure_line(exc, run_dir))
        return 1
    except SignalException as exc:
        if _preempted(run_dir, exc.sigval.name):
            return EXIT_PREEMPTED
        logger.error("stopped by %s before the workers could checkpoint", exc.sigval.name)
        return 128 + int(exc.sigval)
    return max(results.values())


def worker_failure_line(exc: Any, run_dir: Path) -> str:
    """One line naming the first failed worker and how it ended (the elastic agent's report goes to the log file).

    The workers' own errors are already on the console above it; torch's ``ChildFailedError`` report
    repeats them as a long traceback table, which buried the line that mattered.
    """
    rank, failure = exc.get_first_failure()
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
    others = len(exc.failures) - 1
    also = f" ({others} more worker(s) failed after it)" if others else ""
    return (
        f"error: worker rank {rank} {how}{also}; the workers' own messages are above, the launcher's full report "
        f"is in {run_dir / LOG_FILE}"
    )


class _InputErrorExitToFiles(logging.Filter):
    """Sends the elastic agent's report of a worker that exited :data:`EXIT_INPUT_ERROR` to the log files only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "failed (exitcode" in str(record.msg) and record.args and record.args[0] == EXIT_INPUT_ERROR:
            log_to_files_only(record)
            return False
        return True


@contextlib.contextmanager
def _input_error_exits_to_files() -> Iterator[None]:
    agent_logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    quiet = _InputErrorExitToFiles()
    agent_logger.addFilter(quiet)
    try:
        yield
    finally:
        agent_logger.removeFilter(quiet)


def _preempted(run_dir: Path, cause: str) -> bool:
    step = preempted_marker_step(run_dir)
    if step is not None:
        logger.warning("preempted by %s: checkpoint of step %d saved; requeue to resume", cause, step)
    return step is not None

"""Local gloo process groups for tests and benchmarks: join one, or run a function on N spawned ranks."""

from __future__ import annotations

import queue
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_automodel.components.launcher.local import free_port

__all__ = ["free_port", "init_gloo", "run_ranks"]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 600.0) -> None:
    """Join the gloo group of ``world`` ranks on this host at ``127.0.0.1:port`` (collectives time out after
    ``timeout_s``: a stuck peer errors instead of hanging)."""
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=timeout_s),
    )


def run_ranks(target: Callable[..., None], world: int, *args: Any) -> list[Any]:
    """Run ``target(rank, port, *args, results)`` on ``world`` spawned processes; each puts one picklable result
    in ``results`` (bytes for tensors: a tensor in a queue is a file descriptor that dies with its process).

    Returns:
        The results in arrival order (sort by a rank field where order matters).

    Raises:
        RuntimeError: as soon as a rank exits without its result (its traceback is on stderr), not after a hang.
    """
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args, results)) for rank in range(world)]
    for p in procs:
        p.start()
    rows: list[Any] = []
    while len(rows) < world:
        try:
            rows.append(results.get(timeout=1.0))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a rank failed (exit codes {dead}); its traceback is above") from None
    for p in procs:
        p.join()
    return rows

"""Real multi-process gloo groups for tests, with hang detection.

A :class:`DistPool` keeps ``world`` spawned worker processes joined in one gloo
process group, so many test cases share the (slow) process start-up. Each
:meth:`DistPool.run` ships a module-level function to every rank and waits for
all of them with a deadline: a rank that does not answer in time is a hang,
the pool is killed and :class:`HangError` fails the test. A hang is never a skip.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from nemo_automodel.testing.dist import free_port, init_gloo


class HangError(AssertionError):
    """Some rank did not finish within the deadline."""


@dataclass
class RankResult:
    """One rank's outcome: ``value`` when ``ok``, else the exception's type, message and traceback."""

    rank: int
    ok: bool
    value: Any = None
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None


def _dumps(value: Any) -> bytes:
    # torch.save keeps tensors out of shared memory (no file-descriptor leaks).
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(rank: int, world: int, port: int, tasks: Any, results: Any, pg_timeout_s: float) -> None:
    import torch.distributed as dist

    from nemo_automodel.components.distributed.blockdiag_cp import configure_cp_varlen

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init_gloo(rank, world, port, pg_timeout_s)
    results.put(("ready", rank, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        # every task starts from the default knobs: a task (the recipe's worker, say) may configure them process-wide
        configure_cp_varlen()
        try:
            out = RankResult(rank, True, fn(*args, **kwargs))
        except BaseException as exc:  # report everything; the parent decides
            out = RankResult(rank, False, None, type(exc).__name__, str(exc), traceback.format_exc())
        results.put(("done", rank, _dumps(out)))
    dist.destroy_process_group()


class DistPool:
    """``world`` persistent gloo ranks.

    Args:
        world: Number of ranks.
        pg_timeout_s: Process-group timeout inside the workers (a stuck collective errors after it).
        start_timeout_s: Deadline for all ranks to join the group.
    """

    def __init__(self, world: int, pg_timeout_s: float = 60.0, start_timeout_s: float = 120.0) -> None:
        self.world = world
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world, port, self._tasks[r], self._results, pg_timeout_s), daemon=True)
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        self._collect("ready", start_timeout_s)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _collect(self, kind: str, timeout: float) -> dict[int, Any]:
        deadline = time.monotonic() + timeout
        got: dict[int, Any] = {}
        while len(got) < self.world:
            remaining = deadline - time.monotonic()
            try:
                msg_kind, rank, payload = self._results.get(timeout=max(0.05, min(remaining, 1.0)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                if remaining <= 0 or dead:
                    missing = sorted(set(range(self.world)) - set(got))
                    self.close()
                    why = f"rank(s) {dead} died" if dead else f"no answer within {timeout:.0f}s"
                    raise HangError(f"{kind}: rank(s) {missing} did not finish ({why})") from None
                continue
            if msg_kind == kind:
                got[rank] = payload
        return got

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[RankResult]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        Raises:
            HangError: when any rank does not answer within ``timeout`` seconds.
        """
        for q in self._tasks:
            q.put((fn, args, kwargs))
        got = self._collect("done", timeout)
        return [_loads(got[r]) for r in range(self.world)]

    def run_ok(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Like :meth:`run`, but fail with every rank's traceback unless all ranks succeeded."""
        results = self.run(fn, *args, timeout=timeout, **kwargs)
        failed = [r for r in results if not r.ok]
        if failed:
            raise AssertionError("\n".join(f"--- rank {r.rank}:\n{r.traceback}" for r in failed))
        return [r.value for r in results]

    def close(self) -> None:
        for q in self._tasks:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _barrier() -> bool:
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return True


class PoolCache:
    """One live :class:`DistPool` per world size; a broken pool is replaced on next use."""

    def __init__(self) -> None:
        self._pools: dict[int, DistPool] = {}

    def get(self, world: int) -> DistPool:
        pool = self._pools.get(world)
        if pool is not None and not pool.alive:
            pool.close()
            pool = None
        if pool is None:
            pool = self._pools[world] = DistPool(world)
        return pool

    def ensure_healthy(self, world: int) -> None:
        """After a run with failures: a short collective must succeed, else the pool is rebuilt."""
        pool = self._pools.get(world)
        if pool is None:
            return
        try:
            results = pool.run(_barrier, timeout=30)
            healthy = all(r.ok for r in results)
        except HangError:
            healthy = False
        if not healthy:
            pool.close()
            del self._pools[world]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

"""Recipe throughput on CPU: tokens/s of cp=2 vs cp=1 at the same global batch, and the K/V exchange share.

Runs the real recipe loop (``nemo_automodel.recipes.finetune.train``) with the default
model and data for each layout below, in freshly spawned gloo workers:

- ``cp1``:       1 process,  cp=1, dp=1, grad_accum=2 (2 rows per step)
- ``dp2``:       2 processes, cp=1, dp=2, grad_accum=1 (2 rows per step)
- ``cp2-<kv>``:  2 processes, cp=2, dp=1, grad_accum=2 (2 rows per step), for each K/V exchange
  (contiguous layout), balanced + a2a, and ``auto`` for both layout and exchange

Exchange time is the time each step blocked on the K/V exchange, forward and backward,
recorded by the core's exchange ops (``ExchangeOp.wait_s`` / ``backward_wait_s``): what
overlap did not hide, plus waits for a slower peer. The share is exchange time / step
time on rank 0, medians over the steps after ``--warmup``.

    python benchmarks/recipe_throughput.py --steps 25 --warmup 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from nemo_automodel.components.config.schema import FinetuneConfig, to_plain_dict
from nemo_automodel.components.distributed.blockdiag_cp import exchange
from nemo_automodel.components.launcher.local import free_port


def _cp2(kv_exchange: str, layout: str) -> dict[str, Any]:
    """2 processes, cp=2, dp=1, grad_accum=2 with the given exchange and layout."""
    return {"world": 2, "cp": {"size": 2, "kv_exchange": kv_exchange, "layout": layout}, "grad_accum": 2}


LAYOUTS: dict[str, dict[str, Any]] = {
    "cp1": {"world": 1, "cp": {"size": 1}, "grad_accum": 2},
    "dp2": {"world": 2, "cp": {"size": 1}, "grad_accum": 1},
    **{f"cp2-{kv}": _cp2(kv, "contiguous") for kv in ("halo", "a2a", "allgather")},
    "cp2-bal-a2a": _cp2("a2a", "balanced"),
    "cp2-auto": _cp2("auto", "auto"),
}


class ExchangeTimer:
    """Records every K/V exchange the core creates; ``seconds`` is the time steps blocked on them.

    Blocked time = forward waits + backward waits of each layer's exchange op
    (``ExchangeOp.wait_s`` / ``backward_wait_s``): the exchange time that overlap
    did not hide, plus any wait for a slower peer.
    """

    def __init__(self) -> None:
        self.ops: list[exchange.ExchangeOp] = []

    def take(self) -> float:
        """Blocked seconds of the ops recorded since the last call (their backward has run by then)."""
        seconds = sum(op.wait_s + op.backward_wait_s for op in self.ops)
        self.ops.clear()
        return seconds

    def wrap(self, make_op: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> exchange.ExchangeOp:
            op = make_op(*args, **kwargs)
            self.ops.append(op)
            return op

        return recorded


def _worker(rank: int, world: int, port: int, payload: dict[str, Any], run_dir: str, warmup: int) -> None:
    from nemo_automodel.recipes import finetune

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    timer = ExchangeTimer()
    exchange.make_exchange_op = timer.wrap(exchange.make_exchange_op)
    steps: list[dict[str, float]] = []
    real_train_step = finetune.train_step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        timer.take()
        began = time.perf_counter()
        result = real_train_step(*args, **kwargs)
        steps.append({"step_s": time.perf_counter() - began, "exchange_s": timer.take(), "tokens": result.tokens})
        return result

    finetune.train_step = timed_step
    finetune.worker_main(payload, run_dir)
    if rank == 0:
        measured = steps[warmup:]
        step_s = statistics.median(s["step_s"] for s in measured)
        summary = {
            "tokens_per_s": sum(s["tokens"] for s in measured) / sum(s["step_s"] for s in measured),
            "median_step_s": step_s,
            "exchange_share": statistics.median(s["exchange_s"] / s["step_s"] for s in measured),
            "median_exchange_ms": 1000 * statistics.median(s["exchange_s"] for s in measured),
        }
        Path(run_dir, "bench.json").write_text(json.dumps(summary))


def run_layout(name: str, steps: int, warmup: int) -> dict[str, Any]:
    layout = LAYOUTS[name]
    cfg = FinetuneConfig()
    for knob, value in layout["cp"].items():
        setattr(cfg.cp, knob, value)
    cfg.trainer.grad_accum = layout["grad_accum"]
    cfg.trainer.max_steps, cfg.trainer.ckpt_every, cfg.trainer.export_hf = steps, 0, False
    cfg.trainer.log_every = steps
    with tempfile.TemporaryDirectory() as run_dir:
        mp.start_processes(
            _worker,
            args=(layout["world"], free_port(), to_plain_dict(cfg), run_dir, warmup),
            nprocs=layout["world"],
            start_method="spawn",
        )
        return json.loads(Path(run_dir, "bench.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    results = {name: run_layout(name, args.steps, args.warmup) for name in args.layouts}
    print(
        f"\ndefault model and data, {args.steps} steps ({args.warmup} warm-up), global batch 2 rows x 512 tokens, "
        f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'layout':<15}{'tokens/s':>10}{'step ms':>10}{'exchange ms':>13}{'exchange share':>16}")
    for name, r in results.items():
        print(
            f"{name:<15}{r['tokens_per_s']:>10.0f}{1000 * r['median_step_s']:>10.1f}"
            f"{r['median_exchange_ms']:>13.1f}{100 * r['exchange_share']:>15.1f}%"
        )


if __name__ == "__main__":
    main()

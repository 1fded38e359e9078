"""Full fine-tuning vs LoRA (``peft=lora``), side by side: same model, same row length, same CP layout.

Runs the real recipe (``worker_main``) in freshly spawned gloo workers (``recipe_throughput``'s measured worker)
for each mode and reports, per mode and as LoRA / full ratios: median step time after a warm-up, peak RSS per
rank over the training steps (read after the last step, before the final checkpoint and outputs; and its growth
over the process's RSS before the run), and the size on disk of the final checkpoint.

    python benchmarks/lora.py                       # cp=2, 1 row x 1024 tokens, 11M-parameter Llama, r=16
    python benchmarks/lora.py --hidden 1024 --layers 8 --seq-len 2048 --cp 2 --steps 10
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

import torch
import torch.multiprocessing as mp
from recipe_throughput import Run, _config, _rss_mib

from nemo_automodel.components.launcher.local import free_port


def _worker(rank: int, run: Run, port: int, payload: dict[str, Any], run_dir: str, warmup: int) -> None:
    """One rank of the recipe: step times and the peak RSS once the last step is done (``bench<rank>.json``)."""
    from nemo_automodel.recipes import finetune

    torch.set_num_threads(run.threads)
    env = {"RANK": rank, "WORLD_SIZE": run.world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": run.world}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    bare_rss, steps, real_train_step = _rss_mib(), [], finetune.train_step

    def measured_step(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        result = real_train_step(*args, **kwargs)
        steps.append({"step_s": time.perf_counter() - began, "rss_mib": _rss_mib()})
        return result

    finetune.train_step = measured_step
    finetune.worker_main(payload, run_dir)
    summary = {
        "median_step_s": statistics.median(s["step_s"] for s in steps[warmup:]),
        "peak_rss_mib": steps[-1]["rss_mib"],  # ru_maxrss never falls: the peak over setup and every step
        "bare_rss_mib": bare_rss,
    }
    Path(run_dir, f"bench{rank}.json").write_text(json.dumps(summary))


def _dir_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def measure(run: Run, steps: int, warmup: int) -> dict[str, Any]:
    """Train ``run`` for ``steps`` steps; the slowest rank's timings, the peak RSS per rank, the checkpoint size."""
    payload = _config(run.overrides, steps)
    with tempfile.TemporaryDirectory() as run_dir:
        mp.start_processes(
            _worker, args=(run, free_port(), payload, run_dir, warmup), nprocs=run.world, start_method="spawn"
        )
        ranks = [json.loads(Path(run_dir, f"bench{r}.json").read_text()) for r in range(run.world)]
        (checkpoint,) = Path(run_dir, "checkpoints").glob("step_*")
        checkpoint_mib = _dir_mib(checkpoint)
    return {
        "step_s": max(r["median_step_s"] for r in ranks),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "rss_growth_mib": max(r["peak_rss_mib"] - r["bare_rss_mib"] for r in ranks),
        "checkpoint_mib": checkpoint_mib,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16, help="LoRA r (alpha = 2 r)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    model = {
        "model.hidden_size": args.hidden,
        "model.num_layers": args.layers,
        "model.num_heads": args.hidden // 64,
        "model.num_kv_heads": max(1, args.hidden // 256),
        "model.intermediate_size": args.hidden * 11 // 4,
        "model.max_position_embeddings": max(4096, args.seq_len),
    }
    common = {
        **model,
        "cp.size": args.cp,
        "data.seq_len": args.seq_len,
        "data.max_doc_len": args.seq_len,
        "trainer.grad_accum": 1,
        "trainer.ckpt_every": 0,  # the final checkpoint is measured
    }
    lora = {"peft.method": "lora", "peft.r": args.rank, "peft.alpha": 2.0 * args.rank}
    threads = max(1, (os.cpu_count() or 2) // args.cp)
    results = {
        "full": measure(Run(args.cp, threads, common), args.steps, args.warmup),
        "lora": measure(Run(args.cp, threads, {**common, **lora}), args.steps, args.warmup),
    }
    print(
        f"\n{os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f}; Llama hidden {args.hidden} x {args.layers} "
        f"layers, cp={args.cp}, 1 row x {args.seq_len} tokens per step, median of {args.steps - args.warmup} steps; "
        f"LoRA r={args.rank} on every attention and MLP projection"
    )
    print(f"{'':<26}{'full':>10}{'LoRA':>10}{'LoRA/full':>11}")
    rows = (
        ("step time (s)", "step_s"),
        ("peak RSS per rank (MiB)", "peak_rss_mib"),
        ("RSS growth per rank (MiB)", "rss_growth_mib"),
        ("checkpoint (MiB)", "checkpoint_mib"),
    )
    for label, key in rows:
        full, ours = results["full"][key], results["lora"][key]
        print(f"{label:<26}{full:>10.2f}{ours:>10.2f}{ours / full:>11.3f}")


if __name__ == "__main__":
    main()

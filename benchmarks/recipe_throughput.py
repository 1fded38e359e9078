"""The recipe loop on CPU: throughput, K/V exchange share, long-row scaling and syncs per layer.

Runs the real recipe (``nemo_automodel.recipes.finetune.worker_main``) in freshly spawned gloo
workers and reports, side by side in one run:

- default (``--layouts``): tokens/s of cp=2 vs cp=1 at the same global batch (2 rows x 512
  tokens, the default model and data) and the share of step time blocked on the K/V exchange
  (forward and backward waits recorded in each step's CP state: what overlap did not hide, plus
  waits for a slower peer);
- ``--scaling``: one row per step of ``--seq-lens`` tokens (long documents), cp=1 in one process
  with 2 threads vs cp=2 in two processes with 1 thread each (``--cp cp1 cp2 cp4`` adds cp=4,
  ``--ac off on`` activation checkpointing): tokens/s and peak RSS per rank, and from a
  straight-line fit of peak RSS against the row length, the slope ratio and the longest row that
  fits a memory budget per rank, against cp=1 with the same checkpointing; ``--census`` adds, per
  phase (data path, forward, loss, backward, optimizer step) and category, the slope of the live
  tensor bytes at the phase's peak (``memory_census.py``);
- ``--syncs``: control collectives and host syncs of one training step with 1, 8 and 32
  decoder layers (counted with ``nemo_automodel.testing.syncs.count_syncs``), per exchange, and their
  growth per layer; ``consensus=call`` (the per-call agreement of earlier versions) side by side.

    python benchmarks/recipe_throughput.py --steps 25 --warmup 5
    python benchmarks/recipe_throughput.py --scaling --seq-lens 4096 8192 16384 32768 65536
    python benchmarks/recipe_throughput.py --scaling --census --seq-lens 2048 4096 8192 --steps 2 --warmup 1
    python benchmarks/recipe_throughput.py --syncs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import memory_census  # this script's folder
import torch
import torch.multiprocessing as mp

from nemo_automodel.components.config.schema import FinetuneConfig, to_plain_dict
from nemo_automodel.components.launcher.local import free_port
from nemo_automodel.testing.syncs import count_syncs

Census = Literal["off", "counts", "tensors"]


@dataclass(frozen=True)
class Run:
    """One recipe configuration: processes, threads per process and config overrides (``section.key``)."""

    world: int
    threads: int
    overrides: dict[str, Any] = field(default_factory=dict)


def _cp2(kv_exchange: str, layout: str, **more: Any) -> Run:
    """2 processes (1 thread each), cp=2, dp=1, with the given exchange and layout."""
    return Run(2, 1, {"cp.size": 2, "cp.kv_exchange": kv_exchange, "cp.layout": layout, **more})


LAYOUTS: dict[str, Run] = {
    "cp1": Run(1, 2, {"cp.size": 1, "trainer.grad_accum": 2}),
    "dp2": Run(2, 1, {"cp.size": 1, "trainer.grad_accum": 1}),
    **{f"cp2-{kv}": _cp2(kv, "contiguous", **{"trainer.grad_accum": 2}) for kv in ("halo", "a2a", "allgather")},
    "cp2-bal-a2a": _cp2("a2a", "balanced", **{"trainer.grad_accum": 2}),
    "cp2-auto": _cp2("auto", "auto", **{"trainer.grad_accum": 2}),
}


def _worker(
    rank: int,
    run: Run,
    port: int,
    payload: dict[str, Any],
    run_dir: str,
    warmup: int,
    syncs: bool,
    census: Census,
) -> None:
    from nemo_automodel.recipes import finetune

    torch.set_num_threads(run.threads)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(run.world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(run.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    bare_rss = memory_census.peak_rss_mib()
    steps: list[dict[str, Any]] = []
    real_train_step = finetune.train_step

    censused: dict[str, Any] = {}

    def measured_step(*args: Any, **kwargs: Any) -> Any:
        counting = syncs and len(steps) == warmup  # one counted step, after the warm-up
        if census != "off" and len(steps) == warmup:  # the census step, after the warm-up (not timed)
            marks = memory_census.PhaseMarks()
            profiler = memory_census.profiled() if census == "tensors" else contextlib.nullcontext()
            with profiler as prof, marks.installed(args[0]):
                real_train_step(*args, **kwargs)
            censused.update(memory_census.analyse(prof, marks.rss) if prof is not None else {})
            censused["counts"] = marks.per_phase()
        with count_syncs() if counting else contextlib.nullcontext() as counts:
            began = time.perf_counter()
            result = real_train_step(*args, **kwargs)
            elapsed = time.perf_counter() - began
        step = {"step_s": elapsed, "exchange_s": result.exchange_wait_s, "tokens": result.tokens}
        if counts is not None:
            origins = {where for _, where in counts.host}
            step |= {"control": counts.control_collectives, "exchange": sum(counts.exchange.values())}
            step |= {"host": {where: counts.host_syncs_from(where) for where in origins}}
            step |= {"detail": {**counts.control, **{f"{m}@{w}": n for (m, w), n in counts.host.items()}}}
        steps.append(step)
        return result

    finetune.train_step = measured_step
    finetune.worker_main(payload, run_dir)
    measured = steps[warmup:]
    summary = {
        "tokens_per_s": sum(s["tokens"] for s in measured) / sum(s["step_s"] for s in measured),
        "median_step_s": statistics.median(s["step_s"] for s in measured),
        "exchange_share": statistics.median(s["exchange_s"] / s["step_s"] for s in measured),
        "median_exchange_ms": 1000 * statistics.median(s["exchange_s"] for s in measured),
        "peak_rss_mib": memory_census.peak_rss_mib(),
        "bare_rss_mib": bare_rss,
        "counted": measured[0] if syncs else None,
        "census": censused or None,
    }
    Path(run_dir, f"bench{rank}.json").write_text(json.dumps(summary))


def _config(overrides: dict[str, Any], steps: int) -> dict[str, Any]:
    cfg = FinetuneConfig()
    cfg.trainer.max_steps, cfg.trainer.ckpt_every, cfg.trainer.export_hf = steps, 0, False
    cfg.trainer.log_every = steps
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    return to_plain_dict(cfg)


def run(
    run: Run,
    steps: int,
    warmup: int,
    extra: dict[str, Any] | None = None,
    syncs: bool = False,
    census: Census = "off",
) -> dict:
    """Run ``run`` (plus ``extra`` overrides) and return each rank's summary, slowest first.

    ``census``: the first step after the warm-up runs twice, first untimed with marks at its phases that
    count RSS, heap and page faults (``"counts"``), and also under the profiler's tensor census
    (``"tensors"``, ``memory_census.py``).
    """
    payload = _config({**run.overrides, **(extra or {})}, steps)
    with tempfile.TemporaryDirectory() as run_dir:
        mp.start_processes(
            _worker,
            args=(run, free_port(), payload, run_dir, warmup, syncs, census),
            nprocs=run.world,
            start_method="spawn",
        )
        ranks = [json.loads(Path(run_dir, f"bench{r}.json").read_text()) for r in range(run.world)]
    return {
        **min(ranks, key=lambda r: r["tokens_per_s"]),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "ranks": ranks,
    }


def _throughput(args: argparse.Namespace) -> None:
    results = {name: run(LAYOUTS[name], args.steps, args.warmup) for name in args.layouts}
    print(f"\ndefault model and data, {args.steps} steps ({args.warmup} warm-up), global batch 2 rows x 512 tokens")
    print(f"{'layout':<15}{'tokens/s':>10}{'step ms':>10}{'exchange ms':>13}{'exchange share':>16}")
    for name, r in results.items():
        print(
            f"{name:<15}{r['tokens_per_s']:>10.0f}{1000 * r['median_step_s']:>10.1f}"
            f"{r['median_exchange_ms']:>13.1f}{100 * r['exchange_share']:>15.1f}%"
        )


def _long_rows(seq_len: int) -> dict[str, Any]:
    """Overrides for one row of ``seq_len`` tokens per step, long documents (many longer than a CP shard)."""
    return {
        "data.seq_len": seq_len,
        "data.min_doc_len": 256,
        "data.max_doc_len": seq_len,
        "data.num_documents": 64,
        "model.max_position_embeddings": seq_len,
        "trainer.grad_accum": 1,
    }


SCALING = {
    "cp1": Run(1, 2, {"cp.size": 1}),
    "cp2": Run(2, 1, {"cp.size": 2, "cp.kv_exchange": "auto", "cp.layout": "auto"}),
    "cp4": Run(4, 1, {"cp.size": 4, "cp.kv_exchange": "auto", "cp.layout": "auto"}),
}
SCALING_THREADS = "cp1: 1 process x 2 threads; cp2: 2 processes x 1 thread; cp4: 4 processes x 1 thread"


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``rss = a + b * seq_len``."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _scaling(args: argparse.Namespace) -> None:
    """Peak RSS per rank against the row length for each of ``--cp`` (and ``--ac`` off/on), fits and ratios."""
    runs = {
        f"{cp}{' AC' if ac else ''}": (SCALING[cp], {"trainer.activation_checkpointing": ac})
        for ac in args.ac
        for cp in args.cp
    }
    table: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in runs}
    for seq_len in args.seq_lens:
        for name, (config, extra) in runs.items():
            r = run(config, args.steps, args.warmup, {**_long_rows(seq_len), **extra}, census=args.census)
            table[name][seq_len] = r
            print(f"{name} seq_len={seq_len}: {r['tokens_per_s']:.0f} tokens/s, peak RSS {r['peak_rss_mib']:.0f} MiB")
    print(f"\none row per step, default model, {args.steps} steps ({args.warmup} warm-up); {SCALING_THREADS}")
    print(f"{'seq_len':>8} | " + " | ".join(f"{n}: tokens/s, peak RSS MiB/rank" for n in runs))
    for seq_len in args.seq_lens:
        cells = (f"{table[n][seq_len]['tokens_per_s']:.0f}, {table[n][seq_len]['peak_rss_mib']:.0f}" for n in runs)
        print(f"{seq_len:>8} | " + " | ".join(cells))
    fits = {n: _fit([(s, table[n][s]["peak_rss_mib"]) for s in args.seq_lens]) for n in runs}
    for n, (a, b) in fits.items():
        bare = statistics.fmean(r["bare_rss_mib"] for s in args.seq_lens for r in table[n][s]["ranks"])
        print(f"{n}: peak RSS ~ {a:.0f} MiB + {1024 * b:.1f} MiB per 1K tokens (bare process {bare:.0f} MiB)")
    for n in runs:
        base = "cp1 AC" if n.endswith(" AC") else "cp1"
        if n == base or base not in fits:
            continue
        slope = fits[n][1] / fits[base][1]
        longest = {b: (b - fits[n][0]) / fits[n][1] / ((b - fits[base][0]) / fits[base][1]) for b in args.budgets_mib}
        rows = ", ".join(f"{b} MiB {x:.2f}x" for b, x in longest.items())
        print(f"{n} vs {base}: slope {slope:.2f}x; longest row per rank budget: {rows}")
    if args.census != "off":
        _counts_table(table, args.seq_lens)
    if args.census == "tensors":
        _census_table(table, args.seq_lens)


COUNTS = {
    "peak_rss": "peak RSS in the phase",
    "heap_used": "glibc heap in use at its end",
    "heap_free": "glibc heap free (resident) at end",
    "heap_top": "  of which the heap's free top",
    "mapped": "glibc mapped blocks at its end",
    "minflt": "minor page faults (per 1K: count)",
}


def _counts_table(table: dict[str, dict[int, dict[str, Any]]], seq_lens: list[int]) -> None:
    """Per phase of the marked step: slopes (per 1K row tokens, the largest rank) of its peak RSS, glibc's heap
    in use and free and mapped blocks (MiB), and its minor page faults; then the values at the longest row."""
    names = list(table)
    longest = seq_lens[-1]

    def value(name: str, seq_len: int, phase: str, key: str) -> float:
        return max(r["census"]["counts"].get(phase, {}).get(key, 0.0) for r in table[name][seq_len]["ranks"])

    print("\ncounts of the marked step: slope per 1K row tokens (MiB; faults: count), largest rank")
    print(f"{'phase':<10}{'count':<36}" + "".join(f"{n:>10}" for n in names))
    for phase in memory_census.PHASES:
        for key, label in COUNTS.items():
            slopes = [1024 * _fit([(s, value(n, s, phase, key)) for s in seq_lens])[1] for n in names]
            print(f"{phase:<10}{label:<36}" + "".join(f"{x:>10.1f}" for x in slopes))
    print(f"\nthe same at {longest} tokens (MiB; faults: count; CPU seconds of the phase)")
    for phase in memory_census.PHASES:
        for key in (*COUNTS, "cpu_s"):
            cells = "".join(f"{value(n, longest, phase, key):>10.1f}" for n in names)
            print(f"{phase:<10}{COUNTS.get(key, 'CPU seconds'):<36}" + cells)


def _census_table(table: dict[str, dict[int, dict[str, Any]]], seq_lens: list[int]) -> None:
    """Per phase and category: the slope (MiB per 1K row tokens, the largest rank) of live tensor bytes at the
    phase's peak, and RSS at the phase's start; one column per run."""
    names = list(table)
    print("\nmemory census: MiB per 1K row tokens at each phase's peak of live tensors (largest rank)")
    print(f"{'phase':<10}{'category':<34}" + "".join(f"{n:>10}" for n in names))

    def slope(name: str, value: Any) -> float:
        points = [(s, max(value(r["census"]) for r in table[name][s]["ranks"]) / 2**20) for s in seq_lens]
        return 1024 * _fit(points)[1]

    for phase in memory_census.PHASES:
        lines = {"all live tensors": lambda c, p=phase: c.get(p, {}).get("peak_bytes", 0)}
        for bucket in memory_census.BUCKETS:
            lines[bucket] = lambda c, p=phase, b=bucket: c.get(p, {}).get("buckets", {}).get(b, 0)
        lines["RSS at phase start"] = lambda c, p=phase: c["rss_mib"].get(p, 0) * 2**20
        for label, value in lines.items():
            slopes = [slope(n, value) for n in names]
            if any(abs(x) >= 0.05 for x in slopes):
                print(f"{phase:<10}{label:<34}" + "".join(f"{x:>10.1f}" for x in slopes))
    longest = seq_lens[-1]
    for name in names:
        ranks = [r["census"] for r in table[name][longest]["ranks"]]
        census = max(ranks, key=lambda c: c.get("backward", {}).get("peak_bytes", 0))
        print(f"\n{name}, {longest} tokens: largest creators at the backward peak (MiB, the largest rank)")
        for creator, size in census.get("backward", {}).get("top", [])[:8]:
            print(f"{size / 2**20:>10.1f}  {creator}")


SYNC_RUNS = {
    "allgather": _cp2("allgather", "contiguous"),
    "halo": _cp2("halo", "contiguous"),
    "a2a": _cp2("a2a", "contiguous"),
    "auto/auto": _cp2("auto", "auto"),
    "halo, consensus=call": _cp2("halo", "contiguous", **{"cp.consensus": "call"}),
}


def _syncs(args: argparse.Namespace) -> None:
    layers = (1, 8, 32)
    print(f"\none training step (after {args.warmup} warm-up), default data, cp=2, grad_accum=1; counts on rank 0")
    print("ctl: control collectives; cp: host syncs in the CP core; other: host syncs elsewhere; kv: exchanges")
    print(f"{'exchange':<22}" + "".join(f"{f'{n} layers':>30}" for n in layers) + f"{'per layer':>34}")
    for name, config in SYNC_RUNS.items():
        extra = {"model.num_layers": 0, "trainer.grad_accum": 1}
        counted = []
        for n in layers:
            extra["model.num_layers"] = n
            counted.append(run(config, args.warmup + 1, args.warmup, extra, syncs=True)["ranks"][0]["counted"])
        for c in counted:
            c["cp"] = c["host"].get("cp", 0)
            c["other"] = sum(c["host"].values()) - c["cp"]
        cells = "".join(
            f"{c['control']:>8} ctl {c['cp']:>3} cp {c['other']:>4} other {c['exchange']:>3} kv" for c in counted
        )
        k = layers[-1] - layers[0]
        slope = ", ".join(f"{(counted[-1][f] - counted[0][f]) / k:.2f} {f}" for f in ("control", "cp", "other"))
        print(f"{name:<22}{cells}{slope:>34}", flush=True)
        print(f"{'':<22}at {layers[-1]} layers: {counted[-1]['detail']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--scaling", action="store_true", help="long-row scaling, cp=1 vs cp=2 (and cp=4)")
    parser.add_argument("--cp", nargs="+", default=["cp1", "cp2"], choices=list(SCALING), help="--scaling runs")
    parser.add_argument(
        "--ac", nargs="+", type=lambda v: v == "on", default=[False], help="--scaling: activation checkpointing off/on"
    )
    parser.add_argument(
        "--census",
        action="store_const",
        const="tensors",
        default="off",
        help="--scaling: live tensors per phase and category (profiler), plus --counts",
    )
    parser.add_argument(
        "--counts",
        dest="census",
        action="store_const",
        const="counts",
        help="--scaling: per phase peak RSS, glibc heap in use / free, mapped blocks, minor faults (no profiler)",
    )
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--budgets-mib", nargs="+", type=int, default=[2048, 4096, 8192])
    parser.add_argument("--syncs", action="store_true", help="control collectives and host syncs per layer")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}")
    if args.scaling:
        _scaling(args)
    elif args.syncs:
        _syncs(args)
    else:
        _throughput(args)


if __name__ == "__main__":
    main()

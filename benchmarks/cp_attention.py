"""Benchmark one attention block under block-diagonal CP: layouts x exchanges x kernels, side by side.

One block = q/k/v/o projections + ``cp_blockdiag_sdpa``; each iteration is forward
plus ``out.sum().backward()``. Every combination runs in its own set of ``cp``
gloo processes (so peak RSS is per combination) with the same thread count per
rank. Reported per combination (definitions: ../shared/notes/metrics.md):

- time: median over the timed iterations of the slowest rank's iteration time,
  and its ratio to the baselines measured in the same run: ``allgather`` + ``dense``
  (ours: one masked SDPA call over the needed keys, CPU flash kernel) and
  ``allgather`` + ``upstream_dense`` (what the upstream system does without
  flash/TE: all-gathered K/V, a full ``[L, S]`` mask, SDPA restricted to the
  efficient/math kernels, i.e. math on CPU; benchmark-only, not a product kernel);
- balance: max/mean attention work over ranks for the layout;
- peak RSS per rank (``ru_maxrss``) and the RSS of a bare worker before any work;
- K/V tokens received / the lower bound (needed keys living on other ranks);
- overlap: exchange time hidden / exchange time. The exchange time is the layer's
  forward + backward exchange run alone (barrier, then post and wait, median of 5);
  the hidden time is how much less each iteration blocks on the exchange with
  overlap on than off (blocked time also includes waiting for slower peers, the
  same in both runs; medians, slowest rank), clamped to [0, 1].

Usage::

    python benchmarks/cp_attention.py --workload W8K
    python benchmarks/cp_attention.py --workload DOC131K --combos contiguous:halo:sdpa_varlen,balanced:a2a:sdpa_varlen
    python benchmarks/cp_attention.py --workload V8K --variants --rounds 3   # sinks, soft-cap, window vs plain
    python benchmarks/cp_attention.py --workload W8K --paths --rounds 3      # every K/V path and auto, bytes
    python benchmarks/cp_attention.py --workload W8K --paths --cp 4 --iters 1  # + the heads x sequence hybrids
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from nemo_automodel.components.distributed.blockdiag_cp import (
    AttentionVariant,
    configure_cp_varlen,
    exchange,
    exchange_stats,
    make_cp_blockdiag_batch_and_ctx,
)
from nemo_automodel.components.distributed.blockdiag_cp.layout import balance, doc_runs_from_lengths, make_shard_plan
from nemo_automodel.components.distributed.blockdiag_cp.rows import row_views
from nemo_automodel.components.distributed.blockdiag_cp.runtime import reset_exchange_stats
from nemo_automodel.testing.dist import init_gloo, run_ranks
from nemo_automodel.testing.workloads import AttentionBlock, sft_mix

BASELINE = ("contiguous", "allgather", "dense")
UPSTREAM = ("contiguous", "allgather", "upstream_dense")
EXCHANGES = ("allgather", "halo", "a2a", "ulysses", "auto")


@dataclass(frozen=True)
class Workload:
    """A packed row and the attention shape; ``seq_len`` is padded, ``doc_lens`` may leave a padding tail."""

    seq_len: int
    doc_lens: tuple[int, ...]
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    cp: int = 2
    warmup: int = 1
    iters: int = 5
    kernels: tuple[str, ...] = ("sdpa_varlen",)
    window: int | None = None  # sliding window of the attention calls (None: full causal)
    softcap: float | None = None  # logit soft-cap of the attention calls (None: none)
    sinks: bool = False  # one learned sink logit per query head (a parameter of the block)


WORKLOADS = {
    # ../shared/notes/metrics.md: cp=2, fp32, Hq=8, Hkv=4, D=64, S=8192, docs 3000,2000,1500,1000 then padding.
    "W8K": Workload(8192, (3000, 2000, 1500, 1000), kernels=("dense", "sdpa_varlen")),
    # Long-tailed SFT mixes (MIX32K has documents longer than a shard). At 131072 tokens
    # the heads are reduced (2/1 x 32) so that CPU iterations take seconds, not minutes.
    "MIX32K": Workload(32768, tuple(sft_mix(32768, 20000, seed=1))),
    # The issue-2 memory check: 131072 tokens, W8K's heads (8/4 x 64), a realistic mix (16 to 16384 tokens).
    "S131K": Workload(131072, tuple(sft_mix(131072, 16384)), iters=2),  # a memory check: 2 timed iterations
    "MIX131K": Workload(131072, tuple(sft_mix(131072, 40000, seed=2)), heads=2, kv_heads=1, head_dim=32),
    # The recipe's scale: 512 tokens of short documents, its model's heads (8/4 x 32); fixed costs dominate.
    "R512": Workload(512, tuple(sft_mix(512, 400, seed=0)), head_dim=32, iters=30),
    # The variant rows (--variants): an 8K row of five documents, W8K's heads.
    "V8K": Workload(8192, (3000, 2000, 1500, 1000, 692)),
    # One document filling the row: the contiguous layout's worst case (1 x 1 x 16 heads for CPU time).
    "DOC131K": Workload(131072, (131072,), heads=1, kv_heads=1, head_dim=16),
    # One long document with heads to share (4/4 x 32, MHA): where head-parallel CP can compete.
    "DOC16K": Workload(16384, (16384,), heads=4, kv_heads=4, head_dim=32, iters=3),
}


def upstream_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The upstream fallback: all-gather K/V, mask ``[L, S]`` from the document ids, efficient/math SDPA.

    ``q [1, Hq, L, D]``, ``k/v [1, Hkv, L, D]`` -> ``[1, Hq, L, D]``.
    """
    with warnings.catch_warnings():  # deprecated, but it is the differentiable all-gather upstream used
        warnings.simplefilter("ignore", FutureWarning)
        from torch.distributed.nn.functional import all_gather
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nemo_automodel.components.distributed.blockdiag_cp.compat import row_doc_ids
    from nemo_automodel.components.distributed.blockdiag_cp.state import current_row_state

    st = current_row_state()
    k_full = torch.cat(all_gather(k.contiguous(), group=st.group), dim=2)
    v_full = torch.cat(all_gather(v.contiguous(), group=st.group), dim=2)
    ids = row_doc_ids(st)[0]
    rows = torch.arange(st.row_offset, st.row_offset + st.local_len)
    cols = torch.arange(ids.numel())
    q_ids = ids[rows]
    mask = (q_ids[:, None] == ids[None, :]) & (cols[None, :] <= rows[:, None]) & (q_ids[:, None] > 0)
    mask |= cols[None, :] == rows[:, None]  # never a fully masked row (math SDPA would return NaN)
    rep = q.shape[1] // k.shape[1]  # the efficient kernel has no GQA: upstream expands K/V
    k_full, v_full = k_full.repeat_interleave(rep, 1), v_full.repeat_interleave(rep, 1)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@dataclass(frozen=True)
class Combo:
    """One benchmarked combination."""

    layout: str
    kv_exchange: str
    backend: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.layout, self.kv_exchange, self.backend)


def _packed_ids(work: Workload) -> torch.Tensor:
    """Document ids ``[1, S]`` of the workload's row (padding tail = 0)."""
    ids = torch.zeros(1, work.seq_len, dtype=torch.long)
    runs = doc_runs_from_lengths(list(work.doc_lens), work.seq_len)
    for i, (s, e) in enumerate(zip(runs.starts, runs.ends)):
        ids[0, s:e] = i + 1
    return ids


def _timed(
    block: torch.nn.Module, ctx: Any, x: torch.Tensor, work: Workload
) -> tuple[list[float], list[float], list[float]]:
    """Per timed iteration: wall time, seconds blocked on K/V exchanges (forward + backward), and this
    process's CPU time (less sensitive than wall time to other work on a shared machine)."""
    times, waits, cpu = [], [], []
    for it in range(work.warmup + work.iters):
        dist.barrier()
        reset_exchange_stats()
        start, start_cpu = time.perf_counter(), time.process_time()
        with ctx():
            block(x).sum().backward()
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        stats = exchange_stats() or {}
        if it >= work.warmup:
            times.append(elapsed)
            cpu.append(elapsed_cpu)
            waits.append(stats.get("exchange_wait_s", 0.0) + stats.get("exchange_backward_wait_s", 0.0))
    return times, waits, cpu


def _exchange_alone(ctx: Any, work: Workload, local_len: int, path: str, reps: int = 5) -> float:
    """Median seconds of one layer's forward + backward K/V exchange with nothing to overlap."""
    samples = []
    with ctx() as st:
        plan = None if path == "allgather" else exchange.compute_kv_plan(st.shard_plan)
        ranges = [group.kv_ranges for group in st.cache.windows[None].groups]
        route = exchange.make_route(path, "", plan, ranges, st.cp_rank, st.cp_size, local_len)
        k, v = (torch.randn(1, work.kv_heads, local_len, work.head_dim) for _ in range(2))
        for _ in range(reps):
            op = route.new_op(st.group, st.cp_rank, st.cp_size)
            dist.barrier()
            start = time.perf_counter()
            chunks = (row_views(k, route.local_spans), row_views(v, route.local_spans))
            op.start(exchange.send_buffer(k, v, chunks, route.send_chunks))
            received = op.finish()
            op.start_backward(torch.ones_like(received))
            op.finish_backward()
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _median_fwd_bwd(fn: Any, inputs: list[torch.Tensor], reps: int) -> float:
    """Median seconds of ``fn(*inputs).sum().backward()`` (after one warm-up call)."""
    samples = []
    for i in range(reps + 1):
        start = time.perf_counter()
        fn(*inputs).sum().backward()
        if i:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _predicted_s(block: AttentionBlock, work: Workload, segments: Any, reps: int = 3) -> dict[str, float]:
    """This rank's block time predicted from the machine's own kernels, measured here in the same process.

    - projections: the block's q/kv/o linears, forward + backward, on the rank's ``L`` rows;
    - attention: for each local segment of ``q`` rows over ``k`` keys, torch's CPU flash SDPA
      (``is_causal``, forward + backward) on a ``k``-token document gives a rate per (query, key)
      pair, charged for the segment's ``q (k - q) + q (q + 1) / 2`` pairs.
    """
    hidden = work.heads * work.head_dim
    x = torch.randn(1, segments.local_len, hidden, requires_grad=True)
    proj = _median_fwd_bwd(lambda t: block.q(t).sum() + block.kv(t).sum() + block.o(t).sum(), [x], reps)
    attention = 0.0
    rates: dict[int, float] = {}
    for q_len, k_len in zip(segments.q_lens, segments.k_lens):
        if k_len not in rates:
            q = torch.randn(1, work.heads, k_len, work.head_dim, requires_grad=True)
            kv = [torch.randn(1, work.kv_heads, k_len, work.head_dim, requires_grad=True) for _ in range(2)]

            def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=work.heads != work.kv_heads
                )

            rates[k_len] = _median_fwd_bwd(causal, [q, *kv], reps) / (k_len * (k_len + 1) // 2)
        attention += rates[k_len] * (q_len * (k_len - q_len) + q_len * (q_len + 1) // 2)
    return {"projections_s": proj, "attention_s": attention, "predicted_s": proj + attention}


def _worker(
    rank: int,
    port: int,
    work: Workload,
    combo: Combo,
    threads: int,
    overlap_baseline: bool,
    efficiency: bool,
    results: Any,
) -> None:
    torch.set_num_threads(threads)
    init_gloo(rank, work.cp, port, timeout_s=30 * 60)
    bare_rss = _rss_mib()
    torch.manual_seed(0)
    upstream = combo.backend == UPSTREAM[2]
    if upstream and (work.window is not None or work.softcap is not None or work.sinks):
        raise ValueError(
            "--window/--variants: the upstream baseline has no attention variants; leave upstream_dense out of --combos"
        )
    attention = upstream_dense_attention if upstream else None
    sinks = torch.nn.Parameter(torch.zeros(work.heads)) if work.sinks else None  # one learned logit per query head
    variant = AttentionVariant(window=work.window, softcap=work.softcap, sinks=sinks)
    block = AttentionBlock(work.heads, work.kv_heads, work.head_dim, attention, variant)
    block.sinks = sinks  # registered, so the sinks are one of the block's parameters
    ids = _packed_ids(work)
    mesh = init_device_mesh("cpu", (work.cp,), mesh_dim_names=("cp",))
    batch = {"input_ids": torch.zeros_like(ids), "_packed_seq_ids": ids}
    row: dict[str, Any] = {"rank": rank, "bare_rss_mib": bare_rss}
    for overlap in (True, False) if overlap_baseline else (True,):
        configure_cp_varlen(overlap=overlap)
        ctx, _, shard = make_cp_blockdiag_batch_and_ctx(
            mesh,
            None,
            batch,
            attn_backend="dense" if upstream else combo.backend,
            kv_exchange=combo.kv_exchange,
            layout=combo.layout,
        )
        x = torch.randn(1, shard.local_len, work.heads * work.head_dim, requires_grad=True)
        times, waits, cpu = _timed(block, ctx, x, work)
        row["times" if overlap else "times_no_overlap"] = times
        row["cpu_times" if overlap else "cpu_times_no_overlap"] = cpu
        row["waits" if overlap else "waits_no_overlap"] = waits
    # the upstream baseline bypasses cp_blockdiag_sdpa: it all-gathers everything
    row["stats"] = exchange_stats() or {
        "path": "allgather",
        "attn_backend": combo.backend,
        "kv_tokens_received": shard.padded_seq_len - shard.local_len,
    }
    if overlap_baseline and not row["stats"]["path"].startswith("ulysses"):  # heads move: no K/V exchange alone
        row["exchange_s"] = _exchange_alone(ctx, work, shard.local_len, row["stats"]["path"])
    if efficiency and not upstream:
        with ctx() as st:
            row.update(_predicted_s(block, work, st.cache.windows[None].segments))
    # shard.layout is the resolved one (``auto`` picks contiguous or balanced per step)
    plan = make_shard_plan(doc_runs_from_lengths(list(work.doc_lens), shard.padded_seq_len), work.cp, shard.layout)
    bound = plan.segments(rank, work.window).remote_kv_tokens
    work_balance = balance([seg.attention_work for seg in plan.windowed_segments(work.window)])  # windows too
    row.update(peak_rss_mib=_rss_mib(), lower_bound=bound, balance=work_balance)
    results.put(row)
    dist.destroy_process_group()


def _slowest(ranks: list[dict[str, Any]], key: str) -> list[float]:
    return [max(step) for step in zip(*(r[key] for r in ranks))]


def _bytes_received(stats: dict[str, Any]) -> int | None:
    """Bytes one forward receives on a rank: K/V for the key exchanges; q/k/v and the output under ulysses;
    the head group's all-to-alls plus the sequence group's K/V under a hybrid."""
    heads, hybrid = stats.get("ulysses"), stats.get("hybrid")
    if hybrid:
        return hybrid["heads_bytes_received"] + hybrid["sequence_bytes_received"]
    return heads["bytes_received"] if heads else stats.get("kv_bytes_received")


def run_combo(
    work: Workload, combo: Combo, threads: int, overlap_baseline: bool, efficiency: bool = False
) -> dict[str, Any]:
    """Run one combination on ``work.cp`` fresh processes; return the reported figures."""
    runs = run_ranks(_worker, work.cp, work, combo, threads, overlap_baseline, efficiency)
    ranks = sorted(runs, key=lambda r: r["rank"])
    received = [r["stats"]["kv_tokens_received"] for r in ranks]
    # bytes one forward receives per rank: K/V for the key exchanges; q/k/v and the output for ulysses
    moved = [_bytes_received(r["stats"]) for r in ranks]
    bounds = [r["lower_bound"] for r in ranks]
    row = {
        **asdict(combo),
        "path": ranks[0]["stats"]["path"],
        "kernel": ranks[0]["stats"]["attn_backend"],
        "median_s": statistics.median(_slowest(ranks, "times")),
        "median_cpu_s": statistics.median(_slowest(ranks, "cpu_times")),
        "min_s": min(_slowest(ranks, "times")),
        "balance": ranks[0]["balance"],
        "peak_rss_mib": [round(r["peak_rss_mib"]) for r in ranks],
        "bare_rss_mib": [round(r["bare_rss_mib"]) for r in ranks],
        "kv_received": received,
        "mib_received": [None if b is None else round(b / 2**20, 2) for b in moved],
        "lower_bound": bounds,
        "received_over_bound": [
            round(a / b, 2) if b else (1.0 if a == 0 else float("inf")) for a, b in zip(received, bounds)
        ],
    }
    if efficiency and "predicted_s" in ranks[0]:
        # the rank with the most predicted work sets the pace; the others also wait for it
        slowest = max(ranks, key=lambda r: r["predicted_s"])
        measured = statistics.median(slowest["times"])
        row["efficiency"] = {
            "rank": slowest["rank"],
            "measured_s": measured,
            **{k: slowest[k] for k in ("projections_s", "attention_s", "predicted_s")},
            "ratio": slowest["predicted_s"] / measured,
        }
    if overlap_baseline and all("exchange_s" in r for r in ranks):
        alone = max(r["exchange_s"] for r in ranks)
        row["median_no_overlap_s"] = statistics.median(_slowest(ranks, "times_no_overlap"))
        row["exchange_ms"] = 1e3 * alone
        # blocked time = peer skew + exposed exchange; skew is the same with overlap on and off
        saved = statistics.median(_slowest(ranks, "waits_no_overlap")) - statistics.median(_slowest(ranks, "waits"))
        row["hidden"] = min(1.0, max(0.0, saved / alone)) if alone > 0 else None
    return row


def default_combos(work: Workload, workload: str) -> list[Combo]:
    """Layouts x exchanges x the workload's kernels (``layout=auto`` with sdpa_varlen), baselines first."""
    combos = [Combo(*UPSTREAM), Combo(*BASELINE)] if workload == "W8K" else []
    combos += [Combo(layout, ex, k) for layout in ("contiguous", "balanced") for ex in EXCHANGES for k in work.kernels]
    combos += [Combo("auto", ex, "sdpa_varlen") for ex in EXCHANGES]
    return list(dict.fromkeys(combos))


def _speedup(rows: list[dict[str, Any]], baseline: tuple[str, str, str], row: dict[str, Any]) -> str:
    """``row``'s speedup over ``baseline`` measured in the same run ("n/a" when the baseline did not run)."""
    base = next((r["median_s"] for r in rows if (r["layout"], r["kv_exchange"], r["backend"]) == baseline), None)
    return f"{base / row['median_s']:.2f}x" if base else "n/a"


def _table(rows: list[dict[str, Any]]) -> str:
    best_contiguous = min(
        (r["median_s"] for r in rows if r["layout"] == "contiguous" and r["backend"] != UPSTREAM[2]), default=None
    )
    lines = [
        "| layout | kv_exchange | kernel | path | median s | vs allgather+dense | vs upstream_dense "
        "| vs best contiguous | balance | peak RSS MiB/rank | KV recv / lower bound | MiB recv/rank (fwd) "
        "| exchange ms (alone) | overlap hidden |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hidden = r.get("hidden")
        vs_contig = f"{best_contiguous / r['median_s']:.2f}x" if best_contiguous else "n/a"
        lines.append(
            f"| {r['layout']} | {r['kv_exchange']} | {r['kernel']} | {r['path']} | {r['median_s']:.3f} "
            f"| {_speedup(rows, BASELINE, r)} | {_speedup(rows, UPSTREAM, r)} | {vs_contig} | {r['balance']:.3f} "
            f"| {r['peak_rss_mib']} | {r['kv_received']} / {r['lower_bound']} = {r['received_over_bound']} "
            f"| {r['mib_received']} | {r.get('exchange_ms', float('nan')):.1f} "
            f"| {'n/a' if hidden is None else f'{hidden:.0%}'} |"
        )
    return "\n".join(lines)


# The variant rows: name -> the Workload fields that make it (issue 22: sinks <= 1.25x, soft-cap <= 1.5x and a
# 1024-token window <= 0.8x of plain causal, fwd + bwd, same run). Soft-cap 50 is Gemma 2's attention cap.
VARIANTS: dict[str, dict[str, Any]] = {
    "plain causal": {},
    "sinks": {"sinks": True},
    "soft-cap 50": {"softcap": 50.0},
    "window 1024": {"window": 1024},
}
VARIANT_COMBO = Combo("contiguous", "halo", "sdpa_varlen")


def run_variants(work: Workload, combo: Combo, threads: int, rounds: int) -> list[dict[str, Any]]:
    """Each :data:`VARIANTS` row on ``combo``, ``rounds`` times in turn; its ratio to plain causal per round.

    The rows of one round run back to back, so a change of machine load shifts them together; the reported
    ratio is the median over rounds of (variant's median time / plain causal's median time in that round),
    for wall time and for CPU time (the slowest rank's process time, which other work on a shared machine
    disturbs less).
    """
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, fields in VARIANTS.items():
            runs[name].append(run_combo(replace(work, **fields), combo, threads, False))
            print(f"done variant {name!r}: {runs[name][-1]['median_s']:.3f}s", flush=True)

    def ratios(name: str, key: str) -> list[float]:
        return [r[key] / p[key] for r, p in zip(runs[name], runs["plain causal"])]

    return [
        {
            "variant": name,
            "median_s": statistics.median(r["median_s"] for r in runs[name]),
            "vs_plain": statistics.median(ratios(name, "median_s")),
            "per_round": [round(x, 2) for x in ratios(name, "median_s")],
            "median_cpu_s": statistics.median(r["median_cpu_s"] for r in runs[name]),
            "cpu_vs_plain": statistics.median(ratios(name, "median_cpu_s")),
            "cpu_per_round": [round(x, 2) for x in ratios(name, "median_cpu_s")],
        }
        for name in VARIANTS
    ]


def _variant_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | wall s | vs plain causal (per round) | CPU s | CPU vs plain causal (per round) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['variant']} | {r['median_s']:.3f} | {r['vs_plain']:.2f}x ({', '.join(map(str, r['per_round']))}) "
        f"| {r['median_cpu_s']:.3f} | {r['cpu_vs_plain']:.2f}x ({', '.join(map(str, r['cpu_per_round']))}) |"
        for r in rows
    ]
    return "\n".join(lines)


# --paths: every K/V path on its best layout, and auto (issue 25: auto within 5% of the best fixed choice).
PATH_COMBOS = tuple(
    Combo(*c.split(":"))
    for c in (
        "contiguous:allgather:sdpa_varlen",
        "contiguous:halo:sdpa_varlen",
        "balanced:a2a:sdpa_varlen",
        "contiguous:ulysses:sdpa_varlen",
        "auto:auto:sdpa_varlen",
    )
)
# The heads x sequence hybrids (default factorization), added when the CP size has one (--cp 4 and up).
HYBRID_COMBOS = tuple(
    Combo(*c.split(":")) for c in ("contiguous:ulysses+halo:sdpa_varlen", "balanced:ulysses+a2a:sdpa_varlen")
)


def run_paths(work: Workload, combos: list[Combo], threads: int, rounds: int) -> list[dict[str, Any]]:
    """Each combination ``rounds`` times in turn; time, bytes received per rank, and ratio to the best fixed one.

    The combinations of one round run back to back, so a change of machine load shifts them together: the
    ratio is the median over rounds of (combination's median time / the fastest fixed combination's that round).
    On a shared, loaded machine load only ever adds time, so ``best_s`` (the fastest iteration over all rounds)
    and its ratio to the fastest fixed combination's are reported too, with the slowest rank's CPU time per
    iteration (``cpu_s``: the compute and copies, without time-sharing; waits on peers use no CPU).
    """
    runs: dict[Combo, list[dict[str, Any]]] = {c: [] for c in combos}
    for _ in range(rounds):
        for combo in combos:
            runs[combo].append(run_combo(work, combo, threads, False))
            print(f"done {combo.key}: {runs[combo][-1]['median_s']:.3f}s", flush=True)
    fixed = [c for c in combos if "auto" not in (c.layout, c.kv_exchange)]
    best = [min(runs[c][i]["median_s"] for c in fixed) for i in range(rounds)]
    fastest = min(r["min_s"] for c in fixed for r in runs[c])
    least_cpu = min(statistics.median(r["median_cpu_s"] for r in runs[c]) for c in fixed)
    return [
        {
            **asdict(combo),
            "path": samples[0]["path"],
            "median_s": statistics.median(r["median_s"] for r in samples),
            "mib_received": samples[0]["mib_received"],
            "vs_best_fixed": statistics.median(r["median_s"] / b for r, b in zip(samples, best)),
            "best_s": min(r["min_s"] for r in samples),
            "best_vs_best_fixed": min(r["min_s"] for r in samples) / fastest,
            "cpu_s": statistics.median(r["median_cpu_s"] for r in samples),
            "cpu_vs_best_fixed": statistics.median(r["median_cpu_s"] for r in samples) / least_cpu,
            "per_round": [round(r["median_s"] / b, 3) for r, b in zip(samples, best)],
        }
        for combo, samples in runs.items()
    ]


def _paths_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | kv_exchange | path | median s | MiB recv/rank (fwd) | vs best fixed (same round) | per round "
        "| best s | best vs best fixed | CPU s | CPU vs best fixed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['layout']} | {r['kv_exchange']} | {r['path']} | {r['median_s']:.3f} | {r['mib_received']} "
        f"| {r['vs_best_fixed']:.2f}x | {', '.join(map(str, r['per_round']))} | {r['best_s']:.3f} "
        f"| {r['best_vs_best_fixed']:.2f}x | {r['cpu_s']:.3f} | {r['cpu_vs_best_fixed']:.2f}x |"
        for r in rows
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W8K")
    parser.add_argument("--combos", help="comma-separated layout:kv_exchange:attn_backend (default: all CPU ones)")
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch threads per rank (same for every combination)",
    )
    parser.add_argument("--iters", type=int, help="timed iterations (default: the workload's)")
    parser.add_argument(
        "--no-overlap-baseline", action="store_true", help="skip the overlap-off run that measures the exchange time"
    )
    parser.add_argument(
        "--cp-overhead",
        action="store_true",
        help="also time one process on the full row (sdpa_varlen) and report the CP overhead",
    )
    parser.add_argument(
        "--efficiency",
        action="store_true",
        help="also predict each rank's time from this machine's GEMM and flash-SDPA rates (report predicted/measured)",
    )
    parser.add_argument("--window", type=int, help="sliding window of every attention call (default: full causal)")
    parser.add_argument(
        "--variants",
        action="store_true",
        help=f"time plain causal, sinks, soft-cap and a 1024-token window on one combination (default "
        f"{':'.join(VARIANT_COMBO.key)}; --combos picks another) and report each against plain causal",
    )
    parser.add_argument(
        "--paths",
        action="store_true",
        help="time allgather, halo, a2a (balanced), ulysses and auto (or --combos) in rounds; report bytes per rank "
        "and each against the best fixed choice of the same round",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="--variants/--paths: how many times to run every row in turn"
    )
    parser.add_argument("--cp", type=int, help="CP size (default: the workload's)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    work = WORKLOADS[args.workload]
    if args.cp:
        work = replace(work, cp=args.cp)
    if args.iters:
        work = replace(work, iters=args.iters)
    if args.window is not None:
        if args.window < 1:
            parser.error(f"--window {args.window}: must be a positive number of keys")
        work = replace(work, window=args.window)
    if args.variants:
        combo = Combo(*args.combos.split(",")[0].split(":")) if args.combos else VARIANT_COMBO
        rows = run_variants(work, combo, args.threads, args.rounds)
        print(
            f"\nworkload {args.workload}: S={work.seq_len} cp={work.cp} Hq={work.heads} Hkv={work.kv_heads} "
            f"D={work.head_dim} docs={len(work.doc_lens)} threads/rank={args.threads} iters={work.iters} "
            f"combo={':'.join(combo.key)} rounds={args.rounds}\n"
        )
        print(_variant_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return
    if args.paths:
        hybrids = list(HYBRID_COMBOS) if any(work.cp % h == 0 for h in range(2, work.cp)) else []
        chosen = [Combo(*c.split(":")) for c in args.combos.split(",")] if args.combos else [*PATH_COMBOS, *hybrids]
        rows = run_paths(work, chosen, args.threads, args.rounds)
        print(
            f"\nworkload {args.workload}: S={work.seq_len} cp={work.cp} Hq={work.heads} Hkv={work.kv_heads} "
            f"D={work.head_dim} docs={len(work.doc_lens)} threads/rank={args.threads} iters={work.iters} "
            f"rounds={args.rounds}\n"
        )
        print(_paths_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return
    combos = (
        [Combo(*c.split(":")) for c in args.combos.split(",")] if args.combos else default_combos(work, args.workload)
    )
    rows = []
    for combo in combos:
        rows.append(run_combo(work, combo, args.threads, not args.no_overlap_baseline, args.efficiency))
        print(f"done {combo.key}: {rows[-1]['median_s']:.3f}s", flush=True)
    print(
        f"\nworkload {args.workload}: S={work.seq_len} cp={work.cp} Hq={work.heads} Hkv={work.kv_heads} "
        f"D={work.head_dim} docs={len(work.doc_lens)} threads/rank={args.threads} iters={work.iters} "
        f"window={work.window or 'full'}\n"
    )
    print(_table(rows))
    print(f"\nbare worker RSS (after init_process_group, before any work): {rows[0]['bare_rss_mib']} MiB")
    if args.efficiency:
        print(
            "\nblock efficiency = predicted / measured, slowest rank (predicted: projections + per-segment flash SDPA)"
        )
        for r in rows:
            e = r.get("efficiency")
            if e:
                print(
                    f"  {r['layout']}/{r['kv_exchange']}/{r['backend']}: rank {e['rank']} measured "
                    f"{e['measured_s']:.3f} s, predicted {e['predicted_s']:.3f} s (projections "
                    f"{e['projections_s']:.3f} + attention {e['attention_s']:.3f}) -> {e['ratio']:.1%}"
                )
    if args.cp_overhead:
        single = run_combo(replace(work, cp=1), Combo("contiguous", "allgather", "sdpa_varlen"), args.threads, False)
        print(
            f"\none process, full row, sdpa_varlen: {single['median_s']:.3f} s; CP overhead = T(cp ranks) / "
            f"(T(one process) / cp):"
        )
        for r in rows:
            overhead = r["median_s"] / (single["median_s"] / work.cp)
            print(f"  {r['layout']}/{r['kv_exchange']}/{r['backend']}: {overhead:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

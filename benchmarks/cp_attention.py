"""Benchmark one attention block under block-diagonal CP: every exchange x kernel, side by side.

One block = q/k/v/o projections + ``cp_blockdiag_sdpa``; each iteration is forward
plus ``out.sum().backward()``. Every combination runs in its own set of ``cp``
gloo processes (so peak RSS is per combination) with the same thread count per
rank. Reported per combination:

- time: median over the timed iterations of the slowest rank's iteration time,
  and its ratio to the baselines measured in the same run: ``allgather`` + ``dense``
  (ours: one masked SDPA call over the needed keys, CPU flash kernel) and
  ``allgather`` + ``upstream_dense`` (what the upstream system does without
  flash/TE: all-gathered K/V, a full ``[L, S]`` mask, SDPA restricted to the
  efficient/math kernels, i.e. math on CPU; benchmark-only, not a product kernel);
- peak RSS per rank (``ru_maxrss``) and the RSS of a bare worker before any work;
- K/V tokens received / the lower bound (needed keys living on other ranks).

Usage::

    python benchmarks/cp_attention.py --workload W8K
    python benchmarks/cp_attention.py --workload S131K --combos halo:sdpa_varlen,a2a:sdpa_varlen
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from nemo_automodel.components.distributed.blockdiag_cp import (
    cp_blockdiag_sdpa,
    exchange_stats,
    make_cp_blockdiag_batch_and_ctx,
)
from nemo_automodel.components.distributed.blockdiag_cp.layout import doc_runs_from_lengths, rank_segments

BASELINE = ("allgather", "dense")
UPSTREAM = ("allgather", "upstream_dense")


def sft_mix(total: int, seed: int = 0, max_len: int = 16384) -> tuple[int, ...]:
    """A long-tailed SFT-like mix of document lengths filling ``total`` tokens (log-uniform, 16..max_len)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(int(2 ** rng.uniform(4, max_len.bit_length() - 1)), total - sum(lengths)))
    return tuple(lengths)


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


WORKLOADS = {
    # ../shared/notes/metrics.md: cp=2, fp32, Hq=8, Hkv=4, D=64, S=8192, docs 3000,2000,1500,1000 then padding.
    "W8K": Workload(8192, (3000, 2000, 1500, 1000)),
    # A realistic long-tailed mix at 131072 tokens; too slow on CPU for many iterations.
    "S131K": Workload(131072, sft_mix(131072), warmup=1, iters=2),
}


def upstream_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The upstream fallback: all-gather K/V, mask ``[L, S]`` from the document ids, efficient/math SDPA.

    ``q [1, Hq, L, D]``, ``k/v [1, Hkv, L, D]`` -> ``[1, Hq, L, D]``.
    """
    from torch.distributed.nn.functional import all_gather
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nemo_automodel.components.distributed.blockdiag_cp.state import current_step_state

    st = current_step_state()
    k_full = torch.cat(all_gather(k.contiguous(), group=st.group), dim=2)
    v_full = torch.cat(all_gather(v.contiguous(), group=st.group), dim=2)
    ids = st.doc_ids[0]
    rows = torch.arange(st.row_offset, st.row_offset + st.local_len)
    cols = torch.arange(ids.numel())
    q_ids = ids[rows]
    mask = (q_ids[:, None] == ids[None, :]) & (cols[None, :] <= rows[:, None]) & (q_ids[:, None] > 0)
    mask |= cols[None, :] == rows[:, None]  # never a fully masked row (math SDPA would return NaN)
    rep = q.shape[1] // k.shape[1]  # the efficient kernel has no GQA: upstream expands K/V
    k_full, v_full = k_full.repeat_interleave(rep, 1), v_full.repeat_interleave(rep, 1)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask)


class AttentionBlock(torch.nn.Module):
    """``x [1, L, Hq*D]`` -> q/k/v projections -> CP attention -> o projection -> ``[1, L, Hq*D]``."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, upstream: bool = False) -> None:
        super().__init__()
        hidden = heads * head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.attention = upstream_dense_attention if upstream else self._cp_attention
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * head_dim, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        q = self.q(x).view(1, length, self.heads, self.head_dim).transpose(1, 2)
        kv = self.kv(x).view(1, length, 2 * self.kv_heads, self.head_dim).transpose(1, 2)
        out = self.attention(q, *kv.chunk(2, dim=1))
        return self.o(out.transpose(1, 2).reshape(1, length, -1))

    def _cp_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cp_blockdiag_sdpa(q, k, v, enable_gqa=self.heads != self.kv_heads)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _worker(rank: int, port: int, work: Workload, kv_exchange: str, backend: str, threads: int, results: Any) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", rank=rank, world_size=work.cp, init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(minutes=30)
    )
    bare_rss = _rss_mib()
    torch.manual_seed(0)
    upstream = backend == UPSTREAM[1]
    block = AttentionBlock(work.heads, work.kv_heads, work.head_dim, upstream=upstream)
    ids = torch.zeros(1, work.seq_len, dtype=torch.long)
    runs = doc_runs_from_lengths(list(work.doc_lens), work.seq_len)
    for i, (s, e) in enumerate(zip(runs.starts, runs.ends)):
        ids[0, s:e] = i + 1
    mesh = init_device_mesh("cpu", (work.cp,), mesh_dim_names=("cp",))
    batch = {"input_ids": torch.zeros_like(ids), "_packed_seq_ids": ids}
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(
        mesh, None, batch, attn_backend="dense" if upstream else backend, kv_exchange=kv_exchange
    )
    x = torch.randn(1, shard.local_len, work.heads * work.head_dim, requires_grad=True)
    times = []
    for it in range(work.warmup + work.iters):
        dist.barrier()
        start = time.perf_counter()
        with ctx():
            block(x).sum().backward()
        if it >= work.warmup:
            times.append(time.perf_counter() - start)
    lower_bound = rank_segments(runs.padded_to(shard.padded_seq_len), rank, shard.local_len).remote_kv_tokens
    # the upstream baseline bypasses cp_blockdiag_sdpa: it all-gathers everything
    fallback = {
        "path": "allgather",
        "attn_backend": backend,
        "kv_tokens_received": shard.padded_seq_len - shard.local_len,
    }
    results.put(
        {
            "rank": rank,
            "times": times,
            "bare_rss_mib": bare_rss,
            "peak_rss_mib": _rss_mib(),
            "stats": exchange_stats() or fallback,
            "lower_bound": lower_bound,
        }
    )
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_combo(work: Workload, kv_exchange: str, backend: str, threads: int) -> dict[str, Any]:
    """Run one exchange x kernel on ``work.cp`` fresh processes; return the reported figures."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, port, work, kv_exchange, backend, threads, results))
        for r in range(work.cp)
    ]
    for p in procs:
        p.start()
    ranks = sorted((results.get() for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    slowest = [max(step) for step in zip(*(r["times"] for r in ranks))]
    received = [r["stats"]["kv_tokens_received"] for r in ranks]
    bounds = [r["lower_bound"] for r in ranks]
    return {
        "kv_exchange": kv_exchange,
        "attn_backend": backend,
        "path": ranks[0]["stats"]["path"],
        "kernel": ranks[0]["stats"]["attn_backend"],
        "median_s": statistics.median(slowest),
        "peak_rss_mib": [round(r["peak_rss_mib"]) for r in ranks],
        "bare_rss_mib": [round(r["bare_rss_mib"]) for r in ranks],
        "kv_received": received,
        "lower_bound": bounds,
        "received_over_bound": [
            round(a / b, 2) if b else (1.0 if a == 0 else float("inf")) for a, b in zip(received, bounds)
        ],
    }


def _parse_combos(text: str | None, workload: str) -> list[tuple[str, str]]:
    if text:
        return [tuple(c.split(":")) for c in text.split(",")]  # type: ignore[misc]
    if workload == "S131K":  # dense kernels would build an [L, K] mask of up to 8 GiB per rank
        return [(ex, "sdpa_varlen") for ex in ("allgather", "halo", "a2a")]
    return [UPSTREAM, BASELINE] + [
        (ex, k) for ex in ("allgather", "halo", "a2a") for k in ("dense", "sdpa_varlen") if (ex, k) != BASELINE
    ]


def _speedup(rows: list[dict[str, Any]], baseline: tuple[str, str], row: dict[str, Any]) -> str:
    """``row``'s speedup over ``baseline`` measured in the same run ("n/a" when the baseline did not run)."""
    base = next((r["median_s"] for r in rows if (r["kv_exchange"], r["attn_backend"]) == baseline), None)
    return f"{base / row['median_s']:.2f}x" if base else "n/a"


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| kv_exchange | attn_backend | path | median s (slowest rank) | vs allgather+dense "
        "| vs allgather+upstream_dense | peak RSS MiB/rank | KV recv / lower bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kv_exchange']} | {r['attn_backend']} | {r['path']} | {r['median_s']:.3f} "
            f"| {_speedup(rows, BASELINE, r)} | {_speedup(rows, UPSTREAM, r)} | {r['peak_rss_mib']} "
            f"| {r['kv_received']} / {r['lower_bound']} = {r['received_over_bound']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W8K")
    parser.add_argument("--combos", help="comma-separated kv_exchange:attn_backend (default: all CPU ones)")
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch threads per rank (same for every combination)",
    )
    parser.add_argument("--iters", type=int, help="timed iterations (default: the workload's)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    work = WORKLOADS[args.workload]
    if args.iters:
        work = Workload(**{**asdict(work), "iters": args.iters})
    rows = []
    for kv_exchange, backend in _parse_combos(args.combos, args.workload):
        rows.append(run_combo(work, kv_exchange, backend, args.threads))
        print(f"done {kv_exchange}+{backend}: {rows[-1]['median_s']:.3f}s", flush=True)
    print(
        f"\nworkload {args.workload}: S={work.seq_len} cp={work.cp} Hq={work.heads} Hkv={work.kv_heads} "
        f"D={work.head_dim} docs={len(work.doc_lens)} threads/rank={args.threads} iters={work.iters}\n"
    )
    print(_table(rows))
    print(f"\nbare worker RSS (after init_process_group, before any work): {rows[0]['bare_rss_mib']} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

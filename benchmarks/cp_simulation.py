"""Simulate CP at sizes we cannot run here: balance and per-rank K/V traffic, no processes needed.

For cp in {4, 8, 16, 64} and three layout families (one document filling the
row; a long-tailed SFT mix with documents longer than a shard; uniform short
documents), every layout x exchange is evaluated with the runtime's own shard
plans, exchange plans and cost model (``blockdiag_cp.plan``), for a GQA shape
like Llama-3-8B (32 query / 8 K/V heads, head dim 128, bf16) on H100-class links.

Usage::

    python benchmarks/cp_simulation.py [--seq-len 131072] [--cp 4,8,16,64] [--device cuda]
"""

from __future__ import annotations

import argparse
import time

from nemo_automodel.components.distributed.blockdiag_cp import cost
from nemo_automodel.components.distributed.blockdiag_cp.layout import doc_runs_from_lengths
from nemo_automodel.components.distributed.blockdiag_cp.plan import PlanRow, plan_rows
from nemo_automodel.testing.workloads import sft_mix

FAMILIES = {
    "single document": lambda total, shard: [total],
    "SFT mix (docs > shard)": lambda total, shard: sft_mix(total, max(shard, 32), lead=shard + shard // 2),
    "uniform short (512)": lambda total, shard: [512] * (total // 512),
}


def _row_text(family: str, cp: int, r: PlanRow, best: float) -> str:
    return (
        f"| {family} | {cp} | {r.layout} | {r.path} | {r.balance:.3f} | {r.recv_max} | {r.recv_mean:.0f} "
        f"| {r.bytes_max / 2**20:.1f} | {r.bound_max} | {r.step_s * 1e3:.3g} | {r.step_s / best:.2f}x "
        f"| {'<-' if r.auto_pick else ''} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--cp", default="4,8,16,64")
    parser.add_argument("--device", default="cuda", choices=sorted(cost.MACHINES))
    args = parser.parse_args()
    shape = cost.Shape(heads=32, kv_heads=8, head_dim=128, elem_bytes=2)
    machine = cost.MACHINES[args.device]
    print(
        f"S={args.seq_len}, shape 32/8 heads x 128, bf16, machine model '{args.device}'; per layer, forward + "
        "backward; 'relative' is against the best row of the same family and cp\n"
    )
    print(
        "| family | cp | layout | kv_exchange | balance | KV recv/rank max | mean | MiB recv max "
        "| lower bound max | predicted ms | relative | auto |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for family, make in FAMILIES.items():
        for cp in (int(c) for c in args.cp.split(",")):
            start = time.perf_counter()
            rows = plan_rows(
                doc_runs_from_lengths(make(args.seq_len, args.seq_len // cp), args.seq_len), cp, shape, machine
            )
            elapsed = time.perf_counter() - start
            best = min(r.step_s for r in rows)
            for r in rows:
                print(_row_text(family, cp, r, best))
            print(f"| | | _planning {elapsed * 1e3:.0f} ms_ | | | | | | | | | |")


if __name__ == "__main__":
    main()

"""Bytes the attention block writes outside its kernels: a count, not a timing, so shared cores do not move it.

One W8K block iteration (``cp_attention.py``'s block: q/kv/o projections + CP attention, forward and
``out.sum().backward()``) per rank, after a warm-up, counted by :class:`nemo_automodel.testing.glue.WrittenBytes`
(bytes of every new tensor an operator returns, views excluded, and of every tensor an in-place
operator writes). Flash attention and GEMM outputs are the kernels; the rest (joins, copies, zero
fills, gathers, accumulations) is the glue that ``--efficiency`` measures as time.
``tests/test_block_glue.py`` pins the same count on a smaller row.

Usage::

    python benchmarks/block_glue.py --combos contiguous:halo,balanced:a2a
    python benchmarks/block_glue.py --detail --top 40   # glue keyed by forward function / backward node
"""

from __future__ import annotations

import argparse

from benchmarks.cp_attention import WORKLOADS
from nemo_automodel.testing.dist import run_ranks
from nemo_automodel.testing.glue import block_glue_worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--combos", default="contiguous:halo,balanced:a2a", help="comma-separated layout:kv_exchange")
    parser.add_argument("--top", type=int, default=8, help="largest glue operators to list per rank")
    parser.add_argument("--detail", action="store_true", help="key glue by phase: forward function or backward node")
    args = parser.parse_args()
    work = WORKLOADS["W8K"]
    shape = (work.heads, work.kv_heads, work.head_dim)
    print("W8K block, one iteration (forward + backward), MiB written per rank")
    for combo in args.combos.split(","):
        layout, kv_exchange = combo.split(":")
        ranks = run_ranks(block_glue_worker, 2, shape, work.doc_lens, work.seq_len, layout, kv_exchange, args.detail)
        sep = ",\n    " if args.detail else ", "
        for rank, kernel, glue in sorted(ranks):
            top = sep.join(f"{k} {v / 2**20:.1f}" for k, v in sorted(glue.items(), key=lambda kv: -kv[1])[: args.top])
            print(
                f"{layout}/{kv_exchange} rank {rank}: kernels and GEMMs {kernel / 2**20:.1f}, "
                f"glue {sum(glue.values()) / 2**20:.1f} ({top})"
            )


if __name__ == "__main__":
    main()

"""What the step agreement check costs per step, next to one attention layer.

On the first CP call of every optimizer step, every rank fingerprints its rows' configuration,
lengths, document layout and q/k shapes and all-reduces a ``[cp, n]`` int64
table (``runtime._agree_on_rows``); a disagreement raises on every rank. This
measures, on ``cp`` gloo ranks of this machine, the median of:

- ``agreement``: one ``_agree_on_rows`` of one row (fingerprints + the all-reduce), after a barrier;
- ``fingerprints``: its host part alone (hashing the fields);
- ``layer``: one attention layer of the same step, ``cp_blockdiag_sdpa`` forward + backward
  (the exchange, kernels, and the per-call failure consensus), agreement already done.

Usage::

    python benchmarks/agreement_cost.py                  # every workload
    python benchmarks/agreement_cost.py --workloads recipe
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from nemo_automodel.components.distributed.blockdiag_cp import (
    AttentionVariant,
    consensus,
    cp_blockdiag_sdpa,
    make_cp_blockdiag_batch_and_ctx,
    runtime,
)
from nemo_automodel.testing.dist import init_gloo, run_ranks


@dataclass(frozen=True)
class Workload:
    """A packed row (``docs`` documents of about equal length filling ``seq_len``) and the attention shape."""

    seq_len: int
    docs: int
    heads: int
    kv_heads: int
    head_dim: int
    iters: int


WORKLOADS = {
    # the recipe's default model and row: hidden 256, 8 / 4 heads, 512 tokens, ~25 documents
    "recipe": Workload(512, 25, 8, 4, 32, 50),
    "8k": Workload(8192, 40, 8, 4, 64, 10),
    # a long row of many short documents: the largest document-layout fingerprint
    "128k-2000docs": Workload(131072, 2000, 2, 1, 32, 3),
}


def _median_s(fn: Any, iters: int, group: dist.ProcessGroup) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs, each started together after a barrier (slowest rank)."""
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        began = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        times.append(float(elapsed))
    return statistics.median(times)


def _measure(work: Workload) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    group = mesh.get_group()
    lengths = [work.seq_len // work.docs] * work.docs
    lengths[-1] += work.seq_len - sum(lengths)
    ids = torch.repeat_interleave(torch.arange(1, work.docs + 1), torch.tensor(lengths))[None]
    batch = {"input_ids": torch.zeros_like(ids), "_packed_seq_ids": ids}
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, attn_backend="sdpa_varlen", kv_exchange="halo")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, work.heads, shard.local_len, work.head_dim, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, work.kv_heads, shard.local_len, work.head_dim, generator=gen) for _ in range(2))
    k.requires_grad_(), v.requires_grad_()
    with ctx() as state:
        plain = AttentionVariant()
        kernel = runtime._kernel_for(state, q, v, 0.0, plain)[0]
        route = runtime._route(state, q.device, kernel, plain)

        def agreement() -> None:
            state.agreement.agreed = False
            runtime._agree_on_rows(state, q, k, v, 0.0, plain)

        def fingerprints() -> None:
            for value in runtime._agreement_fields(state, q, k, v, kernel, route).values():
                consensus.fingerprint(value)

        def layer() -> None:
            cp_blockdiag_sdpa(q, k, v, enable_gqa=True).sum().backward()

        layer()  # warm-up; also completes this step's agreement
        return {
            "agreement": _median_s(agreement, work.iters * 4, group),
            "fingerprints": _median_s(fingerprints, work.iters * 4, group),
            "layer": _median_s(layer, work.iters, group),
        }


def _worker(rank: int, port: int, world: int, names: list[str], out: Any) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_gloo(rank, world, port)
    out.put((rank, {name: _measure(WORKLOADS[name]) for name in names}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = parser.parse_args()
    results = min(run_ranks(_worker, args.cp, args.cp, args.workloads))[1]  # rank 0's
    print(f"cp={args.cp}, gloo on {os.cpu_count()} CPU cores, fp32; medians, slowest rank")
    print(f"{'workload':<16}{'agreement us':>14}{'fingerprints us':>17}{'layer fwd+bwd ms':>18}{'agreement/layer':>17}")
    for name, r in results.items():
        print(
            f"{name:<16}{1e6 * r['agreement']:>14.0f}{1e6 * r['fingerprints']:>17.0f}"
            f"{1e3 * r['layer']:>18.2f}{100 * r['agreement'] / r['layer']:>16.2f}%"
        )


if __name__ == "__main__":
    main()

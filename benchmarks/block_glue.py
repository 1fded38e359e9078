"""Bytes the attention block writes outside its kernels: a count, not a timing, so shared cores do not move it.

One W8K block iteration (``cp_attention.py``'s block: q/kv/o projections + CP attention, forward and
``out.sum().backward()``) per rank, after a warm-up, under a dispatch mode that adds up the bytes of every
new tensor an operator returns (views excluded) and of every tensor an in-place operator writes. Flash
attention and GEMM outputs are the kernels; the rest (joins, copies, zero fills, gathers, accumulations)
is the glue that ``--efficiency`` measures as time. Nested operators inside a kernel are not seen.

Usage::

    python benchmarks/block_glue.py --combos contiguous:halo,balanced:a2a
"""

from __future__ import annotations

import argparse
import collections
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.cp_attention import WORKLOADS, AttentionBlock, _packed_ids
from nemo_automodel.components.distributed.blockdiag_cp import make_cp_blockdiag_batch_and_ctx
from nemo_automodel.components.launcher.local import free_port

KERNELS = ("_scaled_dot_product_flash", "mm", "addmm", "bmm")


def _tensors(values: Any) -> list[torch.Tensor]:
    items = values if isinstance(values, (tuple, list)) else [values]
    return [t for t in items if isinstance(t, torch.Tensor)]


class WrittenBytes(TorchDispatchMode):
    """Bytes written per operator (and shape, for joins and copies) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name.startswith(("empty", "new_empty")):  # an allocation writes nothing
            return out
        if name.endswith("_") and _tensors(args):  # in place: the first argument is written
            written = _tensors(args)[:1]
        else:
            inputs = {t.untyped_storage().data_ptr() for a in args for t in _tensors(a)}
            written = [t for t in _tensors(out) if t.untyped_storage().data_ptr() not in inputs]
        size = sum(t.numel() * t.element_size() for t in written)
        if size:
            self.bytes[f"{name}{tuple(written[0].shape)}"] += size
        return out


def _worker(rank: int, port: int, layout: str, kv_exchange: str, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(minutes=10)
    )
    work = WORKLOADS["W8K"]
    torch.manual_seed(0)
    block = AttentionBlock(work.heads, work.kv_heads, work.head_dim)
    ids = _packed_ids(work)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    batch = {"input_ids": torch.zeros_like(ids), "_packed_seq_ids": ids}
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(
        mesh, None, batch, attn_backend="sdpa_varlen", kv_exchange=kv_exchange, layout=layout
    )
    x = torch.randn(1, shard.local_len, work.heads * work.head_dim, requires_grad=True)
    with ctx():
        block(x).sum().backward()
    counter = WrittenBytes()
    with ctx(), counter:
        block(x).sum().backward()
    results.put((rank, dict(counter.bytes)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--combos", default="contiguous:halo,balanced:a2a", help="comma-separated layout:kv_exchange")
    parser.add_argument("--top", type=int, default=8, help="largest glue operators to list per rank")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print("W8K block, one iteration (forward + backward), MiB written per rank")
    for combo in args.combos.split(","):
        layout, kv_exchange = combo.split(":")
        results, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, layout, kv_exchange, results)) for r in range(2)]
        for p in procs:
            p.start()
        ranks = sorted(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
        for rank, written in ranks:
            kernel = sum(v for k, v in written.items() if k.startswith(KERNELS))
            glue = {k: v for k, v in written.items() if not k.startswith(KERNELS)}
            top = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(glue.items(), key=lambda kv: -kv[1])[: args.top])
            print(
                f"{layout}/{kv_exchange} rank {rank}: kernels and GEMMs {kernel / 2**20:.1f}, "
                f"glue {sum(glue.values()) / 2**20:.1f} ({top})"
            )


if __name__ == "__main__":
    main()

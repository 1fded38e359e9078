"""Bytes an attention block writes outside its kernels: a count, not a timing, so shared cores do not move it.

One block iteration (:class:`~.workloads.AttentionBlock`: q/kv/o projections + CP attention, forward and
``out.sum().backward()``) per rank, after a warm-up, under a dispatch mode that adds up the bytes of every
new tensor an operator returns (views excluded) and of every tensor an in-place operator writes. Flash
attention and GEMM outputs are the kernels; the rest (joins, copies, zero fills, gathers, accumulations)
is the glue that ``benchmarks/cp_attention.py --efficiency`` measures as time. Nested operators inside a
kernel are not seen. Used by ``benchmarks/block_glue.py`` and by the budget in ``tests/test_block_glue.py``.
"""

from __future__ import annotations

import collections
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_automodel.components.distributed.blockdiag_cp import make_cp_blockdiag_batch_and_ctx
from nemo_automodel.testing.dist import init_gloo
from nemo_automodel.testing.workloads import AttentionBlock

# Operators whose output is a kernel's (flash attention, GEMMs), not glue.
KERNELS = ("_scaled_dot_product_flash", "mm", "addmm", "bmm")


def _tensors(values: Any) -> list[torch.Tensor]:
    items = values if isinstance(values, (tuple, list)) else [values]
    return [t for t in items if isinstance(t, torch.Tensor)]


def _phase() -> str:
    """``B:<node>`` inside backward (the autograd node running), else ``F:<function>:<line>`` (the innermost
    caller in this package, for a forward operator)."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"B:{node.name()}"
    frames = [f for f in traceback.extract_stack() if "nemo_automodel" in f.filename and "testing" not in f.filename]
    return f"F:{frames[-1].name}:{frames[-1].lineno}" if frames else "F:"


class WrittenBytes(TorchDispatchMode):
    """Bytes written per operator (and shape, for joins and copies) while active.

    Args:
        detail: Also key each glue operator by its phase (:func:`_phase`): where the bytes come from.
    """

    def __init__(self, detail: bool = False) -> None:
        super().__init__()
        self.detail = detail
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
            where = f"{_phase()} " if self.detail and not name.startswith(KERNELS) else ""
            self.bytes[f"{where}{name}{tuple(written[0].shape)}"] += size
        return out

    def glue(self) -> dict[str, int]:
        """Bytes per glue operator (everything but :data:`KERNELS`)."""
        return {k: v for k, v in self.bytes.items() if not _is_kernel(k)}

    def kernel_bytes(self) -> int:
        """Bytes the kernels and GEMMs wrote."""
        return sum(v for k, v in self.bytes.items() if _is_kernel(k))


def _is_kernel(key: str) -> bool:
    return key.startswith(KERNELS)


def packed_ids(doc_lens: tuple[int, ...], seq_len: int) -> torch.Tensor:
    """Document ids ``[1, seq_len]`` of documents of ``doc_lens`` tokens in order (padding tail = 0)."""
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    start = 0
    for i, n in enumerate(doc_lens):
        ids[0, start : start + n] = i + 1
        start += n
    return ids


def block_glue_worker(
    rank: int,
    port: int,
    shape: tuple[int, int, int],
    doc_lens: tuple[int, ...],
    seq_len: int,
    layout: str,
    kv_exchange: str,
    detail: bool,
    results: Any,
) -> None:
    """One rank of a 2-rank count (for :func:`~.dist.run_ranks`): puts ``(rank, kernel bytes, glue per op)``.

    Args:
        shape: ``(Hq, Hkv, D)`` of the block.
        doc_lens: The row's documents; ``seq_len``: its length (the rest is padding).
        layout / kv_exchange: The CP settings (``attn_backend="sdpa_varlen"``).
        detail: Key glue by phase (:class:`WrittenBytes`).
    """
    torch.set_num_threads(1)
    init_gloo(rank, 2, port)
    heads, kv_heads, head_dim = shape
    torch.manual_seed(0)
    block = AttentionBlock(heads, kv_heads, head_dim)
    ids = packed_ids(doc_lens, seq_len)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    batch = {"input_ids": torch.zeros_like(ids), "_packed_seq_ids": ids}
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(
        mesh, None, batch, attn_backend="sdpa_varlen", kv_exchange=kv_exchange, layout=layout
    )
    x = torch.randn(1, shard.local_len, heads * head_dim, requires_grad=True)
    with ctx():  # warm-up: the row's host structures are built once, not per call
        block(x).sum().backward()
    counter = WrittenBytes(detail)
    with ctx(), counter:
        block(x).sum().backward()
    results.put((rank, counter.kernel_bytes(), counter.glue()))
    dist.barrier()
    dist.destroy_process_group()

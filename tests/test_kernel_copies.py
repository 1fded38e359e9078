"""The GPU kernels' wrapper copies at most one pack into and one unpack out of the kernel's format per call.

A dispatch-level byte counter (:mod:`tests.copy_counter`) sums the bytes every copy-type aten op
writes during one ``cp_blockdiag_sdpa`` forward and the model's read of its output
(``out.transpose(1, 2).contiguous()``, as transformers' attention does). What the library does
inside its call and what the K/V exchange stages for its collectives are not counted. The budget
is the bytes of the q, k and v the library receives plus the bytes of the output: one pack in and
one unpack out.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp import (
    AttentionVariant,
    cp_blockdiag_sdpa,
    make_cp_blockdiag_batch_and_ctx,
)
from nemo_automodel.testing.cases import GPU_KERNELS, cp_mesh, layout
from nemo_automodel.testing.reference import doc_ids_from_lengths
from tests.cases import fake_kernels
from tests.copy_counter import counting, nbytes, opaque_libraries

HEADS, KV_HEADS, DIM = 4, 2, 8


def _inputs(length: int, token_major: bool) -> list[torch.Tensor]:
    """``q [1, Hq, L, D]``, ``k/v [1, Hkv, L, D]`` stored token-major (as projections give them) or head-major."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for heads in (HEADS, KV_HEADS, KV_HEADS):
        shape = (1, length, heads, DIM) if token_major else (1, heads, length, DIM)
        # the output of an op (as a projection's is): its gradient is consumed, not accumulated into a leaf
        t = torch.randn(shape, generator=gen).requires_grad_().mul(1.0)
        out.append(t.transpose(1, 2) if token_major else t)  # token-major: a view of the projection's output
    return out


def count_call(
    doc_ids: torch.Tensor, kernel: str, kv_exchange: str, shard_layout: str, token_major: bool, window: int | None
) -> dict[str, Any]:
    """Worker (or in process at cp=1): one call's copied bytes, the library's q/k/v bytes and the output's bytes."""
    with fake_kernels(), opaque_libraries():
        mesh = cp_mesh() if torch.distributed.is_initialized() else None
        batch = {"input_ids": torch.zeros_like(doc_ids), "_packed_seq_ids": doc_ids}
        ctx, _, shard = make_cp_blockdiag_batch_and_ctx(
            mesh, None, batch, attn_backend=kernel, kv_exchange=kv_exchange, layout=shard_layout
        )
        q, k, v = _inputs(shard.positions.shape[-1], token_major)
        with ctx():
            with counting() as counter:
                out = cp_blockdiag_sdpa(q, k, v, enable_gqa=True, variant=AttentionVariant(window=window))
                read = out.transpose(1, 2).contiguous()  # what the model reads
            with counting() as backward:
                read.backward(torch.ones_like(read))
    return {
        "copied": counter.bytes,
        "ops": counter.summary(),
        "library_qkv": sum(call["in"] for call in counter.library),
        "library_out": sum(call["out"] for call in counter.library),
        "library_calls": len(counter.library),
        "out": nbytes(out),
        "backward": backward.bytes,
        "backward_ops": backward.summary(),
        "qkv": sum(nbytes(t) for t in (q, k, v)),
        # key/value rows of the padding: no group reads them, so their gradient is zero-filled, not copied
        "kv_padding": int((doc_ids == 0).sum()) * sum(nbytes(t) // t.shape[2] for t in (k, v)),
    }


def _problems(label: str, counts: dict[str, Any]) -> list[str]:
    budget = counts["library_qkv"] + counts["out"]
    if counts["library_calls"] and counts["copied"] <= budget:
        return []
    return [f"{label}: copied {counts['copied']} B > budget {budget} B (q/k/v {counts['library_qkv']} + out "
            f"{counts['out']}); {counts['ops']}"]  # fmt: skip


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("token_major", [True, False], ids=["token_major", "head_major"])
def test_one_pack_and_one_unpack_per_call_in_process(kernel, token_major):
    """cp=1: documents, padding, segments of every shape; torch_varlen also windowed (its square segments)."""
    ids = doc_ids_from_lengths([20, 13, 25], 64)
    windows = (None, 6) if kernel == "torch_varlen" else (None,)
    problems = []
    for window in windows:
        counts = count_call(ids, kernel, "halo", "contiguous", token_major, window)
        problems += _problems(f"{kernel} window={window}", counts)
        # exactly: queries, keys and values copied once only when they are not token-major already (one
        # chunk each at cp=1), and the output rows written once where the model reads them
        exact = (0 if token_major else counts["library_qkv"]) + counts["library_out"]
        if counts["copied"] != exact:
            problems.append(f"{kernel} window={window}: copied {counts['copied']} B, expected {exact}; {counts['ops']}")
        # backward, token-major: each of dq, dk, dv written once, straight into the projections' layout (the
        # padding's key rows zero-filled, not copied)
        expected = counts["qkv"] - counts["kv_padding"]
        if token_major and counts["backward"] != expected:
            problems.append(
                f"{kernel} window={window}: backward copied {counts['backward']} B, expected {expected} "
                f"(dq + dk + dv once, less the padding's zero-filled key rows); {counts['backward_ops']}"
            )
    assert not problems, "\n".join(problems)


CP_CASES = [
    ("straddle", "halo", "contiguous"),
    ("spans_many", "a2a", "balanced"),
    ("straddle", "allgather", "balanced"),
]


@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_one_pack_and_one_unpack_per_call_on_two_ranks(pools, kernel):
    """cp=2: keys assembled from local and received chunks, groups of both kinds, the balanced row order."""
    problems = []
    windows = (None, 6) if kernel == "torch_varlen" else (None,)
    for (name, exchange, shard_layout), token_major, window in itertools.product(CP_CASES, (True, False), windows):
        ids = layout(name, 2)
        results = pools.get(2).run_ok(count_call, ids, kernel, exchange, shard_layout, token_major, window)
        for rank, counts in enumerate(results):
            label = f"{kernel} {name}/{exchange}/{shard_layout} token_major={token_major} window={window} rank {rank}"
            problems += _problems(label, counts)
    assert not problems, "\n".join(problems)


def test_host_structures_are_built_once_per_metadata_and_call_kind(monkeypatch):
    """Every layer of a step reuses the guard's pieces, their cu_seqlens and the variant verdict of its first call."""
    from nemo_automodel.components.distributed.blockdiag_cp import gpu_kernels, kernels

    built = {"pieces": 0, "variant": 0}

    def counted(name, real):
        def call(*args):
            built[name] += 1
            return real(*args)

        return call

    monkeypatch.setattr(gpu_kernels, "boundary_pieces", counted("pieces", gpu_kernels.boundary_pieces))
    monkeypatch.setattr(gpu_kernels, "flash_variant_problem", counted("variant", gpu_kernels.flash_variant_problem))
    meta = kernels.build_varlen_meta((5, 3), (9, 3), 10, "cpu")
    q, k, v = (torch.randn(1, h, n, DIM) for h, n in ((HEADS, 10), (KV_HEADS, 12), (KV_HEADS, 12)))
    variant = AttentionVariant(softcap=2.0, source="layer")
    with fake_kernels():
        first = kernels.blockdiag_attention("flash", q, k, v, meta, None, 0.0, variant)
        for _ in range(3):
            again = kernels.blockdiag_attention("flash", q, k, v, meta, None, 0.0, variant)
    assert built == {"pieces": 1, "variant": 1}
    torch.testing.assert_close(again, first)

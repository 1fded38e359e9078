"""Head-parallel CP (``kv_exchange="ulysses"``): exact against the float64 reference on real gloo groups.

Every CP size 2-4, both layouts, MHA and GQA, head counts that do not divide ``cp``, fewer
K/V heads than ranks and fewer query heads than ranks, every CPU kernel, the GPU kernels'
stand-ins, every variant (windows, chunks, soft-cap, sinks, ``Dv != D``), forward and
backward; the head split itself; the model families.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp import (
    CPOptions,
    cp_blockdiag_sdpa,
    kernels,
    make_cp_blockdiag_batch_and_ctx,
    ulysses,
)
from nemo_automodel.components.distributed.blockdiag_cp.heads import split_heads
from nemo_automodel.components.distributed.blockdiag_cp.layout import make_shard_plan
from nemo_automodel.components.distributed.blockdiag_cp.metadata import build_window_plan
from nemo_automodel.testing.cases import GPU_KERNELS, LAYOUTS, Case, attend_cases, compare, cp_mesh, full_inputs, layout
from tests.families import FAMILIES, cp_run
from tests.faults.injection import AttentionStack, Injector
from tests.test_model_families import _problems as family_problems
from tests.test_parity_distributed import CPU_KERNELS, _check
from tests.test_runtime import _fail_with_options

# (Hq, Hkv): GQA, MHA, an uneven split at cp=4 whose middle rank reads two K/V heads unequally often
# (replicated per query head), one K/V head for every rank, fewer query heads than ranks at cp=3/4
HEADS = ((4, 2), (4, 4), (6, 2), (3, 1), (2, 1))


def test_head_split_is_near_equal_and_reads_the_right_kv_heads():
    split = split_heads(6, 2, 4)
    assert split.query == ((0, 2), (2, 4), (4, 5), (5, 6))
    assert split.kv == ((0,), (0, 1), (1,), (1,))  # query heads 2 and 3 read K/V heads 0 and 1
    replicated = split_heads(8, 2, 3)
    assert replicated.query == ((0, 3), (3, 6), (6, 8))
    assert replicated.kv == ((0,), (0, 1, 1), (1,))  # heads 3, 4, 5 read K/V 0 once and 1 twice: one per query head
    assert split_heads(2, 1, 4).query == ((0, 1), (1, 2), (2, 2), (2, 2))  # ranks 2 and 3 idle
    assert split_heads(2, 1, 4).kv == ((0,), (0,), (), ())
    for heads, kv_heads, cp in itertools.product((1, 2, 3, 4, 6, 8, 12), (1, 2, 4), (2, 3, 4, 8)):
        if heads % kv_heads:
            continue
        split = split_heads(heads, kv_heads, cp)
        group = heads // kv_heads
        for (start, stop), kv in zip(split.query, split.kv):
            read = [h // group for h in range(start, stop)]
            per_kv = (stop - start) // len(kv) if kv else 0
            assert [kv[i // per_kv] for i in range(stop - start)] == read  # contiguous GQA over the received heads


def test_bytes_per_rank_add_up():
    """What one rank sends, the others receive: the all-to-alls' totals balance over the group."""
    for heads, kv_heads, cp in ((4, 2, 2), (6, 2, 4), (3, 1, 3), (2, 1, 4)):
        split = split_heads(heads, kv_heads, cp)
        moved = [split.forward_elements(r, 16, 8, 6) for r in range(cp)]
        assert sum(s for s, _ in moved) == sum(r for _, r in moved)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("shard_layout", ["contiguous", "balanced"])
def test_every_cpu_kernel_and_head_shape_matches_reference(pools, cp, shard_layout):
    names = ("straddle", "spans_many", "tiny_docs", "pad_rank") if cp < 4 else LAYOUTS
    cases = [
        Case(layout(name, cp), backend, "ulysses", heads, seed=cp * 100 + i, layout=shard_layout)
        for i, (name, backend, heads) in enumerate(itertools.product(names, CPU_KERNELS, HEADS))
    ]
    _check(pools, cp, cases)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_variant_matches_reference(pools, cp):
    """Windows (mixed with full layers), chunks, soft-cap, sinks (sharded with their heads) and ``Dv != D``."""
    variants = [
        {"windows": (5,)},
        {"windows": (None, 3, 12)},
        {"windows": (4,), "softcap": 2.0},
        {"windows": (None, 6), "sinks": True},
        {"windows": (7,), "value_dim": 6},
        {"softcap": 1.5, "sinks": True, "value_dim": 12},
        {"chunks": (4,), "sinks": True},
    ]
    combos = itertools.product(("straddle", "spans_many", "pad_tail"), ("contiguous", "balanced"), CPU_KERNELS)
    cases = [
        Case(layout(name, cp), backend, "ulysses", HEADS[i % len(HEADS)], seed=cp * 1000 + i, layout=lay, **v)
        for i, ((name, lay, backend), v) in enumerate(itertools.product(combos, variants))
    ]
    _check(pools, cp, cases)


@pytest.mark.parametrize("backend", GPU_KERNELS)
def test_gpu_kernels_run_through_the_same_registry(pools, backend):
    """The GPU kernels' stand-ins (their real call contracts) over the whole row, windowed and full."""
    softcap = 1.5 if backend in ("flash", "fa3") else None
    cases = [
        Case(layout(name, 3), backend, "ulysses", heads, seed=i, layout=lay, windows=(None, 5), softcap=softcap)
        for i, (name, lay, heads) in enumerate(
            itertools.product(("straddle", "pad_tail"), ("contiguous", "balanced"), ((4, 2), (3, 1)))
        )
    ]
    _check(pools, 3, cases, fakes=True)


def test_a_wrong_head_split_fails_the_comparison(pools):
    """The check is not vacuous: a rank that attends its neighbour's sinks fails against the reference."""
    cases = [Case(layout("straddle", 2), "sdpa_varlen", "ulysses", (4, 2), seed=5, sinks=True)]
    results = pools.get(2).run_ok(_attend_with_shifted_sinks, cases)
    problems = [p for i, case in enumerate(cases) for p in compare(case, [r[i] for r in results], 2)]
    assert any("out max error" in p for p in problems), problems


def _attend_with_shifted_sinks(cases: list[Case]) -> list[dict[str, Any]]:
    """Worker: the ulysses path with each rank's sinks taken one head too far (a broken head split)."""
    real = ulysses._attend_row

    def shifted(plan, rank, call, q, k, v):
        rolled = dataclasses.replace(call.variant, sinks=call.variant.sinks.roll(1))
        return real(plan, rank, dataclasses.replace(call, variant=rolled), q, k, v)

    ulysses._attend_row = shifted
    try:
        return attend_cases(cases)
    finally:
        ulysses._attend_row = real


@pytest.mark.parametrize("cp", [2, 3])
def test_model_families_match_unpacked_eager(pools, cp):
    """Every family (4 query / 2 K/V heads: at cp=3 an uneven split and fewer K/V heads than ranks), both layouts."""
    cases = (("contiguous", "ulysses"), ("balanced", "ulysses"))
    names = list(FAMILIES) if cp == 3 else ["llama", "gemma2", "gpt_oss", "deepseek_v3"]
    failures = []
    for name in names:
        results = pools.get(cp).run_ok(cp_run, name, cases, timeout=180)
        problems = family_problems(name, results, cases)
        failures += [f"{name}: {p}" for found in problems.values() for p in found]
        failures += [f"{name}: path {r[i]['path']}" for r in results for i in range(2) if r[i]["path"] != "ulysses"]
    assert not failures, "\n".join(map(str, failures))


def _dropout_errors(case: Case, dropout_p: float) -> dict[str, Any]:
    """Worker: ulysses with dropout against the cp=1 kernel on each rank's heads under the same RNG seed.

    Every rank seeds the same generator before the call, so the kernel rank ``r`` runs on its heads of
    the whole row must draw the masks the same kernel draws on those heads alone in one process.
    """
    batch = {"input_ids": torch.zeros_like(case.doc_ids), "_packed_seq_ids": case.doc_ids}
    options = CPOptions(attn_backend=case.backend, kv_exchange="ulysses", layout=case.layout)
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, batch, options=options)
    full = full_inputs(case, shard.padded_seq_len)
    local = [full[n].index_select(2, shard.positions).requires_grad_() for n in ("q", "k", "v")]
    with ctx() as st:
        torch.manual_seed(7)
        out = cp_blockdiag_sdpa(*local, dropout_p=dropout_p, enable_gqa=True)
        out.sum().backward()
        meta = build_window_plan(make_shard_plan(st.shard_plan.runs, 1), 0, None, "cpu").varlen_meta
    split = split_heads(case.heads[0], case.heads[1], shard.cp_size)

    def single_process(p: float) -> torch.Tensor:
        """Each rank's heads over the whole row, in one process, the RNG seeded as every rank seeds it."""
        parts = []
        for (start, stop), kv in zip(split.query, split.kv):
            torch.manual_seed(7)
            k, v = (full[n][:, list(kv), : meta.kv_len] for n in ("k", "v"))
            if start < stop:
                parts.append(kernels.blockdiag_attention(case.backend, full["q"][:, start:stop], k, v, meta, None, p))
        return torch.cat(parts, dim=1).index_select(2, shard.positions)

    return {
        "error": (out.detach() - single_process(dropout_p)).abs().max().item(),
        "dropout_changed_it_by": (out.detach() - single_process(0.0)).abs().max().item(),
        "finite_grads": all(bool(torch.isfinite(t.grad).all()) for t in local),
    }


@pytest.mark.parametrize("shard_layout", ["contiguous", "balanced"])
def test_dropout_draws_what_the_cp1_kernel_draws_on_the_same_heads(pools, shard_layout):
    case = Case(layout("straddle", 3), "sdpa_varlen", "ulysses", (4, 2), seed=3, layout=shard_layout)
    for result in pools.get(3).run_ok(_dropout_errors, case, 0.3):
        assert result["error"] < 1e-12 and result["dropout_changed_it_by"] > 0.1 and result["finite_grads"], result


def _checkpointed_grads(checkpointed: bool) -> list[torch.Tensor]:
    """Worker: gradients of a 3-layer attention stack under ulysses, with or without activation checkpointing."""
    ids = layout("spans_many", 2)
    options = CPOptions(attn_backend="sdpa_varlen", kv_exchange="ulysses", layout="balanced")
    batch = {"input_ids": torch.zeros_like(ids), "_packed_seq_ids": ids}
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, batch, options=options)
    x_full = torch.randn(1, shard.padded_seq_len, AttentionStack.HIDDEN, generator=torch.Generator().manual_seed(0))
    x = x_full.double().index_select(1, shard.positions).requires_grad_()
    torch.manual_seed(0)
    model = AttentionStack(3, Injector(None, None, 0), checkpointed)
    with ctx():
        model(x).pow(2).sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


def test_activation_checkpointing_recomputes_both_all_to_alls(pools):
    """Recompute re-runs both all-to-alls inside backward on every rank: the gradients are unchanged."""
    plain = pools.get(2).run_ok(_checkpointed_grads, False)
    recomputed = pools.get(2).run_ok(_checkpointed_grads, True)
    for want, got in zip(plain, recomputed):
        assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(want, got))


@pytest.mark.parametrize(("consensus_mode", "where"), [("step", "exit"), ("call", "call")])
def test_a_kernel_failure_raises_on_every_rank_per_step_or_per_call(pools, consensus_mode, where):
    options = CPOptions(attn_backend="sdpa_varlen", kv_exchange="ulysses", consensus=consensus_mode)
    results = pools.get(2).run_ok(_fail_with_options, 1, options, True, timeout=60)
    for raised in results:
        assert [w for w, _ in raised] == [where]
        assert "forward failed on CP rank(s) [1] (CP rank 1: CP attention call 0)" in raised[0][1]
    pools.ensure_healthy(2)

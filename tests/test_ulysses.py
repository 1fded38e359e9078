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

from nemo_automodel.components.distributed.blockdiag_cp import ulysses
from nemo_automodel.components.distributed.blockdiag_cp.heads import split_heads
from tests.cases import GPU_KERNELS, LAYOUTS, Case, attend_cases, compare, layout
from tests.families import FAMILIES, cp_run
from tests.test_model_families import _problems as family_problems
from tests.test_parity_distributed import CPU_KERNELS, _check

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

    def shifted(plan, rank, kernel, q, k, v, scale, dropout_p, variant, recorder):
        rolled = dataclasses.replace(variant, sinks=variant.sinks.roll(1))
        return real(plan, rank, kernel, q, k, v, scale, dropout_p, rolled, recorder)

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

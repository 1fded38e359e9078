"""CP attention equals the float64 single-process reference, forward and backward, on real gloo groups."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_automodel.testing.cases import GPU_KERNELS, LAYOUTS, Case, attend_cases, compare, layout
from nemo_automodel.testing.reference import doc_ids_from_lengths
from tests.cases import attend_fake_cases

EXCHANGES = ("allgather", "halo", "a2a", "auto")
CPU_KERNELS = ("sdpa_varlen", "dense")
HEADS = ((4, 2), (2, 2))


def _check(pools, cp: int, cases: list[Case], fakes: bool = False) -> None:
    results = pools.get(cp).run_ok(attend_fake_cases if fakes else attend_cases, cases)
    problems = [p for i, case in enumerate(cases) for p in compare(case, [r[i] for r in results], cp)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("shard_layout", ["contiguous", "balanced", "auto"])
def test_every_exchange_and_cpu_kernel_matches_reference(pools, cp, name, shard_layout):
    ids = layout(name, cp)
    cases = [
        Case(ids, backend, ex, heads, seed=cp * 100 + i, layout=shard_layout)
        for i, (ex, backend, heads) in enumerate(itertools.product(EXCHANGES, CPU_KERNELS, HEADS))
    ]
    _check(pools, cp, cases)


@pytest.mark.parametrize("shard_layout", ["contiguous", "balanced"])
def test_without_overlap_results_are_identical(pools, shard_layout):
    cases = [
        Case(layout(name, 3), "sdpa_varlen", ex, (4, 2), seed=i, layout=shard_layout, overlap=False)
        for i, (name, ex) in enumerate(itertools.product(LAYOUTS, EXCHANGES))
    ]
    _check(pools, 3, cases)


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("backend", GPU_KERNELS)
def test_gpu_kernel_call_contracts_match_reference(pools, cp, backend):
    """The stand-ins implement the real call contracts (tests/fakes); a wrong mask, alignment or cu_seqlens fails."""
    cases = [
        Case(layout(name, cp), backend, ex, (4, 2), seed=i, layout=shard_layout)
        for i, (name, ex, shard_layout) in enumerate(itertools.product(LAYOUTS, EXCHANGES, ("contiguous", "balanced")))
    ]
    _check(pools, cp, cases, fakes=True)


def test_scale_and_auto_backend(pools):
    ids = layout("straddle", 2)
    _check(pools, 2, [Case(ids, "auto", "halo", (4, 2), scale=0.3), Case(ids, "sdpa_varlen", "a2a", (4, 4), scale=1.7)])


@st.composite
def _random_layout(draw):
    cp = draw(st.sampled_from([2, 3, 4]))
    total = draw(st.integers(2 * cp, 12 * cp))
    lengths, used = [], 0
    while used < total:
        n = draw(st.integers(1, max(1, total - used)))
        lengths.append(n)
        used += n
    padding = draw(st.integers(0, min(total - 1, 2 * cp + 3)))
    lengths[-1] -= min(padding, lengths[-1] - 1)
    return cp, doc_ids_from_lengths(lengths, total)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    _random_layout(),
    st.sampled_from(EXCHANGES),
    st.sampled_from(CPU_KERNELS + GPU_KERNELS),
    st.sampled_from(HEADS),
    st.sampled_from(["contiguous", "balanced"]),
)
def test_random_layouts_match_reference(pools, drawn, kv_exchange, backend, heads, shard_layout):
    cp, ids = drawn
    case = Case(ids, backend, kv_exchange, heads, seed=int(ids.sum()), layout=shard_layout)
    _check(pools, cp, [case], fakes=backend in GPU_KERNELS)


VARIANT_LAYOUTS = ("straddle", "spans_many", "tiny_docs", "pad_tail")


def _variant_cases(cp: int) -> list[Case]:
    """Windows (alone, mixed with full layers, shorter and longer than documents), soft-cap, sinks and Dv != D."""
    variants = [
        {"windows": (5,)},
        {"windows": (None, 3, 12)},
        {"windows": (4,), "softcap": 2.0},
        {"windows": (None, 6), "sinks": True},
        {"windows": (7,), "value_dim": 6},
        {"softcap": 1.5, "sinks": True, "value_dim": 12},
    ]
    combos = itertools.product(VARIANT_LAYOUTS, ("contiguous", "balanced"), EXCHANGES, CPU_KERNELS)
    return [
        Case(layout(name, cp), backend, ex, (4, 2), seed=cp * 1000 + i, layout=shard_layout, **variants[i % 6])
        for i, (name, shard_layout, ex, backend) in enumerate(combos)
    ]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_attention_variants_match_reference(pools, cp):
    """Sliding windows, soft-cap, sinks and MLA value dims: exact, and needed-only receives the windowed bound."""
    _check(pools, cp, _variant_cases(cp))


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("backend", GPU_KERNELS)
def test_gpu_kernels_compute_windows_and_softcaps_under_cp(pools, cp, backend):
    """Windowed (mixed with full) calls on every GPU kernel's stand-in; soft-caps where the library has them, and
    sinks on flash and fa3 (their private forward/backward pairs) in every other case."""
    softcap = 1.5 if backend in ("flash", "fa3") else None
    combos = itertools.product(("straddle", "spans_many", "pad_tail"), ("halo", "a2a"), ("contiguous", "balanced"))
    cases = [
        Case(
            layout(name, cp),
            backend,
            ex,
            (4, 2),
            seed=i,
            layout=lay,
            windows=(None, 5),
            softcap=softcap,
            sinks=backend in ("flash", "fa3") and i % 2 == 0,
        )
        for i, (name, ex, lay) in enumerate(combos)
    ]
    _check(pools, cp, cases, fakes=True)


@pytest.mark.parametrize("cp", [2, 3])
def test_chunked_attention_matches_per_document_chunks(pools, cp):
    """Chunked calls (Llama 4), mixed with a full one, on the CPU kernels and every GPU stand-in: exact against
    per-document chunks, and needed-only receives only keys of each query's own chunk (the reported bound)."""
    combos = itertools.product(("straddle", "spans_many"), (("contiguous", "halo"), ("balanced", "a2a")))
    cases = [
        Case(layout(name, cp), backend, ex, (4, 2), seed=cp * 10 + i, layout=lay, chunks=(chunk,))
        for i, ((name, (lay, ex)), backend, chunk) in enumerate(itertools.product(combos, CPU_KERNELS, (4, 9)))
    ]
    _check(pools, cp, cases)
    fake = [
        Case(layout("straddle", cp), backend, ex, (4, 2), seed=i, layout=lay, chunks=(5,))
        for i, (backend, (lay, ex)) in enumerate(
            itertools.product(GPU_KERNELS, (("contiguous", "halo"), ("balanced", "a2a")))
        )
    ]
    _check(pools, cp, fake, fakes=True)

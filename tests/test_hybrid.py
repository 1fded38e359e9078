"""Heads x sequence hybrid CP (``kv_exchange="ulysses+halo"`` / ``+a2a`` / ``+allgather``).

Exact against the float64 reference on real gloo groups at cp=4 (2 x 2) and cp=6 (3 x 2): both layouts,
MHA and GQA, head counts that do not divide ``h``, fewer K/V heads than ``h`` and fewer query heads than
``h``, every CPU kernel, windows, chunks, soft-cap, sinks and ``Dv != D``, forward and backward; the K/V
rows each part moved; the re-sharding of the sequence part; a kernel failure inside a hybrid step;
the factorization's errors; ``auto``'s pick and the cost model; a model family at cp=4.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp import CPOptions, cost, heads, hybrid
from nemo_automodel.components.distributed.blockdiag_cp.exchange import compute_kv_plan
from nemo_automodel.components.distributed.blockdiag_cp.layout import doc_runs_from_ids, make_shard_plan
from nemo_automodel.components.distributed.blockdiag_cp.topology import GroupHosts, RankHost
from nemo_automodel.testing.cases import Case, layout
from tests.families import cp_run
from tests.test_model_families import _problems as family_problems
from tests.test_parity_distributed import CPU_KERNELS, _check
from tests.test_runtime import _fail_with_options

HYBRIDS = ("ulysses+halo", "ulysses+a2a", "ulysses+allgather")
# (Hq, Hkv): GQA, MHA, uneven over h=2 and 3 (K/V replicated per query head), one K/V head (fewer than h),
# fewer query heads than h=3
HEADS = ((4, 2), (4, 4), (6, 2), (3, 1), (2, 1))


def _hosts(*names: str) -> GroupHosts:
    return GroupHosts(tuple(range(len(names))), tuple(RankHost(n, n) for n in names))


def test_factorization_defaults_and_errors_name_the_field_and_fix():
    assert hybrid.factor("ulysses+halo", 4, None, None) == 2
    assert hybrid.factor("ulysses+halo", 6, None, None) == 3  # largest proper divisor on one node
    assert hybrid.factor("ulysses+halo", 6, 2, None) == 2
    assert hybrid.factor("ulysses+a2a", 8, None, _hosts(*"aaaabbbb")) == 4  # the ranks of one node
    with pytest.raises(ValueError, match=r"head_parallel=4 does not fit cp_size=6: set head_parallel to one of \[2, 3"):
        hybrid.factor("ulysses+halo", 6, 4, None)
    with pytest.raises(ValueError, match=r"cp=3 has no such factorization: use kv_exchange='ulysses' or 'halo'"):
        hybrid.factor("ulysses+halo", 3, None, None)
    with pytest.raises(ValueError, match=r"head_parallel=4 does not fit cp_size=4"):
        hybrid.factor("ulysses+halo", 4, 4, None)
    with pytest.raises(ValueError, match=r"head_parallel=2 applies to the heads x sequence hybrids only"):
        CPOptions(kv_exchange="halo", head_parallel=2)
    with pytest.raises(ValueError, match=r"head_parallel: expected an integer >= 2"):
        CPOptions(kv_exchange="ulysses+halo", head_parallel=1)
    assert CPOptions(kv_exchange="ulysses+a2a", head_parallel=3).head_parallel == 3


@pytest.mark.parametrize("shard_layout", ["contiguous", "balanced"])
@pytest.mark.parametrize(("cp", "h"), [(4, 2), (6, 3), (6, 2), (8, 4)])
def test_the_sequence_part_holds_exactly_its_head_groups_rows(shard_layout, cp, h):
    """Rank ``g`` of the sequence part holds head group ``g``'s real rows in inner order, its padding last."""
    for name in ("straddle", "spans_many", "pad_rank", "tiny_docs"):
        ids = layout(name, cp)
        runs = doc_runs_from_ids(ids, "ids").padded_to(ids.shape[1] + (-ids.shape[1]) % (2 * cp))
        shard = make_shard_plan(runs, cp, shard_layout)
        merged = heads.sequence_plan(shard, h)
        span = h * shard.local_len
        for g in range(cp // h):
            received = shard.permutation[g * span : (g + 1) * span]
            order = hybrid.inner_order(shard, g, h)
            inner = received if order is None else received[order]
            assert torch.equal(merged.permutation[g * span : (g + 1) * span], inner), (name, g)
            real = sum(p.length for p in merged.pieces[g])
            assert bool((inner[real:] >= runs.n_real).all()) and bool((inner[:real] < runs.n_real).all())


def test_every_head_shape_exchange_and_cpu_kernel_matches_reference_at_cp4(pools):
    """h=2 x s=2: both layouts, every hybrid, every head shape, the CPU kernels in turn."""
    combos = itertools.product(("straddle", "spans_many", "pad_rank"), ("contiguous", "balanced"), HYBRIDS)
    cases = [
        Case(layout(name, 4), CPU_KERNELS[i % len(CPU_KERNELS)], ex, HEADS[i % len(HEADS)], seed=400 + i, layout=lay)
        for i, (name, lay, ex) in enumerate(combos)
    ]
    _check(pools, 4, cases)


def test_every_variant_matches_reference_at_cp4(pools):
    """Windows (mixed with full layers), chunks, soft-cap, sinks (sliced per head group member) and ``Dv != D``."""
    variants = [
        {"windows": (None, 3, 12)},
        {"windows": (4,), "softcap": 2.0},
        {"windows": (None, 6), "sinks": True},
        {"softcap": 1.5, "sinks": True, "value_dim": 12},
        {"chunks": (4,), "sinks": True},
    ]
    combos = itertools.product(("straddle", "tiny_docs"), ("contiguous", "balanced"), variants)
    cases = [
        Case(layout(name, 4), "sdpa_varlen", HYBRIDS[i % 2], HEADS[i % len(HEADS)], seed=4000 + i, layout=lay, **v)
        for i, (name, lay, v) in enumerate(combos)
    ]
    _check(pools, 4, cases)


def test_three_heads_by_two_sequence_ranks_at_cp6(pools):
    """h=3 x s=2 (the default at cp=6): uneven head splits, fewer query or K/V heads than h."""
    cases = [
        Case(layout("spans_many", 6), "sdpa_varlen", ex, heads, seed=600 + i, layout=lay, sinks=i % 2 == 0)
        for i, (lay, ex, heads) in enumerate(
            itertools.product(("contiguous", "balanced"), HYBRIDS[:2], ((4, 2), (2, 1), (6, 6)))
        )
    ]
    _check(pools, 6, cases)


@pytest.mark.parametrize(("consensus_mode", "where"), [("step", "exit"), ("call", "call")])
def test_a_kernel_failure_in_a_hybrid_step_raises_on_every_rank(pools, consensus_mode, where):
    """Rank 1 (head group 0, sequence group {1, 3}) fails: every rank of the CP group raises, none hangs."""
    options = CPOptions(attn_backend="sdpa_varlen", kv_exchange="ulysses+halo", consensus=consensus_mode)
    results = pools.get(4).run_ok(_fail_with_options, 1, options, True, timeout=90)
    for raised in results:
        assert [w for w, _ in raised] == [where]
        assert "forward failed on CP rank(s) [1] (CP rank 1: CP attention call 0)" in raised[0][1]
    pools.ensure_healthy(4)


def test_auto_picks_the_hybrid_where_the_cost_model_says_so_and_it_matches_reference(pools):
    """One document over 4 ranks, balanced: the cost model prefers 2 x 2 (``ulysses+halo``) to every single path."""
    ids = layout("spans_many", 4)
    shard = make_shard_plan(doc_runs_from_ids(ids, "ids").padded_to(ids.shape[1] + (-ids.shape[1]) % 8), 4, "balanced")
    best, reason = cost.choose_auto(shard, compute_kv_plan(shard), cost.Shape(4, 2, 8, 8), cost.MACHINES["cpu"])
    assert best.label == "ulysses+halo (2x2)", reason
    cases = [Case(ids, "sdpa_varlen", "auto", hq, seed=40 + i, layout="balanced") for i, hq in enumerate(HEADS[:3])]
    _check(pools, 4, cases)  # the kit checks the path taken (a hybrid) and what each part received


def test_cost_model_bytes_per_part_and_inter_node_link():
    """Per part bytes are the head split's and the sequence plan's; across nodes heads stay inside a node."""
    runs = doc_runs_from_ids(torch.ones(1, 4096, dtype=torch.long), "ids")
    shard = make_shard_plan(runs, 8, "balanced")
    shape, machine = cost.Shape(32, 8, 128, 2), cost.MACHINES["cuda"]
    hybrid_cost = cost.predict_hybrid("ulysses+a2a", 4, shard, shape, machine)
    split = heads.split_heads(32, 8, 4)
    for r in range(8):
        want = split.forward_elements(r % 4, shard.local_len, 128, 128)[1] * 2
        assert hybrid_cost.head_bytes[r] == want
        assert hybrid_cost.recv_bytes[r] == want + hybrid_cost.sequence_bytes[r]
    assert hybrid_cost.factorization == (4, 2) and all(b > 0 for b in hybrid_cost.sequence_bytes)
    two_nodes = (0, 0, 0, 0, 1, 1, 1, 1)
    kv = compute_kv_plan(shard)
    best, reason = cost.choose_auto(shard, kv, shape, machine, nodes=two_nodes)
    # heads inside a node; between nodes only a collective unless needed-only across nodes is allowed
    assert best.path == "ulysses+allgather" and best.factorization == (4, 2), reason
    best, reason = cost.choose_auto(shard, kv, shape, machine, nodes=two_nodes, allow_cross_node=True)
    assert best.path in ("ulysses+halo", "ulysses+a2a") and best.factorization == (4, 2), reason
    across = cost.predict("allgather", shard, kv, shape, machine, nodes=two_nodes)
    inside = cost.predict("allgather", shard, kv, shape, machine)
    assert across.step_s > inside.step_s  # the inter-node link is slower
    assert cost.default_degree(8, two_nodes) == 4 and cost.default_degree(6) == 3 and cost.default_degree(5) is None


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss", "deepseek_v3"])
def test_model_family_matches_unpacked_eager_at_cp4(pools, name):
    """A family (4 query / 2 K/V heads: one K/V head per member of a 2-rank head group), both layouts.

    Llama is plain causal; Gemma 2 mixes soft-cap with sliding and full layers, gpt-oss sinks with sliding
    layers, and DeepSeek-V3 has MLA's value heads narrower than its query/key heads (``Dv != D``).
    """
    cases = (("contiguous", "ulysses+halo"), ("balanced", "ulysses+a2a"))
    results = pools.get(4).run_ok(cp_run, name, cases, timeout=240)
    failures = [p for found in family_problems(name, results, cases).values() for p in found]
    failures += [f"path {r[i]['path']}" for r in results for i in range(2) if r[i]["path"] != cases[i][1]]
    assert not failures, "\n".join(map(str, failures))


def _subgroups_of_fresh_groups() -> list[tuple[float | None, bool]]:
    """Pool task: sub-groups for two fresh CP groups of the same ranks (the second after the first is gone)."""
    from datetime import timedelta

    import torch.distributed as dist

    seen = []
    for seconds in (7, 11):
        group = dist.new_group(timeout=timedelta(seconds=seconds))
        groups = hybrid.build_groups(group, dist.get_rank(), 2, None)
        again = hybrid.build_groups(group, dist.get_rank(), 2, None)
        timeouts = {hybrid.group_timeout(g) for g in (groups.head_group, groups.sequence_group)}
        same = again.head_group is groups.head_group
        seen.append((timeouts.pop().total_seconds() if len(timeouts) == 1 else None, same))
        dist.destroy_process_group(group)
    return seen


def test_sub_groups_belong_to_their_cp_group_and_share_its_timeout(pools):
    """A new CP group of the same ranks gets new sub-groups (not a destroyed group's), each with its timeout."""
    results = pools.get(4).run_ok(_subgroups_of_fresh_groups, timeout=90)
    assert results == [[(7.0, True), (11.0, True)]] * 4, results

"""Shard plans: contiguous and balanced layouts, balance, tiling, permutation and exact lower bounds."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest
import torch

from nemo_automodel.components.distributed.blockdiag_cp.exchange import compute_kv_plan
from nemo_automodel.components.distributed.blockdiag_cp.layout import (
    doc_runs_from_lengths,
    make_shard_plan,
    pair_count,
)
from nemo_automodel.components.distributed.blockdiag_cp.metadata import build_window_plan
from nemo_automodel.testing.workloads import sft_mix

FAMILIES = {
    "single_document": lambda total, shard: [total],
    "sft_mix": lambda total, shard: sft_mix(total, shard, shortest=4, lead=shard + shard // 2),
    "uniform_short": lambda total, shard: [64] * (total // 64),
}


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("total", [32768, 131072])
def test_balanced_layout_balances_attention_work(cp, family, total):
    lengths = FAMILIES[family](total, total // cp)
    runs = doc_runs_from_lengths(lengths, total)
    if family == "sft_mix":
        assert max(lengths) > total // cp
    start = time.perf_counter()
    balanced = make_shard_plan(runs, cp, "balanced")
    elapsed = time.perf_counter() - start
    assert balanced.balance <= 1.05, (family, cp, balanced.balance)
    assert elapsed < 0.5  # decided per step on the host: must stay negligible
    if family == "single_document":  # the contiguous layout's known imbalance
        assert make_shard_plan(runs, cp, "contiguous").balance == pytest.approx(2 - 1 / cp, rel=1e-3)


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("seed", range(5))
def test_plans_tile_every_document_and_permute_every_token(layout, seed):
    rng = random.Random(seed)
    cp = rng.choice([2, 3, 4, 8])
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 30))]
    total = sum(lengths) + rng.randint(0, 40)
    total += (-total) % (2 * cp)
    plan = make_shard_plan(doc_runs_from_lengths(lengths, total), cp, layout)
    assert sorted(plan.permutation.tolist()) == list(range(total))
    assert sum(plan.rank_work) == sum(pair_count(0, n) for n in lengths)
    for rank, seg in enumerate(plan.all_segments):
        rows = plan.permutation[rank * plan.local_len : (rank + 1) * plan.local_len]
        assert (rows[seg.n_real :] >= sum(lengths)).all()  # each rank's padding comes last
        assert seg.kv_len == sum(seg.k_lens) and all(k >= q for q, k in zip(seg.q_lens, seg.k_lens))
    if layout == "contiguous":
        assert torch.equal(plan.permutation, torch.arange(total))


@pytest.mark.parametrize("seed", range(40))
def test_balanced_ranks_hold_their_attention_groups_as_contiguous_rows(seed):
    """Local-key pieces come first and adjacent pieces of a document are one: no row gather or scatter."""
    rng = random.Random(seed)
    cp = rng.choice([2, 3, 4, 8])
    lengths = [rng.randint(1, 3000) for _ in range(rng.randint(1, 12))]
    total = sum(lengths) + rng.randint(0, 40)
    total += (-total) % (2 * cp)
    plan = make_shard_plan(doc_runs_from_lengths(lengths, total), cp, "balanced")
    for rank, pieces in enumerate(plan.pieces):
        ends = {(p.doc, p.stop) for p in pieces}
        assert not any((p.doc, p.start) in ends for p in pieces), pieces  # consecutive pieces are one
        window_plan = build_window_plan(plan, rank, None, "cpu")
        assert window_plan.merge_index is None, (rank, pieces)
        assert all(isinstance(group.rows, tuple) for group in window_plan.groups)


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_needed_only_plan_receives_exactly_the_lower_bound(layout):
    rng = random.Random(7)
    for _ in range(20):
        cp = rng.choice([2, 4, 8])
        lengths = [rng.randint(1, 500) for _ in range(rng.randint(1, 12))]
        total = sum(lengths) + (-sum(lengths)) % (2 * cp)
        plan = make_shard_plan(doc_runs_from_lengths(lengths, total), cp, layout)
        kv = compute_kv_plan(plan)
        assert [kv.remote_tokens(r) for r in range(cp)] == [s.remote_kv_tokens for s in plan.all_segments]


def test_planner_cli_prints_every_layout_and_exchange(tmp_path):
    module = "nemo_automodel.components.distributed.blockdiag_cp.plan"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            module,
            "--cp",
            "4",
            "--seq-len",
            "8192",
            "--doc-lens",
            "5000,2000,700,300",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    table = [line for line in run.stdout.splitlines() if line.startswith("| contiguous") or line.startswith("| bal")]
    assert {tuple(c.strip() for c in line.split("|")[1:3]) for line in table} >= {
        ("contiguous", "allgather"),
        ("balanced", "allgather"),
        ("balanced", "a2a"),
    }
    assert sum("<-" in line for line in table) == 1  # layout=auto + kv_exchange=auto: one pick
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(f'{{"text": "{"x" * n}"}}\n' for n in (900, 3000, 150, 40, 2500, 600)))
    run = subprocess.run(
        [sys.executable, "-m", "nemo_automodel.recipes.plan", "--cp", "2", "--seq-len", "4096", "--data", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "rows=2" in run.stdout and "| balanced |" in run.stdout

"""One rank configured differently: every rank raises the same error at the step's first CP call, computing nothing."""

from __future__ import annotations

import re

import pytest

from nemo_automodel.testing.reference import doc_ids_from_lengths
from tests.faults import figures
from tests.faults.trials import LOCAL, Trial, run_trials

KNOBS = {"kv_exchange": "halo", "attn_backend": "sdpa_varlen", "layout": "contiguous"}


def _differences(cp: int) -> list[tuple[str, dict]]:
    """``(field the error must name, the odd rank's override)`` for every kind of disagreement."""
    total = cp * LOCAL
    return [
        ("kv_exchange", {"kv_exchange": "a2a"}),
        ("attn_backend", {"attn_backend": "dense"}),
        ("layout", {"layout": "balanced"}),
        ("sequence length", {"doc_ids": doc_ids_from_lengths([LOCAL + 3, total - LOCAL], total + 2 * cp)}),
        ("document layout", {"doc_ids": doc_ids_from_lengths([LOCAL + 4, total - LOCAL - 4], total)}),
    ]


@pytest.mark.parametrize(("cp", "odd"), [(2, 1), (3, 0), (3, 1)])
def test_a_rank_that_disagrees_makes_every_rank_raise_the_same_error(pools, cp, odd):
    ids = doc_ids_from_lengths([LOCAL + 3, cp * LOCAL - LOCAL - 3], cp * LOCAL)
    cases = _differences(cp)
    trials = [Trial(ids, KNOBS, layers=2, seed=i, per_rank={odd: override}) for i, (_, override) in enumerate(cases)]
    per_rank = pools.get(cp).run_ok(run_trials, trials, timeout=120)
    agree = [[r for r in range(cp) if r != odd], [odd]]
    for i, (field, _) in enumerate(cases):
        outcomes = [rank_outcomes[i] for rank_outcomes in per_rank]
        heads = {re.sub(r"; this rank has.*", "", o.error or "") for o in outcomes}
        assert len(heads) == 1, f"{field}: ranks raised different errors: {heads}"
        (head,) = heads
        assert head.startswith("block-diagonal CP ranks disagree on ") and field in head, head
        assert f"rank groups that agree: {sorted(agree)}" in head, head
        assert all(o.error_type == "RuntimeError" and o.in_step for o in outcomes)
        assert all(o.kernel_calls == 0 for o in outcomes), f"{field}: a kernel ran before the disagreement was found"
        figures.record("disagreement (one rank differs)", [max(o.raised_at for o in outcomes) - outcomes[0].started_at])


def test_ranks_that_agree_run_the_same_trials_cleanly(pools):
    """The disagreement test is not vacuous: without the override the same trials compute and raise nothing."""
    ids = doc_ids_from_lengths([LOCAL + 3, LOCAL - 3], 2 * LOCAL)
    per_rank = pools.get(2).run_ok(run_trials, [Trial(ids, KNOBS, layers=2, seed=0)], timeout=60)
    assert all(o[0].error is None and o[0].kernel_calls > 0 for o in per_rank)

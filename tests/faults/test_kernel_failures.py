"""A kernel failure on one rank, forward or backward, makes every rank raise an error naming it: never a hang."""

from __future__ import annotations

import pytest

from nemo_automodel.testing.reference import doc_ids_from_lengths
from tests.faults import figures
from tests.faults.injection import Fault
from tests.faults.trials import Outcome, Trial, kernel_fault_trials, run_trials

# Trials per CP size: each cycles through every exchange x fault type (16 combinations), the rest random.
TRIALS = {2: 32, 3: 32, 4: 32}
# What the failing rank's own message must carry, per fault kind.
DIAGNOSTIC = {"raise": "injected", "no_output": "kernel returned no output", "bad_grad": "invalid gradient"}


def _problems(trial: Trial, outcomes: list[Outcome]) -> list[str]:
    """Why the ranks' outcomes of one trial are wrong (empty when every rank raised the named error in step)."""
    fault = trial.fault
    named = f"{fault.phase} failed on CP rank(s) [{fault.rank}]"
    problems = []
    if outcomes[fault.rank].fired_at is None:
        problems.append("the fault never fired")
    for rank, out in enumerate(outcomes):
        if out.error_type != "RuntimeError" or named not in (out.error or ""):
            problems.append(f"rank {rank} raised {out.error_type}: {out.error!r}, expected {named!r}")
        if not out.in_step:
            problems.append(f"rank {rank}'s group is out of step after the failure")
    if DIAGNOSTIC[fault.kind] not in (outcomes[fault.rank].error or ""):
        problems.append(f"the failing rank's error lacks its own diagnostic {DIAGNOSTIC[fault.kind]!r}")
    return [f"{trial.label}: {p}" for p in problems]


def _time_to_failure(trial: Trial, outcomes: list[Outcome]) -> float:
    """Seconds from the fault firing to the last rank raising."""
    return max(o.raised_at for o in outcomes) - outcomes[trial.fault.rank].fired_at


@pytest.mark.parametrize("cp", sorted(TRIALS))
def test_random_kernel_failures_make_every_rank_raise_naming_the_rank(pools, cp):
    trials = kernel_fault_trials(cp, TRIALS[cp], seed=cp)
    per_rank = pools.get(cp).run_ok(run_trials, trials, timeout=240)  # a hang fails here (HangError)
    results = [[outcomes[i] for outcomes in per_rank] for i in range(len(trials))]
    problems = [p for trial, outcomes in zip(trials, results) for p in _problems(trial, outcomes)]
    assert not problems, "\n".join(problems)
    for trial, outcomes in zip(trials, results):
        figures.record(f"kernel {trial.fault.label} (cp 2-4)", [_time_to_failure(trial, outcomes)])


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_kernel_failures_inside_a_ulysses_step_make_every_rank_raise(pools, cp):
    """Head-parallel CP: the failing rank's zeros travel through both all-to-alls, and every rank raises."""
    trials = kernel_fault_trials(cp, 8, seed=50 + cp, exchanges=("ulysses",))
    per_rank = pools.get(cp).run_ok(run_trials, trials, timeout=240)  # a hang fails here (HangError)
    results = [[outcomes[i] for outcomes in per_rank] for i in range(len(trials))]
    problems = [p for trial, outcomes in zip(trials, results) for p in _problems(trial, outcomes)]
    assert not problems, "\n".join(problems)


def test_a_clean_trial_passes_the_same_checks_only_because_nothing_failed(pools):
    """The judge is not vacuous: the same trial without a fault raises nothing and runs every kernel."""
    trial = kernel_fault_trials(2, 1, seed=99)[0]
    clean = Trial(trial.doc_ids, trial.knobs, trial.layers, trial.seed)
    outcomes = pools.get(2).run_ok(run_trials, [clean], timeout=120)
    assert all(o[0].error is None and o[0].kernel_calls > 0 and o[0].in_step for o in outcomes)
    assert _problems(trial, [o[0] for o in outcomes])  # judged as a fault trial, a clean run fails the checks


def test_unguarded_checkpointed_backward_failure_raises_on_its_rank_and_peers_time_out(pools):
    """Under non-reentrant activation checkpointing the core cannot guard a backward kernel (saved-tensor hooks).

    What remains at the core level: the failing rank raises its own error at once, its peers
    block in the layer's reverse exchange until the group's timeout. The recipe turns this into a
    named error on every rank within moments (tests/faults/test_recipe_faults.py).
    """
    timeout_s = 3.0
    ids = doc_ids_from_lengths([20, 9, 3], 32)
    knobs = {"kv_exchange": "halo", "attn_backend": "sdpa_varlen", "layout": "contiguous"}
    fault = Fault(rank=1, layer=1, phase="backward", kind="raise")
    trial = Trial(ids, knobs, layers=3, seed=7, fault=fault, checkpointed=True)
    (failing,), (peer,) = reversed(pools.get(2).run_ok(run_trials, [trial], timeout_s, timeout=60))
    pools.ensure_healthy(2)
    assert failing.error == "injected backward failure on rank 1", failing.error
    assert failing.raised_at - failing.fired_at < 1.0
    assert peer.error_type == "RuntimeError" and "Timed out" in peer.error, peer.error
    waited = peer.raised_at - failing.fired_at
    assert timeout_s - 0.5 < waited < timeout_s + 5, waited
    figures.record("checkpointed backward raise, core only (group timeout 3 s)", [waited])

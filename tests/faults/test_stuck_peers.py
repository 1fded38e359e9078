"""A collective that never completes: the survivors fail within the process-group timeout instead of hanging.

Recipe-level runs (a stuck and a SIGKILLed worker under ``python recipes/finetune.py``)
are in ``test_recipe_faults.py``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.parallel import build_meshes, resolve_topology
from nemo_automodel.testing.reference import doc_ids_from_lengths
from tests.faults import figures
from tests.faults.injection import Fault
from tests.faults.trials import LOCAL, Trial, run_trials

TIMEOUT_S = 3.0


def test_a_stuck_rank_makes_its_peers_fail_within_the_group_timeout(pools):
    stall = TIMEOUT_S + 2
    ids = doc_ids_from_lengths([LOCAL + 5, LOCAL - 5], 2 * LOCAL)
    knobs = {"kv_exchange": "halo", "attn_backend": "sdpa_varlen", "layout": "contiguous"}
    fault = Fault(rank=1, layer=1, phase="forward", kind="sleep", sleep_s=stall)
    trial = Trial(ids, knobs, layers=3, seed=1, fault=fault)
    (survivor,), (stuck,) = pools.get(2).run_ok(run_trials, [trial], TIMEOUT_S, timeout=60)
    pools.ensure_healthy(2)
    waited = survivor.raised_at - stuck.fired_at
    assert survivor.error_type == "RuntimeError" and "Timed out" in survivor.error, survivor.error
    assert TIMEOUT_S - 0.5 < waited < TIMEOUT_S + 3, waited
    assert stuck.error_type == "RuntimeError", "the stuck rank, once awake, finds its group broken"
    figures.record(f"stuck peer, CP group (timeout {TIMEOUT_S:.0f} s)", [waited])


def _cp_collective_with_a_sleeping_peer(timeout_s: float, sleeper: int, stall_s: float) -> tuple[str | None, float]:
    """Pool worker (world 4 = dp 2 x cp 2): the recipe's meshes; ``sleeper`` stalls, the others all-reduce over CP."""
    rank = dist.get_rank()
    meshes = build_meshes(resolve_topology(4, rank, rank, 2, None), torch.device("cpu"), timeout_s)
    if rank == sleeper:
        time.sleep(stall_s)
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=meshes.cp.get_group())
    except RuntimeError as exc:
        return str(exc), time.monotonic() - began
    return None, time.monotonic() - began


def test_recipe_meshes_apply_the_configured_timeout_to_every_group(pools):
    """``init_device_mesh`` gives dp/cp sub-groups torch's 30-minute default; ``build_meshes`` must not."""
    stall = TIMEOUT_S + 3
    results = pools.get(4).run_ok(_cp_collective_with_a_sleeping_peer, TIMEOUT_S, 1, stall, timeout=90)
    pools.ensure_healthy(4)
    (error0, waited0), _, (error2, _), (error3, _) = results
    assert error0 is not None and "Timed out" in error0, f"rank 0 waited {waited0:.1f}s for its stuck CP peer"
    assert waited0 < TIMEOUT_S + 2, waited0
    assert error2 is None and error3 is None, "the other CP group is unaffected"
    figures.record(f"stuck peer, recipe CP sub-group with dp=2 (timeout {TIMEOUT_S:.0f} s)", [waited0])

"""Two-node jobs on the live cluster: a CP group across nodes, and a node whose workers die.

The nodes are network namespaces with their own hostnames (``tests/slurm/cluster.py``), so
what the code learns about placement comes from real hostnames, as on a real cluster. To
keep the suite short, one cp=4 job serves two tests: it trains a few steps across the two
nodes (cross-node CP, default settings), then every worker of one node is SIGKILLed.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from tests.dist_pool import PoolCache
from tests.recipe_helpers import TINY_OVERRIDES
from tests.slurm import jobs
from tests.slurm.cluster import Cluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]

RECIPE = "recipes/finetune.py"
JOB_TIMEOUT_S = 240
STEPS = 8
# optim.decay_steps pins the LR schedule, so a longer run repeats these steps exactly
CP4_SCHEDULE = ["+cp=blockdiag", "cp.size=4", f"optim.decay_steps={STEPS}", "trainer.log_every=1", *TINY_OVERRIDES]
CP4 = [*CP4_SCHEDULE, f"trainer.max_steps={STEPS}"]
STEPS_BEFORE_KILL = 4
PG_TIMEOUT_S = 30
XNODE_DISABLED = "needed-only K/V exchange disabled"
XNODE_ALLOWED = "NEMO_CP_ALLOW_XNODE=1 keeps needed-only K/V exchanges across nodes"
CP_GROUP_ACROSS_NODES = re.compile(r"cp group 0: ranks 0,1 on (node\d); ranks 2,3 on (?!\1)node\d$", re.MULTILINE)
STEP_PATH = re.compile(r"step \d+ \|.*\| kv (?P<path>[\w+]+) recv")
HOSTS = re.compile(
    r"hosts: ranks (?P<first>[\d,]+) on (?P<first_host>\S+); ranks (?P<second>[\d,]+) on (?P<second_host>\S+)$",
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def cp4_one_node(pools: PoolCache, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """cp=4 on one machine: the losses every cross-node run must reproduce."""
    return jobs.one_node_losses(pools, 4, CP4, tmp_path_factory.mktemp("cp4-one-node"))


def step_paths(log: str) -> set[str]:
    return {m["path"] for m in map(STEP_PATH.search, log.splitlines()) if m}


def xnode_reasons(log: str, reason: str) -> int:
    return sum(reason in line for line in log.splitlines())


def worker_pids(cluster: Cluster, node: str) -> list[int]:
    """The recipe's worker processes on ``node`` (not its torchrun agent)."""
    pids = []
    for pid in cluster.node_pids(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(arg.endswith(RECIPE) for arg in argv) and "torch.distributed.run" not in argv:
            pids.append(pid)
    return pids


@dataclass(frozen=True)
class KilledRun:
    """A cp=4 job across both nodes: what it logged and trained before ``node``'s workers were SIGKILLed."""

    job: jobs.Job
    log_before: str
    losses_before: dict[int, float]
    node: str
    lost: list[int]
    killed_at: datetime
    exit_code: int

    def log(self) -> str:
        return self.job.log()


@pytest.fixture(scope="module")
def cp4_killed(slurm_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> KilledRun:
    overrides = [*CP4_SCHEDULE, "trainer.max_steps=1000", f"dist.pg_timeout_s={PG_TIMEOUT_S}"]
    job = jobs.submit(slurm_cluster, tmp_path_factory.mktemp("cp4-killed"), "cp4-kill", RECIPE, overrides, nodes=2)
    enough = STEPS_BEFORE_KILL
    jobs.wait_until(lambda: len(job.steps_logged()) >= enough or job.finished(), JOB_TIMEOUT_S, "training", job)
    log = job.log()
    assert not job.finished(), log
    placed = HOSTS.search(log)
    assert placed is not None, log
    # the node without rank 0, whose survivors log with timestamps
    first_has_rank_0 = "0" in placed["first"].split(",")
    node, lost = (
        (placed["second_host"], placed["second"]) if first_has_rank_0 else (placed["first_host"], placed["first"])
    )
    workers = worker_pids(slurm_cluster, node)
    assert len(workers) == jobs.WORKERS_PER_NODE, f"workers on {node}: {workers}"
    losses = job.losses()
    killed_at = datetime.now()
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    exit_code = job.wait(JOB_TIMEOUT_S)
    return KilledRun(job, log, losses, node, [int(r) for r in lost.split(",")], killed_at, exit_code)


def test_cp_group_across_nodes_is_detected_from_hostnames_and_trains_like_one_node(
    cp4_killed: KilledRun, cp4_one_node: dict[int, float]
) -> None:
    log = cp4_killed.log_before
    assert CP_GROUP_ACROSS_NODES.search(log), log
    assert xnode_reasons(log, XNODE_DISABLED) == 4, log  # once per process (4 ranks), never per step
    # only collectives cross nodes: all-gather, or heads inside a node x all-gather between nodes
    assert step_paths(log) and step_paths(log) <= {"allgather", "ulysses", "ulysses+allgather"}, log
    # these sum the attention in another order than one machine's needed-only paths: equal to rounding
    steps = sorted(cp4_killed.losses_before)[:STEPS_BEFORE_KILL]
    assert steps == list(range(1, STEPS_BEFORE_KILL + 1)), cp4_killed.losses_before
    got = {step: cp4_killed.losses_before[step] for step in steps}
    assert got == pytest.approx({step: cp4_one_node[step] for step in steps}, rel=1e-6, abs=0)


def test_needed_only_across_nodes_when_allowed_trains_like_one_node(
    slurm_cluster: Cluster, cp4_one_node: dict[int, float], tmp_path: Path
) -> None:
    job = jobs.submit(slurm_cluster, tmp_path, "cp4", RECIPE, CP4, nodes=2, env={"NEMO_CP_ALLOW_XNODE": "1"})
    assert job.wait(JOB_TIMEOUT_S) == 0, job.log()
    log = job.log()
    assert CP_GROUP_ACROSS_NODES.search(log), log
    assert xnode_reasons(log, XNODE_ALLOWED) == 4 and XNODE_DISABLED not in log, log
    # point-to-point K/V between nodes: needed-only paths, or heads inside a node x needed-only between nodes
    needed_only = step_paths(log) - {"ulysses+allgather"}
    assert needed_only and needed_only <= {"halo", "a2a", "ulysses+halo", "ulysses+a2a"}, log
    # the inter-node link makes the hybrid cheaper than one machine's picks: the same model, summed in another order
    assert job.losses() == pytest.approx(cp4_one_node, rel=1e-6, abs=0)


def test_sigkill_of_every_worker_on_one_node_fails_the_job_and_survivors_name_the_lost_ranks(
    cp4_killed: KilledRun,
) -> None:
    log = cp4_killed.log()
    assert cp4_killed.exit_code != 0, log
    lost = ", ".join(map(str, cp4_killed.lost))
    named = f"training failed on rank(s) [{lost}]: rank {cp4_killed.lost[0]}: lost without a report"
    survivors = [r for r in range(2 * jobs.WORKERS_PER_NODE) if r not in cp4_killed.lost]
    for rank in survivors:  # each survivor names the lost ranks and their host
        said = [line for line in log.splitlines() if named in line and f"Rank {rank} stopped" in line]
        assert said and f"the connection to {cp4_killed.node} (" in said[0], f"rank {rank} named no one:\n{log}"
    stamped = [line for line in log.splitlines() if named in line and "Rank 0 stopped" in line and line[:1] == "["]
    stamp = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]", stamped[0] if stamped else "")
    assert stamp is not None, log
    delay_s = (datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f") - cp4_killed.killed_at).total_seconds()
    assert delay_s < PG_TIMEOUT_S, f"named {delay_s:.1f}s after the kill, beyond dist.pg_timeout_s={PG_TIMEOUT_S}"
    print(
        f"SIGKILL of {cp4_killed.node}'s workers: named by rank 0 after {delay_s:.2f}s, job exit {cp4_killed.exit_code}"
    )

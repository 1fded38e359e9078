"""The test harness leaves the machine as it found it: no daemon, job process, namespace, link or directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.slurm import cluster as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("nodes", [1, 2])
def test_stop_ends_the_daemons_and_jobs_it_started_and_removes_its_directory(slurm_installed: None, nodes: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="slurm-test-"))
    cluster = slurm.start(root, nodes)
    network = cluster.network()
    try:
        daemons = cluster.status()
        assert len(daemons) == 2 + nodes and all(daemons.values()), f"not every daemon is running: {daemons}"
        if nodes > 1:
            # one job step per node: each answers with its own hostname and address, from its own namespace
            shown = cluster.run("srun", f"--nodes={nodes}", "--ntasks-per-node=1", "hostname", "-i").stdout.split()
            assert sorted(shown) == sorted(node.address for node in network.nodes), shown
            names = cluster.run("srun", f"--nodes={nodes}", "--ntasks-per-node=1", "hostname").stdout.split()
            assert sorted(names) == [f"node{i}" for i in range(1, nodes + 1)], names
        job = cluster.run(
            "sbatch", "--parsable", f"--nodes={nodes}", "--output=/dev/null", "--wrap=srun sleep 600"
        ).stdout.strip()
        job_pids: list[int] = []

        def job_running() -> bool:
            if network is None:  # scontrol listpids asks the slurmd of the machine it runs on
                listed = cluster.run("scontrol", "listpids", job, check=False).stdout.splitlines()[1:]
                job_pids[:] = [int(row.split()[0]) for row in listed if row.split() and row.split()[0].isdigit()]
                return bool(job_pids)
            # every process inside the nodes' namespaces: slurmd, the job's steps and its sleeps
            job_pids[:] = [pid for node in network.nodes for pid in cluster.node_pids(node.name)]
            steps = cluster.run("squeue", "--noheader", "--steps", f"--jobs={job}", check=False).stdout.split("\n")
            return sum(f"{job}.0" in step for step in steps) == 1 and len(job_pids) > 2 * nodes

        slurm.wait_for(job_running, 60, f"job {job} to start")
    finally:
        slurm.stop(cluster)
    assert not root.exists()
    assert not [pid for pid in [*daemons.values(), *job_pids] if pid is not None and pid_alive(pid)]
    if network is not None:
        assert not [node.netns for node in network.nodes if (slurm.NETNS_DIR / node.netns).exists()]
        assert not set(network.links()) & slurm.link_names()

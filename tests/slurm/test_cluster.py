"""The test harness leaves the machine as it found it: no daemon, no job process, no directory."""

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


def test_stop_ends_the_daemons_and_jobs_it_started_and_removes_its_directory(slurm_installed: None) -> None:
    root = Path(tempfile.mkdtemp(prefix="slurm-test-"))
    cluster = slurm.start(root)
    try:
        daemons = cluster.status()
        assert all(daemons.values()), f"not every daemon is running: {daemons}"
        job = cluster.run("sbatch", "--parsable", "--output=/dev/null", "--wrap=sleep 600").stdout.strip()
        job_pids: list[int] = []

        def job_running() -> bool:
            listed = cluster.run("scontrol", "listpids", job, check=False).stdout.splitlines()[1:]
            job_pids[:] = [int(line.split()[0]) for line in listed if line.split() and line.split()[0].isdigit()]
            return bool(job_pids)

        slurm.wait_for(job_running, 60, f"job {job} to start")
    finally:
        slurm.stop(cluster)
    assert not root.exists()
    assert not [pid for pid in [*daemons.values(), *job_pids] if pid is not None and pid_alive(pid)]

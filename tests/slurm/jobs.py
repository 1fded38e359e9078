"""Submitting ``recipes/slurm/finetune.sbatch`` to the test cluster and reading what a job left."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir

from nemo_automodel.components.config.schema import register_schema, to_finetune_config, to_plain_dict
from tests.dist_pool import PoolCache
from tests.recipe_helpers import train_in_pool
from tests.slurm.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "recipes" / "slurm" / "finetune.sbatch"
SUBMITTED = re.compile(r"Submitted batch job (\d+)")
WORKERS_PER_NODE = 2


@dataclass
class Job:
    """A job submitted with ``sbatch --wait``; ``waiter`` is that sbatch, alive until the job ends."""

    id: int
    name: str
    waiter: subprocess.Popen[str]
    log_dir: Path
    run_dir: Path

    def wait(self, timeout_s: float) -> int:
        """The job's exit code, as ``sbatch --wait`` reports it."""
        try:
            return self.waiter.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.waiter.kill()
            raise

    def finished(self) -> bool:
        return self.waiter.poll() is not None

    def log(self) -> str:
        """Everything the job printed: the batch script, torchrun and the workers, over all runs."""
        parts = [path.read_text(errors="replace") for path in sorted(self.log_dir.glob(f"{self.name}-{self.id}.*"))]
        return "\n".join(parts)

    def losses(self) -> dict[int, float]:
        """Loss by step from the run's metrics.jsonl; a step logged again after a resume keeps its last value."""
        path = self.run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return {record["step"]: record["loss"] for record in records if "loss" in record}

    def steps_logged(self) -> list[int]:
        """Every step of metrics.jsonl in file order, repeats included (they show a restart)."""
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [record["step"] for record in map(json.loads, lines) if "loss" in record]


def submit(
    cluster: Cluster,
    work_dir: Path,
    name: str,
    recipe: str,
    overrides: list[str],
    nodes: int = 1,
    env: dict[str, str] | None = None,
) -> Job:
    """``sbatch --wait`` the real sbatch script from the repository root, as a user would, on CPU.

    ``nodes`` nodes with 2 workers each (``NPROC_PER_NODE``); ``env`` adds to the job's environment.
    """
    log_dir = work_dir / "logs"
    run_root = work_dir / "runs"
    log_dir.mkdir(parents=True, exist_ok=True)
    job_env = {
        **cluster.env(),
        "RECIPE": recipe,
        "RUN_ROOT": str(run_root),
        "NPROC_PER_NODE": str(WORKERS_PER_NODE),
        "PYTHON": sys.executable,
        **(env or {}),
    }
    command = [
        "sbatch",
        "--wait",
        f"--job-name={name}",
        f"--nodes={nodes}",
        "--gpus-per-node=0",  # the test nodes have no GPUs: the CPU-only path, on gloo
        f"--output={log_dir}/%x-%j.out",
        f"--error={log_dir}/%x-%j.err",
        str(SBATCH_SCRIPT),
        *overrides,
    ]
    waiter = subprocess.Popen(command, cwd=REPO, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert waiter.stdout is not None
    submitted = SUBMITTED.search(waiter.stdout.readline())
    if submitted is None:
        waiter.wait(timeout=30)
        raise AssertionError(f"sbatch did not submit: {waiter.stderr.read() if waiter.stderr else ''}")
    job_id = int(submitted.group(1))
    return Job(job_id, name, waiter, log_dir, run_root / f"{name}-{job_id}")


def job_fields(cluster: Cluster, job: Job) -> dict[str, str]:
    """``scontrol show job`` as a dict (empty once the job record is gone)."""
    shown = cluster.run("scontrol", "--oneliner", "show", "job", str(job.id), check=False).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, job: Job) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; job log:\n{job.log()}")
        time.sleep(0.2)


def one_node_losses(pools: PoolCache, world: int, overrides: list[str], run_dir: Path) -> dict[int, float]:
    """The losses of the same recipe config trained on one machine by a ``world``-rank gloo pool (the reference)."""
    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        config = to_finetune_config(compose(config_name="finetune", overrides=overrides))
    return pools.get(world).run_ok(train_in_pool, to_plain_dict(config), str(run_dir), timeout=300)[0]["losses"]

"""How ``recipes/slurm/finetune.sbatch`` builds its launch, without Slurm.

The script runs under plain bash with a Slurm-like environment and stand-ins on PATH: ``srun``
records its arguments and runs the command it was given, ``scontrol`` lists the hosts, and the
"interpreter" records its arguments and whether it was started with SIGUSR1 ignored. What
pyxis, multi-node rendezvous and GPU nodes need is checked here; the live cluster covers the rest.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.slurm.jobs import SBATCH_SCRIPT

FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_OUT/srun.args"
while [[ $1 == --* ]]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && printf '%s\\n' $FAKE_HOSTS
"""
FAKE_PYTHON = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_OUT/python.args"
grep '^SigIgn:' /proc/self/status > "$FAKE_OUT/python.sigign"
"""
FAKE_NVIDIA_SMI = """#!/bin/bash
[[ -n $FAKE_GPUS ]] || exit 9
for ((i = 0; i < FAKE_GPUS; i++)); do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done
"""


@dataclass
class Launch:
    srun_args: list[str]
    python_args: list[str]
    python_ignores_usr1: bool
    output: str


class Launcher:
    """Runs the script with stand-ins: ``launcher(*overrides, **env)`` returns what it started."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.bin_dir = tmp_path / "bin"
        self.project = tmp_path / "project"
        self.run_root = tmp_path / "runs"
        self.out = tmp_path / "out"
        for directory in (self.bin_dir, self.project, self.out):
            directory.mkdir()
        stand_ins = {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, "nvidia-smi": FAKE_NVIDIA_SMI}
        for name, body in stand_ins.items():
            self._write_executable(self.bin_dir / name, body)
        self.python = self._write_executable(tmp_path / "fake-python", FAKE_PYTHON)

    @staticmethod
    def _write_executable(path: Path, body: str) -> Path:
        path.write_text(body)
        path.chmod(0o755)
        return path

    def __call__(self, *overrides: str, **env: str) -> Launch:
        slurm_env = {
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ['PATH']}",
            "FAKE_OUT": str(self.out),
            "FAKE_HOSTS": "node-a",
            "FAKE_GPUS": "",
            "PYTHON": str(self.python),
            "RUN_ROOT": str(self.run_root),
            "SLURM_JOB_ID": "1234",
            "SLURM_JOB_NAME": "ft",
            "SLURM_SUBMIT_DIR": str(self.project),
            "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": "node-a",
            "SLURM_CPUS_ON_NODE": "4",
        }
        done = subprocess.run(
            ["bash", str(SBATCH_SCRIPT), *overrides],
            env={**slurm_env, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        ignored = int((self.out / "python.sigign").read_text().split()[1], 16)
        return Launch(
            srun_args=(self.out / "srun.args").read_text().split("\0")[:-1],
            python_args=(self.out / "python.args").read_text().split("\0")[:-1],
            python_ignores_usr1=bool(ignored & (1 << (signal.SIGUSR1 - 1))),
            output=done.stdout,
        )


@pytest.fixture
def launch(tmp_path: Path) -> Launcher:
    return Launcher(tmp_path)


def option(args: list[str], name: str) -> str | None:
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"{name}=")]
    return values[-1] if values else None


def test_overrides_reach_the_recipe_after_the_run_dir_and_resume(launch: Launcher) -> None:
    started = launch("+cp=blockdiag", "cp.size=8", "trainer.max_steps=1000")
    run_dir = launch.run_root / "ft-1234"
    assert started.python_args[-6:] == [
        "recipes/finetune.py",
        f"hydra.run.dir={run_dir}",
        "trainer.resume=auto",
        "+cp=blockdiag",
        "cp.size=8",
        "trainer.max_steps=1000",
    ]
    assert run_dir.is_dir()


def test_one_launcher_per_node_rendezvous_at_the_first_host(launch: Launcher) -> None:
    started = launch(FAKE_HOSTS="node-a node-b node-c", SLURM_NNODES="3", SLURM_JOB_NODELIST="node-[a-c]")
    assert option(started.srun_args, "--ntasks-per-node") == "1"
    assert started.python_args[:2] == ["-m", "torch.distributed.run"]
    assert option(started.python_args, "--nnodes") == "3"
    assert option(started.python_args, "--rdzv-backend") == "c10d"
    assert option(started.python_args, "--rdzv-endpoint") == f"node-a:{20000 + 1234}"
    assert option(started.python_args, "--rdzv-id") == "1234"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"NPROC_PER_NODE": "3", "SLURM_GPUS_ON_NODE": "8"}, "3"),
        ({"SLURM_GPUS_ON_NODE": "8"}, "8"),
        ({"FAKE_GPUS": "2"}, "2"),
        ({}, str(len(os.sched_getaffinity(0)))),
    ],
    ids=["env-var", "slurm-gpus", "unscheduled-gpus", "cpu-count"],
)
def test_workers_per_node_come_from_env_then_gpus_then_cpu_count(
    launch: Launcher, env: dict[str, str], expected: str
) -> None:
    assert option(launch(**env).python_args, "--nproc-per-node") == expected


def test_launcher_ignores_usr1_so_only_the_workers_act_on_it(launch: Launcher) -> None:
    assert launch().python_ignores_usr1


def test_without_container_image_no_pyxis_options(launch: Launcher) -> None:
    assert not [arg for arg in launch().srun_args if arg.startswith("--container")]


def test_container_image_runs_the_launch_through_pyxis_with_project_and_runs_mounted(launch: Launcher) -> None:
    started = launch(CONTAINER_IMAGE="nvcr.io/example/blockdiag-cp:1")
    project, runs = launch.project, launch.run_root
    assert option(started.srun_args, "--container-image") == "nvcr.io/example/blockdiag-cp:1"
    assert option(started.srun_args, "--container-mounts") == f"{project}:{project},{runs}:{runs}"
    assert option(started.srun_args, "--container-workdir") == str(project)


def test_container_mounts_can_be_replaced(launch: Launcher) -> None:
    started = launch(CONTAINER_IMAGE="img", CONTAINER_MOUNTS="/lustre:/lustre")
    assert option(started.srun_args, "--container-mounts") == "/lustre:/lustre"


def test_outside_slurm_the_script_refuses_to_run() -> None:
    done = subprocess.run(
        ["bash", str(SBATCH_SCRIPT)],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0
    assert "submit this script with sbatch" in done.stderr

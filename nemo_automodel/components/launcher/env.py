"""Detect how this process was started and derive the ``env://`` rendezvous variables.

- torchrun (or any launcher exporting ``RANK``/``WORLD_SIZE``): the environment is used as given.
- Slurm ``srun`` without torchrun (``SLURM_PROCID`` and ``SLURM_NTASKS > 1``): ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` come from ``SLURM_PROCID``,
  ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``; ``MASTER_ADDR`` is the first
  host of ``SLURM_JOB_NODELIST``; ``MASTER_PORT`` is ``dist.master_port`` or 29500.
- otherwise: local, the recipe starts its own workers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """``mode`` is ``torchrun``, ``slurm`` or ``local``; ``rank``/``world``/``local_rank`` as derived."""

    mode: str
    rank: int
    world: int
    local_rank: int


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``"gpu[003-005,009],cpu1"`` -> ``"gpu003"``; ``"a,b"`` -> ``"a"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read the first host")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _tasks_per_node(env: Mapping[str, str]) -> str:
    """``SLURM_NTASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``'s first count, e.g. ``"4(x2)"`` -> ``"4"``)."""
    value = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    return re.match(r"\d+", value).group(0)


def slurm_rendezvous_env(env: Mapping[str, str], master_port: int | None) -> dict[str, str]:
    """The torchrun-style variables for one ``srun`` task (see the module docstring)."""
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": _tasks_per_node(env),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_slurm_host(env["SLURM_JOB_NODELIST"]),
        "MASTER_PORT": env.get("MASTER_PORT") or str(master_port or DEFAULT_MASTER_PORT),
    }


def detect_launch(env: Mapping[str, str] | None = None, master_port: int | None = None) -> LaunchEnv:
    """How this process was started; for Slurm, the derived variables are exported into ``os.environ``."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        derived = slurm_rendezvous_env(env, master_port)
        os.environ.update(derived)
        return LaunchEnv("slurm", int(derived["RANK"]), int(derived["WORLD_SIZE"]), int(derived["LOCAL_RANK"]))
    return LaunchEnv("local", 0, 1, 0)


def is_secondary_rank(env: Mapping[str, str] | None = None) -> bool:
    """True in every launched process but global rank 0 (it must not create its own Hydra run dir)."""
    env = os.environ if env is None else env
    rank = env.get("RANK") or (env.get("SLURM_PROCID") if int(env.get("SLURM_NTASKS", "1")) > 1 else None)
    return rank is not None and int(rank) != 0


# Hydra overrides for ranks other than 0 under torchrun/srun: no run dir, no .hydra, log to stdout only
# (the workers agree on rank 0's run dir after joining the process group).
SECONDARY_RANK_HYDRA_OVERRIDES = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout")

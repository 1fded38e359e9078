"""Live-Slurm fixtures: Slurm installed (or a skip/CI failure), and one two-node cluster for the session.

The two nodes are network namespaces of this machine with their own hostnames (``node1``,
``node2``) and addresses (``tests/slurm/cluster.py``); single-node jobs run on one of them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm import cluster as slurm


def running_in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@pytest.fixture(scope="session")
def slurm_installed() -> None:
    reason = slurm.unavailable_reason()
    if reason is not None:
        # CI installs Slurm (.ci/run) and must exercise it: there, a missing cluster is a failure.
        if running_in_ci():
            pytest.fail(f"CI must run the live-Slurm tests, but: {reason}")
        pytest.skip(reason)


NODES = 2


@pytest.fixture(scope="session")
def slurm_cluster(slurm_installed: None) -> Iterator[slurm.Cluster]:
    cluster = slurm.start(Path(tempfile.mkdtemp(prefix="slurm-test-")), nodes=NODES)
    try:
        yield cluster
    finally:
        slurm.stop(cluster)

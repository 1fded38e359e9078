"""The project's image, built once per session on the local base (or a skip with the exact reason)."""

from __future__ import annotations

import os

import pytest

from tests.container import image as container

TEST_IMAGE = "localhost/blockdiag-cp:test"


def running_in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@pytest.fixture(scope="session")
def built_image() -> str:
    """The name of docker/Dockerfile built on the local base.

    The image stays until the next session's build replaces it (removing it would cost every
    session time; a CI machine is discarded anyway).
    """
    setup = container.setup_problem()
    if setup is not None:
        # CI runs as root with the package registries (.ci/run installs the tools): there, a build
        # that cannot even start is a failure, never a skip.
        if running_in_ci():
            pytest.fail(f"CI must build the image, but: {setup}")
        pytest.skip(setup)
    refused = container.namespaces_refused()
    if refused is not None:
        pytest.skip(refused)  # the one condition no setup can fix, in CI too
    timings = container.build(TEST_IMAGE)
    print(f"\nimage {TEST_IMAGE} built: {timings}")
    return TEST_IMAGE

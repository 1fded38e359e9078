"""docker/Dockerfile built with buildah on the local Debian base and run with podman.

The image trains (the recipe, cp=2, 3 steps), its pip environment is consistent, it holds every
pin of pyproject.toml's recipe extra and the base's CPU torch, it runs as uid 10001, and neither
the build nor the base left caches behind (pip, apt, bytecode or build output in the project).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.container import image as container
from tests.container.dockerfile import pyproject, recipe_requirements
from tests.recipe_helpers import read_losses

# The first test builds the image (minutes on 2 loaded cores); every step has its own timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * container.STEP_TIMEOUT_S)]

RECIPE_TIMEOUT_S = 600
PROJECT_IN_IMAGE = "/workspace/blockdiag-cp"
# Paths that hold only caches; in the image each must be absent or empty.
CACHE_DIRS = ("root/.cache", "home/trainer/.cache", "var/cache/apt/archives", "var/lib/apt/lists", "tmp", "mnt")
APT_BOOKKEEPING = {"lock", "partial"}  # apt's own lock file and download directory, not cached data


def in_image(image: str, script: str, timeout_s: float = 300) -> str:
    """Run a Python snippet in the image as its default user; its stdout.

    ``-P``: the working directory (the project's source copy) stays off ``sys.path``, so imports
    find what pip installed, as for ``python recipes/finetune.py``.
    """
    done = container.podman_run(image, "python", "-P", "-c", script, timeout_s=timeout_s)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_recipe_trains_in_the_image(built_image: str, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o777)  # the image's user (uid 10001) writes the run directory
    recipe = ["python", "recipes/finetune.py", "+cp=blockdiag", "trainer.max_steps=3", "hydra.run.dir=/runs/cp2"]
    done = container.podman_run(built_image, *recipe, options=("-v", f"{runs}:/runs"), timeout_s=RECIPE_TIMEOUT_S)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "block-diagonal CP: KV exchange path=" in log and "cp_size=2" in log, log[-4000:]
    losses = read_losses(runs / "cp2")
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(loss) for loss in losses.values()), losses
    written = {path.stat().st_uid for path in (runs / "cp2").rglob("*")}
    assert written == {10001}, f"files in the run directory belong to uids {written}, not the image's user"


def test_pip_check_finds_no_broken_requirement(built_image: str) -> None:
    done = container.podman_run(built_image, "python", "-m", "pip", "check", timeout_s=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_image_runs_as_uid_10001(built_image: str) -> None:
    user = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Config.User}}", built_image],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert user.stdout.strip() == "10001:10001", f"the image's user is {user.stdout.strip()!r} {user.stderr}"
    ids = json.loads(in_image(built_image, "import json, os; print(json.dumps([os.getuid(), os.getgid()]))"))
    assert ids == [10001, 10001]


def test_image_holds_the_pinned_versions(built_image: str) -> None:
    script = (
        "import importlib.metadata as m, importlib.util as u, json; "
        "print(json.dumps({'versions': {d.metadata['Name']: d.version for d in m.distributions()}, "
        "'package': u.find_spec('nemo_automodel').origin}))"
    )
    found = json.loads(in_image(built_image, script))
    versions = {canonicalize_name(name): version for name, version in found["versions"].items()}
    held = {
        str(requirement): versions.get(canonicalize_name(requirement.name)) for requirement in recipe_requirements()
    }
    wrong = {
        pin: version for pin, version in held.items() if version is None or version not in Requirement(pin).specifier
    }
    assert not wrong, f"pyproject.toml's recipe pins, and what the image holds instead (None: missing): {wrong}"
    assert versions["torch"] == container.TORCH.split("==")[1]  # the local CPU build, never a CUDA one
    # Installed as a package (pip install --no-deps .), not imported from the copied source tree.
    assert found["package"].startswith(container.SITE_PACKAGES), found["package"]
    project = pyproject()["project"]
    assert versions[canonicalize_name(project["name"])] == project["version"]


def cache_leftovers(root: Path) -> list[str]:
    """Cache files and build output in an image's root filesystem (paths relative to it)."""
    found = []
    for name in CACHE_DIRS:
        directory = root / name
        if directory.is_dir():
            found += [f"{name}/{entry.name}" for entry in directory.iterdir() if entry.name not in APT_BOOKKEEPING]
    project = root / PROJECT_IN_IMAGE.lstrip("/")
    found += [str(path.relative_to(root)) for path in project.rglob("__pycache__")]
    found += [str(path.relative_to(root)) for path in project.rglob("*.py[co]")]
    found += [str(path.relative_to(root)) for path in (project / "build", *project.glob("*.egg-info")) if path.exists()]
    return found


def test_image_holds_no_caches(built_image: str) -> None:
    with container.mounted(built_image) as root:
        assert (root / PROJECT_IN_IMAGE.lstrip("/") / "recipes" / "finetune.py").is_file()
        leftovers = cache_leftovers(root)
        assert not leftovers, f"caches or build output in the image: {leftovers[:20]} ({len(leftovers)} in all)"

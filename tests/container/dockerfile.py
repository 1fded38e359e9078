"""Read ``docker/Dockerfile`` and ``pyproject.toml``: instructions, pip installs, pins, base-image packages.

Shared by the static checks (``tests/test_docker.py``) and the local image build
(``tests.container.image``), so both see the same requirements.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
PYPROJECT = REPO / "pyproject.toml"
# What the base image provides and the Dockerfile must never replace (name prefixes, so split
# distributions such as transformer-engine-torch count too). numpy and tqdm are also pinned in
# pyproject.toml's recipe extra: in the image they are the base image's (README, Docker image).
BASE_IMAGE_PACKAGES = ("torch", "transformer-engine", "flash-attn", "numpy", "tqdm")
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
PIP_OPTIONS_WITH_VALUE = {"-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links"}
# Requirements read from elsewhere would escape the version check.
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


def installed_requirements(dockerfile: str) -> list[Requirement]:
    """Every requirement the Dockerfile's pip installs name (the project's own path excluded)."""
    return [requirement for install in pip_installs(dockerfile) for requirement in install.requirements]


def pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


def pyproject_requirements() -> list[Requirement]:
    """Every requirement pyproject.toml declares: the dependencies and all extras."""
    project = pyproject()["project"]
    declared = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        declared.extend(extra)
    return [Requirement(text) for text in declared]


def recipe_requirements() -> list[Requirement]:
    """The recipe extra: what the image must hold, at these exact versions."""
    return [Requirement(text) for text in pyproject()["project"]["optional-dependencies"]["recipe"]]


def is_base_image_package(name: str) -> bool:
    name = canonicalize_name(name)
    return any(name == package or name.startswith(f"{package}-") for package in BASE_IMAGE_PACKAGES)


def recipe_requirements_left_to_the_base() -> list[Requirement]:
    """Recipe pins the Dockerfile leaves to the base image (numpy, tqdm): a local base must carry them."""
    return [requirement for requirement in recipe_requirements() if is_base_image_package(requirement.name)]

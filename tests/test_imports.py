"""The package graph: layers (each imports only the layers below it) and no import cycles, checked by import-linter.

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``); CI runs them through this test.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys

import pytest

from tests.recipe_helpers import REPO

PACKAGE = REPO / "nemo_automodel"


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is in the test extra")
def test_the_import_contracts_hold():
    done = subprocess.run(["lint-imports"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_no_import_hides_inside_a_function():
    """An import of the package inside a function hides an edge from the graph (only TYPE_CHECKING blocks may)."""
    hidden = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for inner in ast.walk(node):
                    module = getattr(inner, "module", None) if isinstance(inner, ast.ImportFrom) else None
                    names = [a.name for a in inner.names] if isinstance(inner, ast.Import) else [module or ""]
                    if isinstance(inner, ast.Import | ast.ImportFrom) and any(
                        n.startswith("nemo_automodel") for n in names
                    ):
                        hidden.append(f"{path.relative_to(REPO)}:{inner.lineno}")
    assert not hidden, hidden


def test_the_cp_core_imports_without_the_recipe_packages():
    code = (
        "import sys, nemo_automodel.components.distributed.blockdiag_cp as cp\n"
        "bad = [m for m in sys.modules if m.startswith('nemo_automodel.') and "
        "m.split('.')[1:3] != ['components', 'distributed'] and m not in ('nemo_automodel.components',)]\n"
        "print(bad)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr

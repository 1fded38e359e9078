"""A non-zero rank's logging set-up does not import ``datasets`` (with pyarrow, ~75 MiB of RSS per rank)."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
from nemo_automodel.components.training.metrics import configure_logging
assert "datasets" not in sys.modules, "imported before the call"
configure_logging(rank=1)
print("datasets" in sys.modules)
import datasets
print(datasets.is_progress_bar_enabled() is False)
"""


def test_rank_logging_quiets_datasets_without_importing_it() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    imported, quiet = out.stdout.split()
    assert imported == "False", "configure_logging(rank=1) imported datasets"
    assert quiet == "True", "datasets imported later still shows progress bars"

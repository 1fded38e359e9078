"""CPU allocator retention: with the fixed mmap threshold, freed activation-sized tensors leave RSS at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nemo_automodel.components.distributed.cpu_memory import MMAP_THRESHOLD_ENV, fix_mmap_threshold

# In a fresh process: free one 16 MiB tensor (glibc's dynamic threshold rises to 16 MiB), then allocate twenty
# 8 MiB tensors, free all but the last, and print how much RSS the freed 152 MiB still hold.
_PROBE = """
import sys, torch
from nemo_automodel.components.distributed.cpu_memory import fix_mmap_threshold
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) / 1024
torch.ones(4 << 20).sum()  # allocated, touched and freed
blocks = [torch.ones(2 << 20) for _ in range(20)]
before = rss()
del blocks[:-1]
print(rss() - before)
"""


def _retained_mib(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != MMAP_THRESHOLD_ENV}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return -float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc behaviour")
def test_fixed_threshold_returns_freed_tensors() -> None:
    released_default, released_fixed = _retained_mib("default"), _retained_mib("fixed")
    assert released_fixed > 140, f"freed 152 MiB, RSS fell by only {released_fixed:.0f} MiB with the fixed threshold"
    assert released_default < 20, f"glibc's dynamic threshold released {released_default:.0f} MiB: probe is moot"


def test_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MMAP_THRESHOLD_ENV, "65536")
    assert fix_mmap_threshold() is False

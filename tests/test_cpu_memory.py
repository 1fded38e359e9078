"""CPU allocator retention: with fixed malloc thresholds, freed tensors leave RSS at once; the environment wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nemo_automodel.components.config.schema import DistConfig
from nemo_automodel.components.distributed import cpu_memory
from nemo_automodel.components.distributed.cpu_memory import THRESHOLDS, set_malloc_thresholds

# In a fresh process (glibc serves a request from free heap chunks before it maps one, so one threshold per
# process), with the threshold argv[1] (KiB, or "none": glibc's dynamic thresholds): free
# one 16 MiB tensor (a dynamic mmap threshold rises to 16 MiB), then allocate a hundred 512 KiB tensors (a rank's
# per-head, per-document pieces), free all but the last, and print how much of the freed 49.5 MiB left RSS.
_PROBE = """
import sys, torch
from nemo_automodel.components.distributed.cpu_memory import set_malloc_thresholds
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) / 1024
threshold = sys.argv[1]
set_malloc_thresholds(None if threshold == "none" else int(threshold))
torch.ones(4 << 20).sum()  # allocated, touched and freed
blocks = [torch.ones(128 << 10) for _ in range(100)]
before = rss()
del blocks[:-1]
print(threshold, before - rss())
"""


def _released_mib(threshold: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in {t.env for t in THRESHOLDS} | {"GLIBC_TUNABLES"}}
    command = [sys.executable, "-c", _PROBE, threshold]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    name, mib = out.stdout.strip().splitlines()[-1].split()
    return {name: float(mib)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc behaviour")
def test_default_thresholds_return_freed_small_tensors() -> None:
    default = str(DistConfig().cpu_malloc_threshold_kib)
    released = _released_mib("none") | _released_mib("1024") | _released_mib(default)  # 1024: the one before
    assert released[default] > 45, f"freed 49.5 MiB, RSS fell by {released} MiB (threshold: released)"
    assert released["none"] < 5 and released["1024"] < 5, f"the probe is moot: {released}"


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def mallopt(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    recorder = _Recorder()
    monkeypatch.setattr(cpu_memory, "_mallopt", lambda: recorder)
    for name in (*(t.env for t in THRESHOLDS), "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return recorder


def test_both_thresholds_fixed(mallopt: _Recorder) -> None:
    message = set_malloc_thresholds(128)
    assert mallopt.calls == [(-3, 128 << 10), (-1, 128 << 10)]
    assert "mmap and trim thresholds fixed at 128 KiB" in message


@pytest.mark.parametrize(
    ("name", "value", "kept"),
    [
        ("MALLOC_MMAP_THRESHOLD_", "65536", "mmap"),
        ("MALLOC_TRIM_THRESHOLD_", "0", "trim"),
        ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=4096", "mmap"),
    ],
)
def test_environment_wins(
    mallopt: _Recorder, monkeypatch: pytest.MonkeyPatch, name: str, value: str, kept: str
) -> None:
    monkeypatch.setenv(name, value)
    message = set_malloc_thresholds(128)
    fixed = {t.param for t in THRESHOLDS if t.name != kept}
    assert {param for param, _ in mallopt.calls} == fixed
    assert f"{kept} kept from the environment" in message and value.split(":")[-1] in message


def test_none_leaves_glibc_alone(mallopt: _Recorder) -> None:
    assert "dynamic" in set_malloc_thresholds(None) and mallopt.calls == []


@pytest.mark.parametrize("value", [0, -1, 32 * 1024 + 1])
def test_out_of_range_threshold_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match=r"dist\.cpu_malloc_threshold_kib"):
        DistConfig(cpu_malloc_threshold_kib=value)

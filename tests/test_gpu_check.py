"""benchmarks/gpu_check.py keeps working without a GPU: CPU parity rows pass, every GPU section says why it skipped."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.distributed as dist

from tests.recipe_helpers import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def test_gpu_check_runs_on_cpu_and_skips_every_gpu_section():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for section in ("tflops", "overhead", "exchange"):
        assert f"{section}: skip: no CUDA device" in lines
    rows = [line.split(" | ") for line in lines if line.startswith("| parity |")]
    cpu = {(r[1], r[2], r[3]): r[4] for r in rows if r[1] in ("sdpa_varlen", "dense")}
    assert len(cpu) == 2 * 2 * 5 and set(cpu.values()) == {"ok"}  # 2 kernels x bf16/fp16 x 5 cases
    assert {case for _, _, case in cpu} >= {"window-gqa", "window-softcap"}
    gpu = [r for r in rows if r[1] in ("fa3", "flash", "te", "torch_varlen")]
    assert len(gpu) == 4 * 2 * 5 and all(r[4].startswith("skip: ") for r in gpu)
    # the variant is checked before the device: te and torch_varlen name the soft-cap they cannot compute
    refused = {(r[1], r[3]) for r in gpu if "is not supported by attn_backend" in r[4]}
    assert refused == {("te", "window-softcap"), ("torch_varlen", "window-softcap")}
    assert all("needs device cuda" in r[4] for r in gpu if (r[1], r[3]) not in refused)


def _probe() -> list[str]:
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    return gpu_check.probe_collectives(torch.device("cpu"))


def test_the_exchange_probe_finds_every_collective_on_cpu_gloo(pools):
    """The probe the GPU run uses to decide whether gloo can exchange CUDA tensors: all succeed on CPU tensors."""
    assert pools.get(2).run_ok(_probe) == [[], []]
    assert not dist.is_initialized()  # the probe ran in the pool's workers, not here

"""benchmarks/gpu_check.py on CPU: every section printed and recorded even when rows fail, within its budget.

The GPU kernels run through the stand-ins (``tests/fakes``); failures are injected
into them as a GPU would produce them: an illegal memory access (which poisons the
CUDA context), TransformerEngine's "no backend" error, an out-of-memory.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.cases import fake_kernels
from tests.fakes.machine import A100, Machine
from tests.recipe_helpers import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _gpu_check():
    return importlib.import_module("benchmarks.gpu_check")  # the repository root is on the path (a namespace package)


def _table(out: str, section: str) -> list[list[str]]:
    return [line.split(" | ")[1:6] for line in out.splitlines() if line.startswith(f"| {section} |")]


def test_gpu_check_runs_on_cpu_and_skips_every_gpu_section(tmp_path):
    path = tmp_path / "check.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(path)], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for section in ("tflops", "overhead", "exchange"):
        assert f"{section}: skip: no CUDA device" in lines
    rows = _table(result.stdout, "parity")
    cpu = {(r[0], r[1], r[2]): r[3] for r in rows if r[0] in ("sdpa_varlen", "dense")}
    assert len(cpu) == 2 * 2 * 7 and set(cpu.values()) == {"ok"}  # 2 kernels x bf16/fp16 x 7 cases
    assert {case for _, _, case in cpu} >= {"window-gqa", "window-softcap", "mla-192-128"}
    gpu = [r for r in rows if r[0] in ("fa3", "flash", "te", "torch_varlen")]
    assert len(gpu) == 4 * 2 * 7 and all(r[3].startswith("skip: ") for r in gpu)
    # the variant and the head dims are checked before the device: those refusals name the feature
    named = {(r[0], r[2]) for r in gpu if "needs device cuda" not in r[3]}
    assert named == {("te", "window-softcap"), ("torch_varlen", "window-softcap"), ("flash", "mla-192-128"),
                     ("torch_varlen", "mla-192-128"), ("te", "sinks-gqa"), ("torch_varlen", "sinks-gqa")}  # fmt: skip
    report = json.loads(path.read_text())
    assert report["sections"] == dict.fromkeys(("parity", "tflops", "overhead", "exchange"), "done")
    assert len(report["rows"]) == len(rows) + 3 and report["stopped"] is None


def _raise(exc: Exception):
    def fail(*args, **kwargs):
        raise exc

    return fail


def test_failing_rows_become_rows_and_every_section_is_printed(monkeypatch, tmp_path, capsys):
    """flash-attn loses the CUDA context, the exchange's workers die: every section still prints and records."""
    gpu_check = _gpu_check()
    path = tmp_path / "check.json"
    written = []  # rows in the file right after each row finished: a check killed half-way keeps them
    add = gpu_check.Report.add
    monkeypatch.setattr(
        gpu_check.Report,
        "add",
        lambda self, row: (add(self, row), written.append(len(json.loads(path.read_text())["rows"]))),
    )
    with fake_kernels():
        flash_attn = importlib.import_module("flash_attn")
        illegal = _raise(RuntimeError("CUDA error: an illegal memory access was encountered"))
        monkeypatch.setattr(flash_attn, "flash_attn_varlen_func", illegal)
        monkeypatch.setattr(flash_attn, "flash_attn_func", illegal)
        monkeypatch.setattr(gpu_check, "_exchange_reports", _raise(RuntimeError("a benchmark worker failed (exit 1)")))
        code = gpu_check.main(["--device", "cpu", "--sizes", "64", "--iters", "1", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 1
    for section in ("parity", "tflops", "overhead", "exchange"):
        assert f"\n{section}:\n| section |" in out and f"\n{section}: " in out  # table header, summary line
    parity = _table(out, "parity")
    assert len(parity) == 6 * 7 * 2  # every kernel x case x dtype has its row
    first_flash = next(r for r in parity if r[0] == "flash")
    assert first_flash[3] == "error: RuntimeError: CUDA error: an illegal memory access was encountered"
    lost = "skip: CUDA context lost at parity/flash/bf16/straddle; rerun with --sections"
    assert {r[0] for r in parity if r[3] == lost} == {"fa3", "flash", "te", "torch_varlen"}
    assert all(r[3] == "ok" for r in parity if r[0] in ("sdpa_varlen", "dense"))  # CPU kernels go on
    gpu_rows = [r for r in _table(out, "tflops") + _table(out, "overhead") if r[0] not in ("sdpa_varlen", "dense")]
    assert {r[3] for r in gpu_rows} == {lost} and len(gpu_rows) == 8  # in-process GPU rows; CPU ones measured
    assert all("TFLOP/s" in r[3] for r in _table(out, "tflops") if r[0] in ("sdpa_varlen", "dense"))
    exchange = _table(out, "exchange")  # fresh processes, not skipped; their failure is the rows' error
    assert len(exchange) == 3 and all(
        r[3] == "error: RuntimeError: a benchmark worker failed (exit 1)" for r in exchange
    )
    report = json.loads(path.read_text())
    assert report["sections"] == dict.fromkeys(("parity", "tflops", "overhead", "exchange"), "done")
    assert len(report["rows"]) == len(parity) + 6 + 4 + 3 and written == list(range(1, len(report["rows"]) + 1))


def test_an_out_of_memory_and_a_te_without_backend_are_rows(monkeypatch, capsys):
    gpu_check = _gpu_check()
    row = gpu_check._tflops_row

    def tflops_row(kernel, *args):
        if kernel == "sdpa_varlen":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return row(kernel, *args)

    with fake_kernels():
        no_backend = _raise(ValueError("No dot product attention backend is available for the provided inputs."))
        monkeypatch.setattr(
            importlib.import_module("transformer_engine.pytorch").DotProductAttention, "forward", no_backend
        )
        monkeypatch.setattr(gpu_check, "_tflops_row", tflops_row)
        code = gpu_check.main(
            ["--device", "cpu", "--sections", "tflops", "--sizes", "64", "--iters", "1", "--json", ""]
        )
    tflops = {r[0]: r[3] for r in _table(capsys.readouterr().out, "tflops")}
    assert code == 1
    assert tflops["te"] == "error: ValueError: No dot product attention backend is available for the provided inputs."
    assert tflops["sdpa_varlen"] == "error: OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 GiB"
    assert "TFLOP/s" in tflops["dense"] and "TFLOP/s" in tflops["flash"]  # the rows after them ran


def test_the_budget_stops_cleanly(tmp_path, capsys):
    gpu_check = _gpu_check()
    path = tmp_path / "check.json"
    code = gpu_check.main(["--budget-s", "0", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    rows = _table(out, "parity")
    assert rows and all(r[3] == "skip: budget of 0 s spent" for r in rows)
    assert "stopped: budget of 0 s spent after 0 rows" in out
    report = json.loads(path.read_text())
    assert report["stopped"] == "budget of 0 s spent after 0 rows" and set(report["sections"].values()) == {"done"}


def test_the_te_throughput_row_follows_the_te_backend_model(monkeypatch):
    """An A100 without flash-attn: TE 2.12 would use its unfused backend, so its TFLOP/s row is not run."""
    gpu_check = _gpu_check()
    with fake_kernels(Machine(device=A100, flash=None, te="2.12.0")):
        result, _ = gpu_check._tflops_row("te", (64, 64), 1, torch.device("cpu"))
    assert result == "skip: TransformerEngine would use its unfused backend here (scores per padded segment)"


def test_a_row_that_would_not_fit_is_skipped_before_it_allocates(monkeypatch):
    gpu_check = _gpu_check()
    monkeypatch.setattr(gpu_check, "_free_bytes", lambda device: 2**30)
    result, _ = gpu_check._tflops_row("dense", (16384, 16384), 1, torch.device("cpu"))
    assert result.startswith("skip: needs about ") and "1.0 GiB free" in result


def _probe() -> list[str]:
    return _gpu_check().probe_collectives(torch.device("cpu"))


def test_the_exchange_probe_runs_the_collectives_the_exchanges_use(pools):
    """The probe the GPU run uses to decide whether gloo can exchange its tensors: all succeed on CPU tensors."""
    assert pools.get(2).run_ok(_probe) == [[], []]
    assert not dist.is_initialized()  # the probe ran in the pool's workers, not here


def test_the_probe_runs_every_collective_the_exchanges_and_the_agreement_call():
    """exchange.py, consensus.py and topology.py: each collective they call is one the probe runs."""
    package = REPO / "nemo_automodel/components/distributed/blockdiag_cp"
    called = set()
    for module in ("exchange.py", "consensus.py", "topology.py"):
        called |= set(re.findall(r"dist\.(\w+)\(", (package / module).read_text()))
    collectives = called - {"P2POp", "get_global_rank", "get_rank", "get_world_size", "is_initialized",
                            "get_process_group_ranks"}  # fmt: skip
    probed = set(_gpu_check().collective_calls(torch.device("cpu"), 0, 2))
    assert collectives == probed, (collectives, probed)


def test_an_unknown_section_is_named(capsys):
    with pytest.raises(SystemExit):
        _gpu_check().main(["--sections", "parity,warp"])
    assert "unknown ['warp']" in capsys.readouterr().err

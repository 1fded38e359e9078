"""``python recipes/finetune.py`` (cp=2, two local workers) under faults: it exits non-zero, naming what it can.

Faults are injected into one worker through ``tests/faults/inject/sitecustomize.py``
(``NEMO_TEST_FAULT``), or by SIGKILLing a worker found as a child of the launcher.
Every run has a hard timeout; a run that does not exit in time fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults import figures
from tests.recipe_helpers import REPO, TINY_OVERRIDES, read_losses, recipe_env

INJECT = Path(__file__).parent / "inject"
RUN_TIMEOUT_S = 150
BASE = [
    "+cp=blockdiag",
    *TINY_OVERRIDES,
    "trainer.max_steps=60",
    "trainer.ckpt_every=0",
    "trainer.export_hf=false",
    "dist.shutdown_timeout_s=20",
]


class RecipeRun:
    """A recipe subprocess in its own session; its output is collected into a file (no pipe can fill up)."""

    def __init__(self, run_dir: Path, overrides: list[str], fault: dict | None = None) -> None:
        env = recipe_env()
        if fault is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(INJECT), env["PYTHONPATH"]])
            env["NEMO_TEST_FAULT"] = json.dumps({"backend": "sdpa_varlen", "stamp": str(run_dir / "fired"), **fault})
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir, self.log = run_dir, run_dir / "output.txt"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(REPO / "recipes" / "finetune.py"), *BASE, *overrides, f"hydra.run.dir={run_dir}"],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def workers(self) -> list[int]:
        """Pids of the launcher's spawned workers (children running ``multiprocessing.spawn``), oldest first."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
        return sorted(found)

    def wait_for_steps(self, steps: int) -> None:
        """Block until ``metrics.jsonl`` has ``steps`` steps (training is under way)."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(read_losses(self.run_dir)) < steps:
            assert self.proc.poll() is None, f"exited early:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.05)

    def wait(self) -> tuple[int, float]:
        """``(exit code, time.monotonic() at exit)``; fails the test if the run outlives its timeout."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"the recipe did not exit within {RUN_TIMEOUT_S}s (a hang):\n{self.output()[-4000:]}")
            time.sleep(0.05)
        return self.proc.returncode, time.monotonic()

    def fired_at(self) -> float:
        stamp = self.run_dir / "fired"
        assert stamp.exists(), f"the fault never fired:\n{self.output()[-4000:]}"
        return float(stamp.read_text())

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def recipe_runs():
    """Start :class:`RecipeRun`s; whatever is left running at the end is killed."""
    runs: list[RecipeRun] = []

    def start(*args, **kwargs) -> RecipeRun:
        runs.append(RecipeRun(*args, **kwargs))
        return runs[-1]

    yield start
    for run in runs:
        run.kill()


def test_checkpointed_backward_failure_on_one_rank_is_named_on_every_rank_fast(recipe_runs, tmp_path):
    """The core cannot guard a kernel's backward under activation checkpointing; the recipe names it anyway.

    Rank 1 raises on its own and reports through the c10d store; its process exits, so
    rank 0's pending collective breaks at once and it raises a PeerFailureError with rank
    1's message, long before the 120 s process-group timeout.
    """
    fault = {"rank": 1, "layer": 40, "phase": "backward", "kind": "raise"}
    run = recipe_runs(tmp_path, ["trainer.activation_checkpointing=true", "dist.pg_timeout_s=120"], fault)
    code, exited = run.wait()
    out = run.output()
    assert code != 0, out[-4000:]
    assert "PeerFailureError: training failed on rank(s) [1]: rank 1: RuntimeError: injected backward failure" in out
    assert "injected backward failure on rank 1 (reported to the other ranks)" in out
    assert len(read_losses(tmp_path)) >= 1, "the fault hit mid-run"
    elapsed = exited - run.fired_at()
    assert elapsed < 60, f"{elapsed:.1f}s from the failure to the launcher's exit"
    figures.record("checkpointed backward raise, recipe (store report; to exit)", [elapsed])


def test_sigkilled_worker_makes_the_recipe_exit_non_zero(recipe_runs, tmp_path):
    run = recipe_runs(tmp_path, ["dist.pg_timeout_s=120"])
    run.wait_for_steps(2)
    victim = run.workers()[-1]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    code, exited = run.wait()
    out = run.output()
    assert code != 0, out[-4000:]
    assert "SIGKILL" in out, "the launcher names the killed worker's signal"
    assert "a collective failed and no rank reported an error: a peer was killed" in out, out[-4000:]
    figures.record("killed peer (SIGKILL), recipe (to exit)", [exited - killed_at])
    assert exited - killed_at < 60


def test_stuck_worker_makes_its_peer_fail_at_the_process_group_timeout(recipe_runs, tmp_path):
    timeout_s, stall_s = 8, 12
    fault = {"rank": 1, "layer": 40, "phase": "forward", "kind": "sleep", "sleep_s": stall_s}
    run = recipe_runs(tmp_path, [f"dist.pg_timeout_s={timeout_s}"], fault)
    run.wait_for_steps(1)
    workers = set(run.workers())
    while set(run.workers()) == workers and run.proc.poll() is None:  # the survivor exits first
        time.sleep(0.05)
    survivor_failed = time.monotonic()
    code, _ = run.wait()
    out = run.output()
    assert code != 0, out[-4000:]
    assert "Timed out" in out and "no rank reported an error" in out, out[-4000:]
    waited = survivor_failed - run.fired_at()
    assert timeout_s - 1 < waited < timeout_s + 10, waited
    figures.record(f"stuck peer, recipe (dist.pg_timeout_s={timeout_s}; survivor exit)", [waited])

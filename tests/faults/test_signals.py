"""A signal in any phase of a cp=2 recipe run ends with a checkpoint (exit 75) or, a second one, keeps the previous.

The signals are sent from inside a worker at a chosen phase (``tests/faults/signals.py``), to the
launcher (which forwards them to every worker, as a scheduler does) or to one rank only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_automodel.components.config.errors import EXIT_INPUT_ERROR
from nemo_automodel.components.training.preemption import EXIT_PREEMPTED
from tests.recipe_helpers import REPO, TINY_OVERRIDES, read_losses, recipe_env

INJECT = Path(__file__).parent / "inject"
BASE = ["+cp=blockdiag", *TINY_OVERRIDES, "dist.shutdown_timeout_s=60"]
RUN_TIMEOUT_S = 400  # a hang fails the test; a loaded 2-core machine takes ~1-3 min per run


def _run(run_dir: Path, overrides: list[str], signal_at: dict | None = None) -> tuple[int, str]:
    """Run the recipe in its own session, output to a file (a lingering worker cannot hold a pipe open)."""
    env = recipe_env()
    if signal_at is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(INJECT), env["PYTHONPATH"]])
        env["NEMO_TEST_SIGNAL"] = json.dumps(signal_at)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}-output-{len(list(run_dir.parent.glob(run_dir.name + '-output-*')))}.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "recipes" / "finetune.py"), *BASE, *overrides, f"hydra.run.dir={run_dir}"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of the run is left (none when it ended well)
            proc.wait()
    return code, log.read_text(errors="replace")


def _checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _marker(run_dir: Path) -> dict:
    return json.loads((run_dir / "preempted.json").read_text())


@pytest.mark.parametrize(
    ("phase", "overrides", "stops_at"),
    [
        # the step in flight finishes and is the checkpoint (not the one after it)
        ({"phase": "step", "step": 3}, ["trainer.max_steps=8", "trainer.export_hf=false"], 3),
        # a periodic save finishes and is the checkpoint; no further step runs
        ({"phase": "save", "step": 2}, ["trainer.max_steps=8", "trainer.ckpt_every=2", "trainer.export_hf=false"], 2),
        # validation is cut short within one batch; the step before it is checkpointed
        (
            {"phase": "validate"},
            ["trainer.max_steps=8", "data.validation=0.2", "trainer.val_every=2", "trainer.export_hf=false"],
            2,
        ),
    ],
    ids=["step", "periodic_save", "validation"],
)
def test_a_signal_mid_run_checkpoints_the_step_in_flight_and_exits_75(tmp_path, phase, overrides, stops_at):
    code, out = _run(tmp_path, overrides, {**phase, "rank": 1})
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert "SIGTERM received: finishing the step or save in flight" in out  # acknowledged at once
    assert _marker(tmp_path)["step"] == stops_at
    assert _checkpoints(tmp_path) == [f"step_{stops_at:08d}"]
    assert max(read_losses(tmp_path)) == stops_at, "no step ran after the signal's step"
    if phase["phase"] == "validate":
        assert f"validation after step {stops_at} cut short by a signal" in out


def test_a_signal_during_the_final_save_finishes_it_exits_75_and_the_requeue_only_exports(tmp_path):
    args = ["trainer.max_steps=4", "trainer.export_hf=true"]
    code, out = _run(tmp_path, args, {"phase": "save", "step": 4, "rank": 0, "to": "self"})
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert _marker(tmp_path)["step"] == 4 and "the HF export left" in out
    assert _checkpoints(tmp_path) == ["step_00000004"] and not (tmp_path / "hf").exists()

    code, out = _run(tmp_path, args)  # the requeue: nothing to train, the export is written
    assert code == 0, out[-4000:]
    assert "already complete at step 4; raise trainer.max_steps to continue" in out
    assert "resumed from" not in out and "finished 4 steps" not in out
    assert (tmp_path / "hf" / "model.safetensors").is_file() and "HF export" in out

    exported = (tmp_path / "export.json").stat().st_mtime_ns
    code, out = _run(tmp_path, args)  # a rerun of the complete run says so and writes nothing
    assert code == 0 and "already complete at step 4" in out, out[-4000:]
    assert (tmp_path / "export.json").stat().st_mtime_ns == exported


def test_a_signal_during_the_export_finishes_it_and_the_requeue_says_complete(tmp_path):
    args = ["trainer.max_steps=3", "trainer.export_hf=true"]
    code, out = _run(tmp_path, args, {"phase": "export", "rank": 1})
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "export.json").is_file()
    code, out = _run(tmp_path, args)
    assert code == 0 and "already complete at step 3" in out, out[-4000:]


def test_a_second_signal_during_a_save_aborts_and_the_previous_checkpoint_resumes(tmp_path):
    args = ["trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.export_hf=false"]
    code, out = _run(tmp_path, args, {"phase": "save", "step": 4, "rank": 1, "to": "self", "count": 2})
    assert code not in (0, EXIT_PREEMPTED), out[-4000:]
    assert "second signal (SIGTERM): aborting" in out, out[-6000:]
    assert "step_00000002" in _checkpoints(tmp_path) and "step_00000004" not in _checkpoints(tmp_path)
    code, out = _run(tmp_path, args)
    assert code == 0 and "(step 2)" in out, out[-4000:]
    assert _checkpoints(tmp_path) == ["step_00000002", "step_00000004"]  # the dead save's temp dir is gone


def test_max_steps_below_the_checkpoint_is_refused_with_the_way_out(tmp_path):
    code, out = _run(tmp_path, ["trainer.max_steps=3", "trainer.export_hf=false"])
    assert code == 0, out[-4000:]
    code, out = _run(tmp_path, ["trainer.max_steps=2", "trainer.export_hf=false"])
    assert code == EXIT_INPUT_ERROR, out[-4000:]
    assert "already complete at step 3; raise trainer.max_steps above 3 to continue" in out

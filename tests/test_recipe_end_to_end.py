"""The README's main command end to end, in real subprocesses: outputs, resume, preemption, multirun."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_automodel.components.training.preemption import EXIT_PREEMPTED
from tests.recipe_helpers import REPO, TINY_OVERRIDES, read_losses, recipe_env, run_recipe

STEPS = 12
# The main command with a few-step, tiny-model override; the LR schedule is pinned to STEPS so a run
# stopped early and resumed follows the same schedule as the uninterrupted one.
MAIN = [
    "+cp=blockdiag",
    *TINY_OVERRIDES,
    "optim.warmup_steps=3",
    f"optim.decay_steps={STEPS}",
    "trainer.ckpt_every=4",
    "trainer.log_every=4",
]


def _fail(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-8000:]}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    done = run_recipe([*MAIN, f"trainer.max_steps={STEPS}", f"hydra.run.dir={run_dir}"])
    assert done.returncode == 0, _fail(done)
    return run_dir, done


def test_main_command_trains_cp2_and_writes_metrics_checkpoint_and_hf_export(uninterrupted):
    run_dir, done = uninterrupted
    losses = read_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["kv_path"] for r in records} <= {"halo", "a2a"} and all(r["tokens_per_s"] > 0 for r in records)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000008", f"step_{STEPS:08d}"], "keep_checkpoints=2 keeps the newest two"
    assert (run_dir / "hf" / "model.safetensors").is_file() and (run_dir / "hf" / "config.json").is_file()
    assert (run_dir / "resolved_config.yaml").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()
    log = done.stdout + done.stderr
    assert "world 2 = dp 1 x cp 2" in log and re.search(r"kv (halo|a2a) recv", log)
    assert "kv_exchange=auto: " in log, "the default +cp=blockdiag lets the cost model pick and logs its prediction"
    assert not (run_dir / "preempted.json").exists()


def test_resume_after_stopping_reproduces_the_uninterrupted_losses_bitwise(uninterrupted, tmp_path):
    first = run_recipe([*MAIN, "trainer.max_steps=6", f"hydra.run.dir={tmp_path}"])
    assert first.returncode == 0, _fail(first)
    second = run_recipe([*MAIN, f"trainer.max_steps={STEPS}", f"hydra.run.dir={tmp_path}"])
    assert second.returncode == 0, _fail(second)
    assert "resumed from" in second.stdout + second.stderr
    assert read_losses(tmp_path) == read_losses(uninterrupted[0])  # exact float equality, every step


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_mid_run_checkpoints_exits_75_and_the_resume_matches(uninterrupted, tmp_path, sig):
    args = [
        sys.executable,
        str(REPO / "recipes" / "finetune.py"),
        *MAIN,
        f"trainer.max_steps={STEPS}",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.Popen(
        args, cwd=REPO, env=recipe_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while len(read_losses(tmp_path)) < 2:  # mid-run: training has started
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.05)
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_PREEMPTED, output[-6000:]
    marker = json.loads((tmp_path / "preempted.json").read_text())
    assert 2 <= marker["step"] < STEPS, "stopped mid-run, after the step in flight"
    assert Path(marker["checkpoint"]).name == f"step_{marker['step']:08d}"
    assert (Path(marker["checkpoint"]) / "trainer_state.json").is_file()

    resumed = run_recipe([*MAIN, f"trainer.max_steps={STEPS}", f"hydra.run.dir={tmp_path}"])
    assert resumed.returncode == 0, _fail(resumed)
    assert f"(step {marker['step']})" in resumed.stdout + resumed.stderr  # loaded the signal's checkpoint
    assert read_losses(tmp_path) == read_losses(uninterrupted[0])
    assert not (tmp_path / "preempted.json").exists()


def test_sigkill_of_the_whole_job_mid_save_resumes_to_the_uninterrupted_losses(uninterrupted, tmp_path):
    """Launcher and workers SIGKILLed while the step-8 checkpoint is being written; the rerun resumes bitwise."""
    args = [sys.executable, str(REPO / "recipes" / "finetune.py"), *MAIN, f"trainer.max_steps={STEPS}"]
    proc = subprocess.Popen(
        [*args, f"hydra.run.dir={tmp_path}"],
        cwd=REPO,
        env=recipe_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the launcher and its workers die together
    )
    saving = tmp_path / "checkpoints" / ".tmp-step_00000008"
    try:
        deadline = time.monotonic() + 180
        while not (saving.exists() and any(saving.glob("*.distcp"))):  # tensors being written
            assert proc.poll() is None, "the run ended before its step-8 save"
            assert time.monotonic() < deadline, "no step-8 save started"
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert saving.exists() and not (tmp_path / "checkpoints" / "step_00000008").exists(), "killed inside the save"
    assert (tmp_path / "checkpoints" / "step_00000004" / "trainer_state.json").is_file()
    resumed = run_recipe([*MAIN, f"trainer.max_steps={STEPS}", f"hydra.run.dir={tmp_path}"])
    assert resumed.returncode == 0, _fail(resumed)
    assert "(step 4)" in resumed.stdout + resumed.stderr, "resumed from the checkpoint before the killed save"
    assert read_losses(tmp_path) == read_losses(uninterrupted[0])


def test_multirun_sweep_runs_each_job_in_its_own_dir(tmp_path):
    done = run_recipe(
        ["-m", *TINY_OVERRIDES, "trainer.max_steps=2,3", "trainer.export_hf=false", f"hydra.sweep.dir={tmp_path}"]
    )
    assert done.returncode == 0, _fail(done)
    assert sorted(len(read_losses(tmp_path / job)) for job in ("0", "1")) == [2, 3]


def test_srun_tasks_without_torchrun_derive_ranks_from_slurm_and_share_rank0_run_dir(tmp_path):
    from nemo_automodel.components.launcher.local import free_port

    run_dir, elsewhere = tmp_path / "run", tmp_path / "cwd"
    elsewhere.mkdir()
    args = [
        sys.executable,
        str(REPO / "recipes" / "finetune.py"),
        "+cp=blockdiag",
        *TINY_OVERRIDES,
        "trainer.max_steps=3",
        "trainer.export_hf=false",
        f"dist.master_port={free_port()}",
        f"hydra.run.dir={run_dir}",
    ]
    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost"}
    tasks = [
        subprocess.Popen(
            args,
            cwd=elsewhere,
            env=recipe_env() | slurm | {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outputs = [t.communicate(timeout=180)[0] for t in tasks]
    finally:
        for t in tasks:
            if t.poll() is None:
                t.kill()
                t.wait()
    assert [t.returncode for t in tasks] == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    assert "world 2 = dp 1 x cp 2" in outputs[0]
    assert not any("local workers" in out for out in outputs), "each task is a rank; none launches workers"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert list(elsewhere.iterdir()) == [], "rank 1 created no Hydra output of its own"

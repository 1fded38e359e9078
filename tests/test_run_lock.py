"""The run-dir lock: one run per dir, the holder named, stale locks taken over, other hosts' locks refused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from nemo_automodel.components.config.errors import EXIT_INPUT_ERROR
from nemo_automodel.components.launcher.run_lock import LOCK_FILE, RunDirInUseError, acquire, hold_run_dir, release
from tests.recipe_helpers import REPO, TINY_OVERRIDES, read_losses, recipe_env


def test_a_second_holder_is_refused_naming_the_first_and_the_lock_goes_with_the_run(tmp_path):
    with hold_run_dir(tmp_path):
        lock = json.loads((tmp_path / LOCK_FILE).read_text())
        assert lock["host"] == socket.gethostname() and lock["pid"] == os.getpid()
        with pytest.raises(RunDirInUseError, match=rf"in use by another run: host .*, pid {os.getpid()}, started"):
            acquire(tmp_path)
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_stale_lock_of_a_dead_pid_or_a_recycled_pid_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for holder in (
        {"host": socket.gethostname(), "pid": dead.pid, "pid_start": 1, "started": 0},  # gone
        {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": -5, "started": 0},  # pid reused
    ):
        (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
        taken = acquire(tmp_path)
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        release(tmp_path, taken)


def test_a_lock_from_another_host_is_refused_with_how_to_remove_it(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "node-elsewhere", "pid": 1, "started": 0}))
    with pytest.raises(RunDirInUseError, match=r"node-elsewhere.*another host.*If that run is gone, delete"):
        acquire(tmp_path)


def test_a_second_recipe_run_on_a_live_run_dir_fails_at_start_naming_the_holder(tmp_path):
    """Two cp=2 runs on one dir: the second exits at once with the input-error code; the first is untouched."""
    args = ["+cp=blockdiag", *TINY_OVERRIDES, "trainer.max_steps=6", "trainer.export_hf=false"]
    cmd = [sys.executable, str(REPO / "recipes" / "finetune.py"), *args, f"hydra.run.dir={tmp_path}"]
    first = subprocess.Popen(
        cmd, cwd=REPO, env=recipe_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / LOCK_FILE).exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.05)
        second = subprocess.run(cmd, cwd=REPO, env=recipe_env(), capture_output=True, text=True, timeout=180)
        assert second.returncode == EXIT_INPUT_ERROR, second.stderr[-3000:]
        assert f"run dir {tmp_path} is in use by another run: host {socket.gethostname()}, pid {first.pid}" in (
            second.stderr
        )
        output, _ = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, output[-4000:]
    assert sorted(read_losses(tmp_path)) == list(range(1, 7)) and not (tmp_path / LOCK_FILE).exists()

"""What a user sees: Ctrl-C, the run dir's log, clean input errors, the summary, refusals before training."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from nemo_automodel.components.config.errors import EXIT_INPUT_ERROR
from nemo_automodel.components.config.schema import TokenizerConfig, register_schema
from nemo_automodel.components.datasets.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer
from nemo_automodel.components.training.preemption import EXIT_PREEMPTED, SIGINT_REPEAT_S, PreemptionFlag
from nemo_automodel.recipes.finetune import main
from tests.recipe_helpers import (
    REPO,
    TINY_OVERRIDES,
    read_metrics,
    recipe_env,
    run_recipe,
    save_chat_tokenizer,
    tiny_config,
)

CP2 = ["+cp=blockdiag", *TINY_OVERRIDES, "trainer.export_hf=false"]


def _output(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


def test_ctrl_c_checkpoints_and_exits_like_sigterm_and_the_run_dir_has_the_workers_full_log(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the whole process group) under the local launcher at cp=2."""
    args = [
        *CP2,
        "trainer.max_steps=60",
        "data.validation=0.1",
        "trainer.val_every=1",
        "trainer.keep_best=true",
        "trainer.ckpt_every=0",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "recipes" / "finetune.py"), *args],
        cwd=REPO,
        env=recipe_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, like a terminal's foreground job
    )
    try:
        deadline = time.monotonic() + 180
        while len(read_metrics(tmp_path)) < 2:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == EXIT_PREEMPTED, output[-6000:]
    marker = json.loads((tmp_path / "preempted.json").read_text())
    assert marker["signal"] == "SIGINT" and (Path(marker["checkpoint"]) / "trainer_state.json").is_file()
    metrics = read_metrics(tmp_path)
    assert len(metrics) == marker["step"] < 60
    assert all(r["loss_tokens"] > 0 for r in metrics.values())
    # Every step validated, except that a signal landing during the last step's validation cuts it short: that
    # step's row then has no val_loss, and the log says why (a CI run caught the race).
    log = (tmp_path / "finetune.log").read_text()
    cut = f"validation after step {marker['step']} cut short by a signal: not recorded" in log
    validated = [r for step, r in metrics.items() if not (cut and step == marker["step"])]
    assert all(r["val_loss"] > 0 and r["val_ppl"] > 1 for r in validated)
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["val_loss"] == min(r["val_loss"] for r in validated)
    assert (Path(best["checkpoint"]) / "trainer_state.json").is_file()
    for line in ("starting 2 local workers", "world 2 = dp 1 x cp 2", "val_loss", "preempted (SIGINT)", "summary:"):
        assert line in log, f"the run dir's log lacks {line!r}"
    assert "summary: preempted after step" in output and str(tmp_path / "metrics.jsonl") in output
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert {"val/loss", "val/ppl", "train/loss_tokens"} <= set(events.Tags()["scalars"])


def test_a_second_ctrl_c_aborts_but_the_launchers_forwarded_copy_of_the_first_does_not():
    now = [100.0]
    flag = PreemptionFlag(clock=lambda: now[0])
    flag._handle(signal.SIGINT, None)
    now[0] += SIGINT_REPEAT_S / 10
    try:
        flag._handle(signal.SIGINT, None)  # the same key press, forwarded by the launcher
    except KeyboardInterrupt:  # not re-raised: it would stop the whole pytest session
        pytest.fail("the launcher's forwarded copy of the first Ctrl-C aborted the run")
    assert flag.signal_name == "SIGINT"
    now[0] += SIGINT_REPEAT_S
    with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
        flag._handle(signal.SIGINT, None)


def test_a_data_error_in_the_workers_prints_its_message_alone_and_keeps_the_traceback_in_the_log(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    run_dir = tmp_path / "run"
    done = run_recipe(
        [*CP2, "data=jsonl", f"data.path={data}", f"data.cache_dir={tmp_path}", f"hydra.run.dir={run_dir}"]
    )
    out = _output(done)
    assert done.returncode == EXIT_INPUT_ERROR, out[-4000:]
    assert out.count("row 2 has no string field 'text'") == 1, out[-4000:]
    assert "Traceback" not in out and "ChildFailedError" not in out and "local_worker FAILED" not in out
    log = (run_dir / "finetune.log").read_text()
    assert "Traceback" in log and "local_worker FAILED" in log, "the tracebacks are kept in the log"


@pytest.fixture
def consoles(tmp_path):
    """Like Hydra's job logging: a console handler and ``finetune.log``; yields ``(console text, log text)`` readers."""
    console, log_file = io.StringIO(), tmp_path / "finetune.log"
    handlers = [logging.StreamHandler(console), logging.FileHandler(log_file)]
    root = logging.getLogger()
    for handler in handlers:
        root.addHandler(handler)
    try:
        yield lambda: (console.getvalue(), log_file.read_text())
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()


def _compose(*overrides: str):
    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="finetune", overrides=list(overrides))


def test_config_errors_print_one_line_keep_the_traceback_in_the_log_and_exit_65(tmp_path, consoles, capsys):
    """A ``+``-added unknown key fails like a typo, naming the valid keys (``main`` in the launching process)."""
    assert main(_compose("+trainer.max_step=5"), tmp_path) == EXIT_INPUT_ERROR
    (console, log), stderr = consoles(), capsys.readouterr().err
    assert stderr.startswith("error: trainer.max_step: unknown key (did you mean trainer.max_steps?); valid keys of")
    assert stderr.count("\n") == 1 and console == "", "one line, on stderr"
    assert "Traceback" in log and "unknown key" in log


def test_resume_never_refuses_a_used_run_dir(tmp_path, consoles, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert main(_compose(*TINY_OVERRIDES, "trainer.resume=never"), tmp_path) == EXIT_INPUT_ERROR
    assert "error: trainer.resume=never but the run dir" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n', "the earlier run is untouched"


def _train_expecting_input_error(payload: dict, run_dir: str) -> str:
    """Pool worker: ``train`` must raise an ``InputError`` on every rank; returns its message.

    TransformerEngine's kernel gets its real device constraint back for the call: an earlier test in
    this shared pool may have let the fake TE (tests/fakes) run on CPU.
    """
    from dataclasses import replace

    from nemo_automodel.components.config.errors import InputError
    from nemo_automodel.components.distributed.blockdiag_cp import kernels
    from tests.recipe_helpers import train_in_pool

    spec = kernels.KERNELS["te"]
    kernels.KERNELS["te"] = replace(spec, device_types=frozenset({"cuda"}))
    try:
        train_in_pool(payload, run_dir)
    except InputError as exc:
        return str(exc)
    finally:
        kernels.KERNELS["te"] = spec
    raise AssertionError("no InputError")


def test_an_explicit_kernel_that_cannot_run_here_is_refused_before_training(pools, tmp_path):
    cfg = tiny_config(cp={"size": 2, "attn_backend": "te"})
    messages = pools.get(2).run_ok(_train_expecting_input_error, cfg, str(tmp_path), timeout=120)
    assert all("cp.attn_backend=te cannot run here (te needs device cuda, got cpu" in m for m in messages)
    assert not (tmp_path / "metrics.jsonl").exists(), "no step ran"


def test_the_tokenizer_defaults_to_the_pretrained_models_own_and_is_named(tmp_path, caplog):
    save_chat_tokenizer(tmp_path / "model")
    (tmp_path / "bare").mkdir()
    with caplog.at_level(logging.INFO, logger="nemo_automodel.finetune"):
        own = build_tokenizer(TokenizerConfig(), str(tmp_path / "model"))
        bare = build_tokenizer(TokenizerConfig(), str(tmp_path / "bare"))
    assert isinstance(own, HFTokenizer) and own.eos_id == 5 and isinstance(bare, ByteTokenizer)
    assert f"tokenizer: {tmp_path / 'model'} (" in caplog.text and "the model's own" in caplog.text
    assert f"model.pretrained_path={tmp_path / 'bare'} holds no tokenizer" in caplog.text

"""Resume sees what changed: optimizer settings applied and logged, data/model changes refused with the way out."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_automodel.components.checkpoint.resume import compare_fingerprints
from nemo_automodel.components.config.errors import EXIT_INPUT_ERROR, InputError
from tests.recipe_helpers import TINY_OVERRIDES, read_metrics, run_recipe

OLD = {"optim.lr": 0.003, "data.seq_len": 256, "data.rows_sha256": "aa", "cp.size": 2, "dist.dp": 1}


def test_optimizer_and_layout_changes_are_applied_and_logged():
    lines = compare_fingerprints(OLD, {**OLD, "optim.lr": 0.001, "cp.size": 1}, Path("ck"), 10)
    assert lines == [
        "cp.size: 2 in the checkpoint, 1 now: resharded",
        "optim.lr: 0.003 in the checkpoint, 0.001 now: the new value applies from step 11 on",
    ]


def test_data_changes_are_refused_naming_key_old_new_and_the_way_out():
    with pytest.raises(InputError, match=r"data.seq_len: 256 in the checkpoint, 512 now.*new hydra.run.dir"):
        compare_fingerprints(OLD, {**OLD, "data.seq_len": 512, "data.rows_sha256": "bb"}, Path("ck"), 10)
    with pytest.raises(InputError, match=r"the data files' contents changed"):
        compare_fingerprints(OLD, {**OLD, "data.rows_sha256": "bb"}, Path("ck"), 10)
    assert compare_fingerprints({}, OLD, Path("ck"), 10) == []  # an older checkpoint records nothing


def test_a_cp2_resume_applies_a_new_lr_and_refuses_a_new_seq_len(tmp_path):
    base = ["+cp=blockdiag", *TINY_OVERRIDES, "trainer.export_hf=false", "optim.decay_steps=20"]
    first = run_recipe([*base, "trainer.max_steps=3", f"hydra.run.dir={tmp_path}"])
    assert first.returncode == 0, first.stderr[-3000:]
    refused = run_recipe([*base, "trainer.max_steps=5", "data.seq_len=128", f"hydra.run.dir={tmp_path}"])
    assert refused.returncode == EXIT_INPUT_ERROR, refused.stderr[-3000:]
    assert "data.seq_len: 256 in the checkpoint, 128 now" in refused.stderr
    assert max(read_metrics(tmp_path)) == 3, "nothing trained"
    lr3 = read_metrics(tmp_path)[3]["lr"]
    applied = run_recipe([*base, "trainer.max_steps=4", "optim.lr=0.0003", f"hydra.run.dir={tmp_path}"])
    assert applied.returncode == 0, applied.stderr[-3000:]
    assert "optim.lr: 0.003 in the checkpoint, 0.0003 now: the new value applies from step 4 on" in (
        applied.stdout + applied.stderr
    )
    lr4 = read_metrics(tmp_path)[4]["lr"]
    assert lr4 < lr3 / 5, "step 4 trained at the new lr (a tenth of the old, warmup still rising)"

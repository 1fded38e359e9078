"""What a first run shows: the thread count the user set is honoured and logged, ``resolved_config.yaml``
records the model and tokenizer that trained, and a plain typo gets the did-you-mean first."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from nemo_automodel.components.config.errors import EXIT_INPUT_ERROR
from nemo_automodel.components.config.overrides import check_override_keys
from nemo_automodel.components.distributed.parallel import choose_threads, set_threads
from tests.recipe_helpers import TINY_MODEL, run_recipe, save_chat_model


@pytest.mark.parametrize(
    ("explicit", "env", "device", "threads", "reason"),
    [
        (3, "1", "cpu", 3, "dist.threads=3; OMP_NUM_THREADS=1 not used"),
        (3, None, "cuda", 3, "dist.threads=3"),
        (None, "1", "cpu", 1, "OMP_NUM_THREADS=1 from the environment"),
        (None, " 5 ", "cuda", 5, "OMP_NUM_THREADS=5 from the environment"),
        (None, None, "cpu", 8, "default: 16 cores // 2 local worker(s)"),
        (None, "", "cpu", 8, "default: 16 cores // 2 local worker(s)"),
        (None, None, "cuda", None, "torch's default"),
    ],
)
def test_threads_explicit_key_over_omp_num_threads_over_the_default_share(explicit, env, device, threads, reason):
    choice = choose_threads(explicit, env, cpu_count=16, local_world=2, device_type=device)
    assert choice.threads == threads and choice.reason.startswith(reason)


@pytest.mark.parametrize("env", ["0", "-2", "four", "2.5"])
def test_a_malformed_omp_num_threads_is_refused_naming_it(env):
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS=.* is not a positive integer"):
        choose_threads(None, env, cpu_count=16, local_world=1, device_type="cpu")


def test_set_threads_applies_the_choice_to_torch(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        assert set_threads(2, 1, torch.device("cpu")).startswith("2 intra-op threads per worker (dist.threads=2")
        assert torch.get_num_threads() == 2
        assert set_threads(None, 1, torch.device("cpu")).startswith("1 intra-op threads per worker (OMP_NUM")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_run_logs_its_threads_and_records_the_pretrained_models_shape_and_tokenizer(tmp_path, monkeypatch):
    model_dir = save_chat_model(tmp_path / "model")  # hidden 64, 2 layers: not the default 256 x 4
    qa = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in [{"messages": qa}] * 40))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the recipe's environment inherits it
    done = run_recipe(
        [
            "data=chat",
            f"data.path={data}",
            "data.seq_len=64",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"model.pretrained_path={model_dir}",
            "trainer.max_steps=1",
            "trainer.export_hf=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ]
    )
    assert done.returncode == 0, done.stderr[-4000:]
    log = done.stdout + done.stderr
    assert "threads: 1 intra-op threads per worker (OMP_NUM_THREADS=1 from the environment)" in log
    resolved = yaml.safe_load((tmp_path / "run" / "resolved_config.yaml").read_text())
    assert {k: resolved["model"][k] for k in TINY_MODEL} == TINY_MODEL, "the loaded model's shape, not the defaults"
    assert resolved["tokenizer"]["name_or_path"] == str(model_dir), "the model's own tokenizer trained"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trainer.max_step=5"], "trainer.max_step: unknown key (did you mean trainer.max_steps?)"),
        (["+cp=blockdiag", "cp.sise=4"], "cp.sise: unknown key (did you mean cp.size?)"),
        (["traner.max_steps=5"], "traner: unknown key (did you mean trainer?)"),
        (["dat=chat"], "dat: unknown key (did you mean data?)"),
    ],
)
def test_a_plain_typo_gets_the_did_you_mean(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_override_keys(argv)


def test_valid_overrides_flags_additions_and_hydra_keys_pass_the_key_check():
    check_override_keys(
        ["-m", "--cfg", "job", "+cp=blockdiag", "cp.size=4", "data=chat", "optim.lr=1e-3,3e-3", "~trainer.seed"]
        + ["hydra.run.dir=/tmp/x", "model.pretrained_path=/m", "dist.threads=2", "++trainer.new_key=1", "oops"]
    )


def test_the_command_line_typo_exits_65_with_the_did_you_mean_and_not_hydras_append_hint():
    done = run_recipe(["trainer.max_step=5"], timeout=120)
    assert done.returncode == EXIT_INPUT_ERROR
    assert done.stderr.startswith("error: trainer.max_step: unknown key (did you mean trainer.max_steps?)")
    assert "+trainer.max_step" not in done.stderr and "Traceback" not in done.stderr

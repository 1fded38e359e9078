"""The offline chat demo: its shipped assets are what the build script makes, and the one command trains, validates
and exports a model that ``AutoTokenizer`` + ``AutoModelForCausalLM`` load and generate with."""

from __future__ import annotations

import json
import subprocess
import sys

from nemo_automodel.components.datasets import chat_demo
from tests.recipe_helpers import REPO, read_metrics, recipe_env

STEPS = 3


def test_shipped_assets_are_small_and_rebuilt_byte_for_byte_by_the_build_script(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "nemo_automodel.components.datasets.chat_demo", "--out", str(tmp_path)],
        check=True,
        env=recipe_env(),
        cwd=tmp_path,  # the script writes where --out says, whatever the working directory
        capture_output=True,
    )
    shipped = {p.relative_to(chat_demo.ASSETS): p.read_bytes() for p in chat_demo.ASSETS.rglob("*") if p.is_file()}
    rebuilt = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert shipped.keys() == rebuilt.keys()
    for name, content in shipped.items():
        assert content == rebuilt[name], f"{name} differs from the build script's output: rerun it and commit"
    assert sum(len(c) for c in shipped.values()) < 2 * 2**20, "keep the shipped assets under 2 MB"


def test_the_one_command_trains_validates_and_exports_a_model_that_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "finetune.py"),
            "+cp=blockdiag",
            "data=chat_demo",
            f"trainer.max_steps={STEPS}",
            "trainer.ckpt_every=0",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,  # the shipped assets are found from any working directory
        env=recipe_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    log = done.stdout + done.stderr
    assert "chat template yes" in log and "answers only" in log
    assert read_metrics(run_dir)[STEPS]["val_loss"] > 0, "the held-out conversations are evaluated"
    export = run_dir / "hf"
    tokenizer = AutoTokenizer.from_pretrained(export)  # the demo's tokenizer and chat template travel with the model
    model = AutoModelForCausalLM.from_pretrained(export)
    eos = model.generation_config.eos_token_id
    assert tokenizer.eos_token == "<|end|>" and tokenizer.eos_token_id in (eos if isinstance(eos, list) else [eos])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of Norway?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    assert 0 < len(out) <= 8 and isinstance(tokenizer.decode(out, skip_special_tokens=True), str)
    resolved = json.dumps((run_dir / "resolved_config.yaml").read_text())
    assert str(chat_demo.ASSETS / "chats.jsonl") in resolved, "the resolved config names the shipped corpus"

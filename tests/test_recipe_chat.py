"""Chat fine-tuning through the real recipe loop: cp=2 equals cp=1 (answer-only loss, validation), label isolation,
and an export that ``from_pretrained`` + ``generate`` load and that stops (EOS learned)."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from nemo_automodel.components.config.schema import DataConfig
from nemo_automodel.components.datasets.loader import prepare_data
from nemo_automodel.components.datasets.tokenizer import HFTokenizer
from tests.recipe_helpers import packed_logits, save_chat_model, train_in_pool

STEPS = 6


def _conversations(count: int, seed: int = 0) -> list[dict]:
    """Arithmetic chats of 1-3 turns (some with a system turn): 20 to 70 tokens, many crossing a cp=2 shard."""
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        messages = [{"role": "system", "content": "answer with the number"}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            messages += [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]
        chats.append({"messages": messages})
    return chats


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    save_chat_model(root / "model")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in _conversations(120)))
    return root


def _config(root, run: str, **cp) -> dict:
    return {
        "model": {"pretrained_path": str(root / "model")},
        "data": {
            "source": "chat",
            "path": str(root / "train.jsonl"),
            "seq_len": 128,
            "validation": "0.1",
            "cache_dir": str(root / "cache"),
        },
        "trainer": {"max_steps": STEPS, "val_every": 3, "ckpt_every": 0},
        "optim": {"warmup_steps": 2},
        "cp": cp,
    }


@pytest.fixture(scope="module")
def chat_cp1(pools, chat_setup):
    (result,) = pools.get(1).run_ok(train_in_pool, _config(chat_setup, "cp1"), str(chat_setup / "cp1"), timeout=300)
    assert result["code"] == 0 and sorted(result["losses"]) == list(range(1, STEPS + 1))
    return result


@pytest.mark.parametrize(("layout", "kv_exchange"), [("contiguous", "halo"), ("balanced", "a2a")])
def test_chat_cp2_training_and_validation_equal_cp1_with_answer_only_loss(
    pools, chat_setup, chat_cp1, tmp_path, layout, kv_exchange
):
    cfg = _config(chat_setup, "cp2", size=2, layout=layout, kv_exchange=kv_exchange)
    result = pools.get(2).run_ok(train_in_pool, cfg, str(tmp_path), timeout=300)[0]
    assert result["code"] == 0
    reference = chat_cp1["metrics"]
    assert [r.get("val_loss") is not None for r in reference.values()] == [False, False, True, False, False, True]
    for step, ref in reference.items():
        got = result["metrics"][step]
        assert got["loss_tokens"] == ref["loss_tokens"] > 0 and got["tokens"] == ref["tokens"]
        assert got["loss_tokens"] < got["tokens"] / 2, "answer-only: most tokens carry no loss"
        assert abs(got["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], f"step {step}"
        for key in ("val_loss", "val_ppl"):
            assert (got.get(key) is None) == (ref.get(key) is None)
            if ref.get(key) is not None:
                assert abs(got[key] - ref[key]) <= 1e-5 * ref[key], f"step {step} {key}"
    for name, ref in chat_cp1["weights"].items():
        torch.testing.assert_close(result["weights"][name], ref, rtol=1e-4, atol=1e-5, msg=f"final weight {name}")


def test_perturbing_a_prompt_token_changes_only_later_answers_of_its_own_conversation(pools, chat_setup):
    """Labels sit on answer tokens only; a prompt token reaches the loss only through attention, forward in time."""
    tokenizer = HFTokenizer.load(str(chat_setup / "model"))
    rows = prepare_data(DataConfig(source="chat", path=str(chat_setup / "train.jsonl"), seq_len=128), tokenizer).train
    index = max(range(len(rows)), key=lambda r: int(rows.seq_ids[r].max()))  # the row with the most conversations
    row = rows.row(index)
    ids, labels, seq = row["input_ids"][0], row["labels"][0], row["_packed_seq_ids"][0]
    plus = tokenizer._tokenizer.convert_tokens_to_ids("+")
    doc = int(seq.max()) // 2 + 1
    where = int(((seq == doc) & (ids == plus)).nonzero()[0])  # the "+" of the first question of a middle conversation
    assert labels[where - 1] == -100, "a prompt token is no label's target"
    changed = {k: v.clone() for k, v in row.items()}
    changed["input_ids"][0, where] = tokenizer._tokenizer.convert_tokens_to_ids("*")
    base, perturbed = pools.get(2).run_ok(packed_logits, "hf_interface", [row, changed], "halo", timeout=120)[0]

    def contributions(logits: torch.Tensor) -> torch.Tensor:  # per-token CE, 0 where there is no label
        return F.cross_entropy(logits.float(), labels.clamp(min=0), reduction="none") * (labels != -100)

    diff = (contributions(base) - contributions(perturbed)).abs()
    assert diff[seq != doc].max() == 0, "another conversation's loss changed"
    assert diff[:where].max() == 0, "a loss before the perturbed token changed"
    assert diff[where:][labels[where:] == -100].max() == 0, "an unlabelled position contributed"
    assert diff[(seq == doc) & (labels != -100)].max() > 0, "the later answers of its conversation see it (attention)"


def test_export_loads_with_from_pretrained_and_generate_stops_after_the_answer(pools, tmp_path):
    """A bf16 model fine-tuned on chats is exported in bf16 with its tokenizer; generation answers, then stops."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_chat_model(tmp_path / "model", dtype="bfloat16")
    facts = {"hi": "ok", "name?": "bot", "1+1?": "2", "color?": "blue"}
    chats = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in facts.items()
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats * 8))
    cfg = {
        "model": {"pretrained_path": str(tmp_path / "model")},
        "data": {"source": "chat", "path": str(tmp_path / "train.jsonl"), "seq_len": 64, "cache_dir": str(tmp_path)},
        "trainer": {"max_steps": 80, "ckpt_every": 0, "grad_accum": 1},
        "optim": {"lr": 1e-2, "warmup_steps": 5},
    }
    (result,) = pools.get(1).run_ok(train_in_pool, cfg, str(tmp_path / "run"), timeout=300)
    assert result["code"] == 0
    export = tmp_path / "run" / "hf"
    config = json.loads((export / "config.json").read_text())
    assert config["use_cache"] is True and config["dtype"] == "bfloat16"
    assert json.loads((export / "generation_config.json").read_text())["use_cache"] is True
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    # the model's own EOS (LlamaConfig's default 2) plus the tokenizer's, which training taught it to emit
    assert model.dtype == torch.bfloat16 and model.generation_config.eos_token_id == [2, tokenizer.eos_token_id]
    for question, answer in facts.items():
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)[0, prompt["input_ids"].shape[1] :]
        assert out[-1] == tokenizer.eos_token_id and len(out) < 12, f"{question!r}: never stopped: {out.tolist()}"
        assert tokenizer.decode(out, skip_special_tokens=True) == answer

"""A local HF model directory, a local HF tokenizer and a JSONL data set, trained under cp=2."""

from __future__ import annotations

import json
import string

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from nemo_automodel.components.config.schema import ModelConfig
from nemo_automodel.components.models.causal_lm import llama_config
from tests.recipe_helpers import TINY_MODEL, train_in_pool

CHARS = string.ascii_lowercase + string.digits + " +:.,"


@pytest.fixture(scope="module")
def local_model_dir(tmp_path_factory):
    """A character-level HF tokenizer and a matching tiny Llama, both saved with save_pretrained."""
    path = tmp_path_factory.mktemp("local_model")
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2} | {c: i + 3 for i, c in enumerate(CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    tokenizer.save_pretrained(path)
    config = llama_config(ModelConfig(**TINY_MODEL), vocab_size=len(vocab))
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_local_model_tokenizer_and_jsonl_train_with_cp2(pools, tmp_path, local_model_dir):
    data = tmp_path / "train.jsonl"
    texts = [f"{w} " * n for w, n in (("abc", 3), ("hello world", 20), ("x", 2), ("12 + 7: 19", 30))] * 10
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = {
        "model": {"pretrained_path": str(local_model_dir)},
        "tokenizer": {"name_or_path": str(local_model_dir)},
        "data": {"source": "jsonl", "path": str(data), "seq_len": 128, "cache_dir": str(tmp_path / "cache")},
        "cp": {"size": 2},
        "trainer": {"max_steps": 3, "ckpt_every": 0},
    }
    result = pools.get(2).run_ok(train_in_pool, cfg, str(tmp_path / "run"), timeout=300)[0]
    assert result["code"] == 0 and sorted(result["losses"]) == [1, 2, 3]
    assert result["weights"]["model.embed_tokens.weight"].shape[0] == 3 + len(CHARS)
    assert (tmp_path / "run" / "hf" / "tokenizer.json").is_file(), "the HF tokenizer is exported with the model"

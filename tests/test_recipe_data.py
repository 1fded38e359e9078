"""The recipe's data: chat / instruction / text formats, answer-only labels, EOS, long conversations, files, cache."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed import HashStore

from nemo_automodel.components.config.schema import DataConfig
from nemo_automodel.components.datasets.cache import DataCache
from nemo_automodel.components.datasets.loader import load_data, prepare_data, rows_for_rank
from nemo_automodel.components.datasets.tokenizer import ByteTokenizer, HFTokenizer
from tests.recipe_helpers import save_chat_tokenizer

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> HFTokenizer:
    path = tmp_path_factory.mktemp("chat_tokenizer")
    save_chat_tokenizer(path)
    return HFTokenizer.load(str(path))


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _labelled_text(tokenizer: HFTokenizer, rows, row: int = 0) -> list[str]:
    """The target tokens of ``row``, as text, one string per run of consecutive labels."""
    runs, current = [], []
    for label in rows.labels[row].tolist():
        if label == -100:
            if current:
                runs.append("".join(current))
            current = []
        else:
            current.append(tokenizer._tokenizer.convert_ids_to_tokens(label))
    return runs + (["".join(current)] if current else [])


def test_chat_labels_are_exactly_the_assistant_answers_and_their_end_of_turn(tmp_path, chat_tokenizer):
    path = _write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    rows = prepare_data(DataConfig(source="chat", path=str(path), seq_len=64), chat_tokenizer).train
    assert _labelled_text(chat_tokenizer, rows) == ["hello<|end|>", "4<|end|>"]
    tokens = chat_tokenizer._tokenizer.convert_ids_to_tokens(rows.input_ids[0][rows.seq_ids[0] > 0].tolist())
    assert tokens[-1] == "<|end|>" and tokens.count("<|end|>") == 5, "the rendering ends with EOS: none added"
    everything = prepare_data(DataConfig(source="chat", path=str(path), seq_len=64, loss_on="all"), chat_tokenizer)
    assert int((everything.train.labels != -100).sum()) == int((rows.seq_ids > 0).sum()) - 1


def test_instruction_labels_the_completion_and_the_eos_after_it(tmp_path, chat_tokenizer):
    path = _write(tmp_path / "inst.jsonl", [{"question": "2+3=", "answer": "5"}])
    cfg = DataConfig(
        source="instruction", path=str(path), seq_len=16, prompt_field="question", completion_field="answer"
    )
    rows = prepare_data(cfg, chat_tokenizer).train
    assert _labelled_text(chat_tokenizer, rows) == ["5<|end|>"]
    assert int((rows.seq_ids[0] > 0).sum()) == len("2+3=5") + 1, "prompt, completion, one EOS"


def test_text_documents_end_with_one_eos_unless_they_already_do(tmp_path):
    path = _write(tmp_path / "text.jsonl", [{"text": "abc"}, {"text": "de\u0000"}])
    cfg = DataConfig(source="text", path=str(path), seq_len=16, packing_algorithm="first_fit_decreasing")
    rows = prepare_data(cfg, ByteTokenizer()).train
    assert rows.input_ids[0, :7].tolist() == [97, 98, 99, 0, 100, 101, 0], "EOS (byte 0) after abc, none doubled"
    assert rows.labels[0, :7].tolist() == [98, 99, 0, -100, 101, 0, -100], "EOS is learned; no label crosses"
    no_eos = prepare_data(DataConfig(source="text", path=str(path), seq_len=16, add_eos=False), ByteTokenizer())
    assert int((no_eos.train.seq_ids > 0).sum()) == 6


def _turns(n: int) -> list[dict]:
    pairs = [({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}) for i in range(n)]
    return [m for pair in pairs for m in pair]


def test_a_conversation_longer_than_seq_len_keeps_its_leading_whole_turns_else_is_dropped(
    tmp_path, chat_tokenizer, caplog
):
    # each turn: <|user|> q i <|end|> \n <|assistant|> answer i <|end|> \n = 16 tokens; the last newline is dropped
    path = _write(tmp_path / "long.jsonl", [{"messages": _turns(3)}, {"messages": [*_turns(1)[:1], _turns(3)[1]]}])
    path.write_text(path.read_text() + json.dumps({"messages": [{"role": "user", "content": "x" * 40}, _turns(1)[1]]}))
    cfg = DataConfig(source="chat", path=str(path), seq_len=40, packing_algorithm="first_fit_decreasing")
    data = prepare_data(cfg, chat_tokenizer)
    assert "1 cut to their leading turns, 1 dropped" in data.summary
    labelled = sorted(_labelled_text(chat_tokenizer, data.train, r) for r in range(len(data.train)))
    assert ["answer 0<|end|>", "answer 1<|end|>"] in labelled, "two whole turns kept (32 tokens), the third cut off"
    assert all("answer 2" not in text for runs in labelled for text in runs)
    dropped = prepare_data(DataConfig(**{**cfg.__dict__, "long_conversations": "drop"}), chat_tokenizer)
    assert "0 cut to their leading turns, 2 dropped" in dropped.summary


@pytest.mark.parametrize("kind", ["parquet", "arrow", "directory_split", "glob"])
def test_hf_datasets_files_give_the_same_rows_as_jsonl(tmp_path, chat_tokenizer, kind):
    import datasets

    records = [{"messages": _turns(i % 3 + 1)} for i in range(12)]
    reference = prepare_data(
        DataConfig(source="chat", path=str(_write(tmp_path / "ref.jsonl", records)), seq_len=64), chat_tokenizer
    )
    table = datasets.Dataset.from_list(records)
    if kind == "parquet":
        table.to_parquet(str(tmp_path / "train.parquet"))
        path, split = tmp_path / "train.parquet", None
    elif kind == "arrow":
        table.save_to_disk(str(tmp_path / "saved"))
        path, split = next((tmp_path / "saved").glob("*.arrow")), None
    elif kind == "directory_split":
        (tmp_path / "dir").mkdir()
        _write(tmp_path / "dir" / "train-00000-of-00002.jsonl", records[:5])
        _write(tmp_path / "dir" / "train-00001-of-00002.jsonl", records[5:])
        _write(tmp_path / "dir" / "test.jsonl", [{"messages": _turns(1)}])
        path, split = tmp_path / "dir", "train"
    else:
        _write(tmp_path / "part-a.jsonl", records[:7])
        _write(tmp_path / "part-b.jsonl", records[7:])
        path, split = tmp_path / "part-*.jsonl", None
    data = prepare_data(DataConfig(source="chat", path=str(path), split=split, seq_len=64), chat_tokenizer)
    for name in ("input_ids", "labels", "position_ids", "seq_ids"):
        assert torch.equal(getattr(data.train, name), getattr(reference.train, name)), name


def test_validation_fraction_holds_out_documents_and_each_dp_rank_gets_the_same_number_of_rows(tmp_path):
    path = _write(tmp_path / "t.jsonl", [{"text": f"document {i} " * (i % 5 + 1)} for i in range(40)])
    data = prepare_data(DataConfig(source="text", path=str(path), seq_len=64, validation="0.25"), ByteTokenizer())
    assert "30 training documents, 10 validation documents" in data.summary
    train_docs, val_docs = (int(r.seq_ids.amax(dim=1).sum()) for r in (data.train, data.validation))
    assert (train_docs, val_docs) == (30, 10)
    n = len(data.validation)
    for dp in (3, n + 1):  # n + 1: the last rank gets only a top-up row
        per_rank = [rows_for_rank(data.validation, dp, r) for r in range(dp)]
        assert {len(rows) for rows in per_rank} == {-(-n // dp)}
        labelled = sum(int((row["labels"] != -100).sum()) for rows in per_rank for row in rows)
        assert labelled == int((data.validation.labels != -100).sum()), "the top-up rows carry no label"
        # every row, the top-up ones included, is int64: what embeddings and the loss take
        assert {t.dtype for rows in per_rank for row in rows for t in row.values()} == {torch.int64}


def test_the_cache_is_built_once_by_rank_0_and_read_by_the_others(tmp_path, chat_tokenizer, caplog):
    path = _write(tmp_path / "chat.jsonl", [{"messages": _turns(2)}] * 4)
    cfg = DataConfig(source="chat", path=str(path), seq_len=64, cache_dir=str(tmp_path / "cache"))
    store = HashStore()
    waited: list = []
    other = threading.Thread(target=lambda: waited.append(load_data(cfg, chat_tokenizer, False, store)))
    other.start()  # a non-zero rank: waits on the store until rank 0 posts the outcome
    with caplog.at_level(logging.INFO, logger="nemo_automodel.finetune"):
        built = load_data(cfg, chat_tokenizer, True, store)
        other.join(timeout=60)
        again = load_data(cfg, chat_tokenizer, True, HashStore())
    assert not other.is_alive() and torch.equal(waited[0].train.labels, built.train.labels)
    assert "tokenizing and packing into the cache" in caplog.text and "reusing the tokenized cache" in caplog.text
    assert torch.equal(again.train.input_ids, built.train.input_ids)
    assert len([p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]) == 1
    key = DataCache.for_config(cfg, chat_tokenizer).key
    assert DataCache.for_config(DataConfig(**{**cfg.__dict__, "seq_len": 32}), chat_tokenizer).key != key
    assert DataCache.for_config(cfg, ByteTokenizer()).key != key, "the tokenizer is part of the key"
    _write(path, [{"messages": _turns(1)}] * 4)
    assert DataCache.for_config(cfg, chat_tokenizer).key != key, "so is the data"


def test_a_data_error_on_rank_0_stops_the_waiting_ranks_with_the_same_message(tmp_path, chat_tokenizer):
    path = _write(tmp_path / "bad.jsonl", [{"messages": [{"role": "robot", "content": "x"}]}])
    cfg = DataConfig(source="chat", path=str(path), seq_len=64, cache_dir=str(tmp_path / "cache"))
    store = HashStore()
    with pytest.raises(ValueError, match="has role 'robot'") as main:
        load_data(cfg, chat_tokenizer, True, store)
    with pytest.raises(ValueError, match="has role 'robot'") as other:
        load_data(cfg, chat_tokenizer, False, store)
    assert str(other.value) == str(main.value) and other.value.echo


def test_a_validation_file_is_packed_apart_in_the_training_format(tmp_path):
    train = _write(tmp_path / "train.jsonl", [{"text": f"train {i}"} for i in range(20)])
    held = _write(tmp_path / "val.jsonl", [{"text": "held out"}] * 3)
    data = prepare_data(DataConfig(source="text", path=str(train), seq_len=64, validation=str(held)), ByteTokenizer())
    assert "20 training documents, 3 validation documents" in data.summary
    assert int(data.validation.seq_ids.amax(dim=1).sum()) == 3
    assert bytes(data.validation.input_ids[0, :9].tolist()) == b"held out\x00"


def test_the_planner_plans_the_rows_the_recipe_would_train_on(tmp_path, chat_tokenizer, capsys):
    from nemo_automodel.recipes import plan

    path = _write(tmp_path / "chat.jsonl", [{"messages": _turns(i % 3 + 1)} for i in range(30)])
    rows = prepare_data(DataConfig(source="chat", path=str(path), seq_len=64), chat_tokenizer).train
    docs = [int(r.max()) for r in rows.seq_ids[:4]]
    plan.main(
        ["--cp", "2", "--seq-len", "64", "--rows", "4", "--data", str(path), "--data-format", "chat"]
        + ["--tokenizer", chat_tokenizer.name]
    )
    assert f"rows=4 docs/row={sum(docs) / 4:.1f} " in capsys.readouterr().out


def test_export_config_keeps_the_models_attention_settings_and_turns_the_kv_cache_on():
    from transformers import Qwen2Config

    from nemo_automodel.components.checkpoint.hf_export import export_config, export_dtype

    trained = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        eos_token_id=3,
        use_cache=False,  # as the recipe trains it
    )
    out = export_config(trained, export_dtype("auto", torch.bfloat16), eos_id=5, pad_id=0, built=False)
    for name in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "num_key_value_heads"):
        assert getattr(out, name) == getattr(trained, name), name
    assert out.use_cache is True and out.dtype == torch.bfloat16 and out.eos_token_id == [3, 5]
    assert export_dtype("float32", torch.bfloat16) == torch.float32 and export_dtype("auto", None) == torch.float32
    built = export_config(trained, torch.float32, eos_id=5, pad_id=0, built=True)
    assert built.eos_token_id == 5 and built.bos_token_id is None, "a built model takes the tokenizer's ids"


@pytest.mark.parametrize("algorithm", ["first_fit_shuffle", "first_fit_decreasing"])
def test_the_tree_first_fit_gives_nemos_bins_exactly(algorithm):
    """Same bins as NeMo's scanning first fit (so packed rows, and every bitwise resume, are unchanged)."""
    import random

    from nemo.utils.sequence_packing_utils import first_fit as nemo_first_fit

    from nemo_automodel.components.datasets.packing import first_fit, pack_order

    rng = random.Random(3)
    for n, seq_len in ((1, 8), (7, 8), (500, 64), (3000, 512)):
        lengths = [rng.randint(1, seq_len) for _ in range(n)]
        order = pack_order(lengths, algorithm, seed=1234)
        assert first_fit(order, seq_len) == nemo_first_fit(order, seq_len)


def test_a_killed_builds_temp_dir_is_removed_by_the_next_build_on_its_host(tmp_path):
    """A data build killed by the kernel (out of memory) leaves ``.tmp-<key>-<host>-<pid>``; the next one removes it."""
    import socket
    import subprocess
    import sys

    from nemo_automodel.components.datasets.cache import DataCache
    from nemo_automodel.components.datasets.loader import PackedData
    from nemo_automodel.components.datasets.packing import pack_documents

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = tmp_path / f".tmp-old-{socket.gethostname()}-{dead.pid}"
    elsewhere = tmp_path / f".tmp-old-node-elsewhere-{dead.pid}"
    for leftover in (mine, elsewhere):
        leftover.mkdir()
        (leftover / "partial").write_bytes(b"x" * 100)
    rows = pack_documents([[1, 2, 3]], 8, "first_fit_decreasing", 0, 0)
    DataCache(tmp_path, "key").write(lambda scratch: PackedData(rows, None, "one row"))
    assert not mine.exists() and elsewhere.exists(), "only this host's dead build is removed"
    assert (tmp_path / "key" / "packed.pt").is_file()

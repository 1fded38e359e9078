"""``data.max_record_bytes``: huge records are dropped (counted) or refused in bounded memory; nothing left behind."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import datasets
import pytest
import torch

from nemo_automodel.components.config.schema import DataConfig
from nemo_automodel.components.datasets.cache import DataCache
from nemo_automodel.components.datasets.loader import prepare_data
from nemo_automodel.components.datasets.sources import row_bytes
from nemo_automodel.components.datasets.tokenizer import ByteTokenizer

LIMIT = 100


def _text(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _rows_equal(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "labels", "position_ids", "seq_ids"))


def test_a_long_jsonl_line_is_dropped_counted_and_named_and_the_other_rows_are_unchanged(tmp_path):
    small = [json.dumps({"text": f"doc {i}"}) for i in range(5)]
    big = json.dumps({"text": "x" * 300})
    path = _text(tmp_path / "data.jsonl", [small[0], "", big, *small[1:]])
    data = prepare_data(DataConfig(source="text", path=str(path), seq_len=32, max_record_bytes=LIMIT), ByteTokenizer())
    reference = prepare_data(
        DataConfig(source="text", path=str(_text(tmp_path / "ref.jsonl", small)), seq_len=32), ByteTokenizer()
    )
    assert _rows_equal(data.train, reference.train)
    assert f"6 records; 1 larger than data.max_record_bytes={LIMIT} (dropped, e.g. data.path={path}: line 3)" in (
        data.summary
    )
    with pytest.raises(ValueError, match=rf"data.jsonl: line 3 is {len(big)} bytes, more than data.max_record_bytes"):
        prepare_data(
            DataConfig(source="text", path=str(path), seq_len=32, max_record_bytes=LIMIT, long_records="error"),
            ByteTokenizer(),
        )


def test_after_a_dropped_line_errors_still_name_the_files_own_line(tmp_path):
    """Rows are read from a copy without the long line; messages name the original file and line."""
    path = _text(tmp_path / "data.jsonl", ['{"text": "a"}', json.dumps({"text": "x" * 300}), "", '{"body": "b"}'])
    with pytest.raises(ValueError, match=rf"data.path={path}: line 4 has no string field 'text'"):
        prepare_data(DataConfig(source="text", path=str(path), seq_len=32, max_record_bytes=LIMIT), ByteTokenizer())
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n' + json.dumps({"text": "x" * 300}) + '\n{"text": \n')
    with pytest.raises(ValueError, match=rf"data.path={path}: line 3 is not valid JSON"):
        prepare_data(DataConfig(source="text", path=str(path), seq_len=32, max_record_bytes=LIMIT), ByteTokenizer())


def test_a_huge_line_is_never_held_in_memory(tmp_path):
    """A 32 MiB line under a 1 MiB limit: Python's peak allocation stays under 16 MiB (``datasets`` reads JSON in
    10 MiB blocks); holding the line once would take 32 MiB."""
    limit = 1 << 20
    path = tmp_path / "data.jsonl"
    with path.open("w") as f:
        f.write('{"text": "before"}\n{"text": "' + "x" * (32 << 20) + '"}\n{"text": "after"}\n')
    cfg = DataConfig(source="text", path=str(path), seq_len=32, max_record_bytes=limit)
    tracemalloc.start()
    try:
        data = prepare_data(cfg, ByteTokenizer())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "1 larger than data.max_record_bytes" in data.summary
    assert peak < 16 << 20, f"peak Python allocation {peak / 2**20:.1f} MiB"


def test_arrow_row_sizes_count_the_strings_of_nested_chat_rows():
    messages = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], [], None]
    table = datasets.Dataset.from_list([{"messages": m, "n": 1} for m in messages]).data.table
    assert row_bytes(table).tolist() == [4 + 2 + 9 + 5 + 8, 8, 8]  # strings + the int64 column
    assert row_bytes(table.slice(1)).tolist() == [8, 8]  # a slice of a table is measured from its own offset


def test_a_large_parquet_row_is_dropped_counted_or_refused_by_row(tmp_path):
    records = [{"text": f"doc {i}"} for i in range(4)]
    datasets.Dataset.from_list([*records[:2], {"text": "x" * 300}, *records[2:]]).to_parquet(
        str(tmp_path / "a.parquet")
    )
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "ref.parquet"))
    cfg = DataConfig(source="text", path=str(tmp_path / "a.parquet"), seq_len=32, max_record_bytes=LIMIT)
    data = prepare_data(cfg, ByteTokenizer())
    reference = prepare_data(DataConfig(source="text", path=str(tmp_path / "ref.parquet"), seq_len=32), ByteTokenizer())
    assert _rows_equal(data.train, reference.train)
    assert "1 larger than data.max_record_bytes=100 (dropped, e.g. data.path=" in data.summary
    assert "a.parquet: row 3" in data.summary
    with pytest.raises(ValueError, match=r"a.parquet: row 3 is 300 bytes, more than data.max_record_bytes=100"):
        prepare_data(DataConfig(**{**cfg.__dict__, "long_records": "error"}), ByteTokenizer())


def test_a_refused_record_leaves_no_temp_dir_in_the_cache(tmp_path):
    path = _text(tmp_path / "data.jsonl", ['{"text": "a"}', json.dumps({"text": "x" * 300})])
    cache = tmp_path / "cache"
    cfg = DataConfig(source="text", path=str(path), seq_len=32, max_record_bytes=LIMIT, cache_dir=str(cache))
    entry = DataCache.for_config(cfg, ByteTokenizer())
    entry.write(lambda scratch: prepare_data(cfg, ByteTokenizer(), scratch))  # drop: the copy lives in scratch
    assert [p.name for p in cache.iterdir()] == [entry.key]
    refused = DataConfig(**{**cfg.__dict__, "long_records": "error"})
    with pytest.raises(ValueError, match=r"more than data\.max_record_bytes"):
        DataCache.for_config(refused, ByteTokenizer()).write(
            lambda scratch: prepare_data(refused, ByteTokenizer(), scratch)
        )
    assert [p.name for p in cache.iterdir()] == [entry.key], "the failed build's temp dir is gone"

"""The packer's vectorized row fill gives exactly the rows of the per-document loop it replaced; data progress bars."""

from __future__ import annotations

import random

import pytest
import torch

from nemo_automodel.components.datasets.documents import DocumentTable
from nemo_automodel.components.datasets.formats import Document
from nemo_automodel.components.datasets.packing import (
    PACKED_DTYPE,
    assign_to_rows,
    fill_rows,
    fit_to_row,
    pack_documents,
)
from nemo_automodel.testing.reference import fill_rows_reference, fit_to_row_reference


def _documents(n: int, seq_len: int, seed: int) -> list[Document]:
    """Random documents: plain (every token a target), answer-masked, length 1 and longer than ``seq_len``."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        length = rng.choice([1, 2, rng.randint(1, seq_len), rng.randint(seq_len, 3 * seq_len)])
        ids = [rng.randrange(1000) for _ in range(length)]
        targets = None if rng.random() < 0.5 else [rng.random() < 0.6 for _ in range(length)]
        docs.append(Document(ids, targets))
    return docs


@pytest.mark.parametrize("algorithm", ["first_fit_shuffle", "first_fit_decreasing"])
@pytest.mark.parametrize("long_documents", ["split", "truncate"])
def test_the_vectorized_fill_is_bitwise_the_per_document_loop(algorithm, long_documents):
    """Fit and fill over flat arrays (int32 storage) give the per-document reference's rows, value for value."""
    for n, seq_len, seed in ((1, 8, 0), (5, 8, 1), (300, 16, 2), (2000, 64, 3)):
        docs = _documents(n, seq_len, seed)
        packed = pack_documents(docs, seq_len, algorithm, pad_id=7, seed=seed, long_documents=long_documents)
        fitted = fit_to_row_reference(docs, seq_len, long_documents)
        rows = assign_to_rows([len(d.ids) for d in fitted], seq_len, algorithm, seed)
        expected = fill_rows_reference(fitted, rows, seq_len, pad_id=7)
        got = (packed.input_ids, packed.labels, packed.position_ids, packed.seq_ids)
        for name, a, b in zip(("input_ids", "labels", "position_ids", "seq_ids"), got, expected):
            assert a.dtype == PACKED_DTYPE and torch.equal(a.long(), b), (name, n, seq_len)
        table = fit_to_row(DocumentTable.from_documents(docs), seq_len, long_documents)
        assert [table.document(i) for i in range(len(table))] == fitted
        assert all(t.dtype == torch.long for t in packed.row(0).values()), "rows are handed out as int64"


def test_fill_in_blocks_matches_one_block(monkeypatch):
    """Rows filled ``FILL_ROWS`` at a time (bounded index arrays) are the rows of a single block."""
    from nemo_automodel.components.datasets import packing

    docs = DocumentTable.from_documents(_documents(500, 16, 4))
    fitted = fit_to_row(docs, 16, "split")
    rows = assign_to_rows(fitted.lengths.tolist(), 16, "first_fit_shuffle", 0)
    whole = fill_rows(fitted, rows, 16, 7)
    monkeypatch.setattr(packing, "FILL_ROWS", 3)
    blocks = fill_rows(fitted, rows, 16, 7)
    assert len(rows) > 3 * 10 and all(
        torch.equal(a, b) for a, b in zip(whole.__dict__.values(), blocks.__dict__.values())
    )


class _Store:
    """The c10d store of a one-rank job (rank 0 posts the cache outcome)."""

    def set(self, key: str, value: str) -> None:
        pass


@pytest.mark.parametrize("show", [True, False])
def test_data_phases_show_progress_bars_on_rank_0_only(tmp_path, monkeypatch, capsys, show):
    """Bars appear once a phase runs longer than ``PROGRESS_AFTER_S`` (0 here), and only where ``show`` (rank 0):
    rank 0 builds the cache entry (every phase, writing included); another rank only reads it."""
    from nemo_automodel.components.config.schema import DataConfig
    from nemo_automodel.components.datasets import loader, progress
    from nemo_automodel.components.datasets.tokenizer import ByteTokenizer

    monkeypatch.setattr(progress, "PROGRESS_AFTER_S", 0.0)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(50)))
    cfg = DataConfig(source="text", path=str(path), seq_len=32, validation="0.1", cache_dir=str(tmp_path / "cache"))
    if show:
        loader.load_data(cfg, ByteTokenizer(), is_main=True, store=_Store())
    else:
        loader.prepare_data(cfg, ByteTokenizer(), show=False)
    err = capsys.readouterr().err
    for phase in (
        "data: reading, rendering and tokenizing",
        "data: packing data",
        "data: packing data.validation",
        "data: writing the cache",
    ):
        assert (phase in err) == show, (phase, err[-500:])

"""The packer's vectorized row fill gives exactly the rows of the per-document loop it replaced; data progress bars."""

from __future__ import annotations

import random

import pytest
import torch

from nemo_automodel.components.datasets.formats import Document
from nemo_automodel.components.datasets.packing import assign_to_rows, fill_rows, fit_to_row, pack_documents
from tests.reference import fill_rows_reference


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
    for n, seq_len, seed in ((1, 8, 0), (5, 8, 1), (300, 16, 2), (2000, 64, 3)):
        docs = _documents(n, seq_len, seed)
        packed = pack_documents(docs, seq_len, algorithm, pad_id=7, seed=seed, long_documents=long_documents)
        fitted = fit_to_row(docs, seq_len, long_documents)
        rows = assign_to_rows([len(d.ids) for d in fitted], seq_len, algorithm, seed)
        expected = fill_rows_reference(fitted, rows, seq_len, pad_id=7)
        got = (packed.input_ids, packed.labels, packed.position_ids, packed.seq_ids)
        for name, a, b in zip(("input_ids", "labels", "position_ids", "seq_ids"), got, expected):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, n, seq_len)
        assert fill_rows(fitted, rows, seq_len, 7).input_ids.shape == (len(rows), seq_len)


@pytest.mark.parametrize("show", [True, False])
def test_data_phases_show_progress_bars_on_rank_0_only(tmp_path, monkeypatch, capsys, show):
    """Bars appear once a phase runs longer than ``PROGRESS_AFTER_S`` (0 here), and only where ``show`` (rank 0)."""
    from nemo_automodel.components.config.schema import DataConfig
    from nemo_automodel.components.datasets import loader
    from nemo_automodel.components.datasets.tokenizer import ByteTokenizer

    monkeypatch.setattr(loader, "PROGRESS_AFTER_S", 0.0)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(50)))
    loader.prepare_data(
        DataConfig(source="text", path=str(path), seq_len=32, validation="0.1"), ByteTokenizer(), show=show
    )
    err = capsys.readouterr().err
    for phase in (
        "data: reading",
        "data: rendering and tokenizing",
        "data: packing data",
        "data: packing data.validation",
    ):
        assert (phase in err) == show, (phase, err[-500:])

"""Pack tokenized documents into fixed-length rows with NeMo's first-fit packers.

Every row carries what block-diagonal CP needs, all ``[N, S]``:

- ``input_ids``: the documents back to back, then ``pad_id``;
- ``labels``: the next token *of the same document* when that token is a loss target
  (:class:`~nemo_automodel.components.datasets.formats.Document`; every token of plain
  text, only answers with answer-only loss); a document's last token, non-target
  successors and the padding tail get ``-100`` (labels never cross a document boundary,
  and are shifted here, before CP shards them and the balanced layout permutes them);
- ``position_ids``: restart at 0 for every document (RoPE sees each one alone);
- ``_packed_seq_ids``: 1-based document index within the row, 0 for padding.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from nemo_automodel.components.datasets.formats import Document

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedRows:
    """A packed dataset: ``N`` rows of ``S`` tokens (fields as in the module docstring)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def row(self, index: int) -> dict[str, torch.Tensor]:
        """Row ``index`` as the batch dict the CP batch builder takes (each field ``[1, S]``)."""
        return {
            "input_ids": self.input_ids[index : index + 1],
            "labels": self.labels[index : index + 1],
            "position_ids": self.position_ids[index : index + 1],
            "_packed_seq_ids": self.seq_ids[index : index + 1],
        }


@dataclass(frozen=True)
class PackedData:
    """Packed training rows, optional packed validation rows, and what conversion did (for the log)."""

    train: PackedRows
    validation: PackedRows | None
    summary: str


def _chunk(doc: Document, start: int, end: int) -> Document:
    return Document(doc.ids[start:end], None if doc.targets is None else doc.targets[start:end])


def fit_to_row(documents: Sequence[Document], seq_len: int, long_documents: str) -> list[Document]:
    """Drop empty documents; ``split`` longer ones into ``seq_len`` chunks (each its own document) or ``truncate``."""
    fitted: list[Document] = []
    for doc in documents:
        if long_documents == "truncate":
            chunks = [_chunk(doc, 0, seq_len)]
        else:
            chunks = [_chunk(doc, i, i + seq_len) for i in range(0, len(doc.ids), seq_len)]
        fitted.extend(c for c in chunks if c.ids)
    return fitted


@contextmanager
def _numpy_global_seed(seed: int) -> Iterator[None]:
    """NeMo's ``first_fit_shuffle`` draws from numpy's global RNG: seed it, then restore the caller's state."""
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(saved)


def _nemo_packing_utils() -> ModuleType:
    """``nemo.utils.sequence_packing_utils``, imported only where packing happens (importing NeMo takes seconds).

    Importing ``nemo.utils`` also reroutes every Python warning of the process
    through NeMo's logger; Python's own warning display is put back.
    """
    from nemo.utils import logging as nemo_logging
    from nemo.utils import sequence_packing_utils

    nemo_logging.captureWarnings(False)
    return sequence_packing_utils


def assign_to_rows(lengths: list[int], seq_len: int, algorithm: str, seed: int) -> list[list[int]]:
    """Document indices per row, from NeMo's packer.

    NeMo's packers return each bin as a list of *lengths*; documents of equal
    length are interchangeable, so each length is mapped back to the next unused
    document of that length (in corpus order, hence deterministic).
    """
    packer = getattr(_nemo_packing_utils(), algorithm)
    with _numpy_global_seed(seed):
        bins = packer(list(lengths), seq_len)
    by_length: dict[int, deque[int]] = defaultdict(deque)
    for index, n in enumerate(lengths):
        by_length[n].append(index)
    return [[by_length[n].popleft() for n in bin_lengths] for bin_lengths in bins]


def pack_documents(
    documents: Sequence[Document | list[int]],
    seq_len: int,
    algorithm: str,
    pad_id: int,
    seed: int,
    long_documents: str = "split",
) -> PackedRows:
    """Pack documents (or plain token lists: every token a target) into ``[N, seq_len]`` rows.

    See the module docstring for the fields.

    Raises:
        ValueError: when no document has a token.
    """
    docs = fit_to_row([d if isinstance(d, Document) else Document(list(d)) for d in documents], seq_len, long_documents)
    if not docs:
        raise ValueError("data: every document is empty after tokenization; nothing to train on")
    rows = assign_to_rows([len(d.ids) for d in docs], seq_len, algorithm, seed)
    shape = (len(rows), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    seq_ids = torch.zeros(shape, dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for doc_number, index in enumerate(members, start=1):
            tokens = torch.tensor(docs[index].ids, dtype=torch.long)
            end = start + len(tokens)
            input_ids[r, start:end] = tokens
            successors = tokens[1:]  # the last token's successor is another document
            if docs[index].targets is not None:
                keep = torch.tensor(docs[index].targets[1:], dtype=torch.bool)
                successors = torch.where(keep, successors, torch.full_like(successors, IGNORE_INDEX))
            labels[r, start : end - 1] = successors
            position_ids[r, start:end] = torch.arange(len(tokens))
            seq_ids[r, start:end] = doc_number
            start = end
    return PackedRows(input_ids, labels, position_ids, seq_ids)

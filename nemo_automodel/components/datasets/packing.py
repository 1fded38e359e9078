"""Pack tokenized documents into fixed-length rows: NeMo's first-fit packers, in O(n log n).

The bins are exactly those of NeMo's ``first_fit_decreasing`` / ``first_fit_shuffle`` (same
order of documents, same shuffle from numpy's global RNG seeded with ``data.seed``, same
leftmost-bin rule), found with a max-tree over bin capacities instead of NeMo's scan of every
bin (which re-sums each bin: quadratic; ``benchmarks/packing.py`` measures both).

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from nemo_automodel.components.datasets.documents import DocumentTable
from nemo_automodel.components.datasets.formats import Document

IGNORE_INDEX = -100
# The packed fields are stored as int32 (half of int64: 16 bytes a token slot for the four fields, in memory and in the
# cache); :meth:`PackedRows.row` hands out int64, what embeddings and the loss take.
PACKED_DTYPE = torch.int32
# Rows filled per vectorized block (their int64 index arrays: ~40 bytes a token, ~80 MB at 2048 tokens a row).
FILL_ROWS = 1024


@dataclass(frozen=True)
class PackedRows:
    """A packed dataset: ``N`` rows of ``S`` tokens (fields as in the module docstring, stored as
    :data:`PACKED_DTYPE`)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def row(self, index: int) -> dict[str, torch.Tensor]:
        """Row ``index`` as the batch dict the CP batch builder takes (each field ``[1, S]``, int64)."""
        return {
            "input_ids": self.input_ids[index : index + 1].long(),
            "labels": self.labels[index : index + 1].long(),
            "position_ids": self.position_ids[index : index + 1].long(),
            "_packed_seq_ids": self.seq_ids[index : index + 1].long(),
        }


@dataclass(frozen=True)
class PackedData:
    """Packed training rows, optional packed validation rows, and what conversion did (for the log)."""

    train: PackedRows
    validation: PackedRows | None
    summary: str


def fit_to_row(documents: DocumentTable, seq_len: int, long_documents: str) -> DocumentTable:
    """Drop empty documents; ``split`` longer ones into ``seq_len`` chunks (each its own document) or ``truncate``.

    Splitting only adds offsets (the chunks are contiguous); truncating drops the tokens past ``seq_len``.
    """
    lengths = documents.lengths
    if long_documents == "truncate" and bool((lengths > seq_len).any()):
        within = np.arange(len(documents.ids)) - np.repeat(documents.offsets[:-1], lengths) < seq_len
        kept = np.minimum(lengths, seq_len)
        offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
        documents = DocumentTable(documents.ids[within], documents.targets[within], offsets)
        lengths = kept
    if long_documents == "split" and bool((lengths > seq_len).any()):
        chunks = -(-lengths // seq_len)  # [D], 0 for an empty document
        first_chunk = np.cumsum(chunks) - chunks
        step = np.arange(int(chunks.sum())) - np.repeat(first_chunk, chunks)
        starts = np.repeat(documents.offsets[:-1], chunks) + step * seq_len
        offsets = np.append(starts, len(documents.ids)).astype(np.int64)
        return DocumentTable(documents.ids, documents.targets, offsets)
    return documents if bool((lengths > 0).all()) else documents.subset(lengths > 0)


@contextmanager
def _numpy_global_seed(seed: int) -> Iterator[None]:
    """NeMo's ``first_fit_shuffle`` draws from numpy's global RNG: seed it (as it did), then restore the caller's."""
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(saved)


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit bins of ``lengths`` (each at most ``capacity``), in input order: each length goes to the leftmost
    bin with room, else to a new bin. ``O(n log n)``: a max-tree over the remaining capacity of ``n`` potential
    bins (unopened bins hold ``capacity``, so the leftmost fit is a new bin exactly when no open bin has room).

    Returns:
        Each bin's lengths in insertion order (NeMo's ``first_fit`` result, bin for bin).
    """
    n = len(lengths)
    size = 1 << max(n - 1, 0).bit_length()
    tree = [0] * (2 * size)  # tree[size + b]: room left in bin b; tree[i]: max over i's leaves
    tree[size : size + n] = [capacity] * n
    for i in range(size - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
    bins: list[list[int]] = []
    for length in lengths:
        i = 1
        while i < size:  # descend to the leftmost leaf with room
            i = 2 * i if tree[2 * i] >= length else 2 * i + 1
        b = i - size
        if b == len(bins):
            bins.append([])
        bins[b].append(length)
        tree[i] -= length
        i >>= 1
        while i:  # refresh the maxima above it, stopping where nothing changes
            top = max(tree[2 * i], tree[2 * i + 1])
            if tree[i] == top:
                break
            tree[i] = top
            i >>= 1
    return bins


def pack_order(lengths: list[int], algorithm: str, seed: int) -> list[int]:
    """The lengths in the order NeMo's packer feeds them to first fit (sorted down, or shuffled with ``seed``)."""
    if algorithm == "first_fit_decreasing":
        return sorted(lengths, reverse=True)
    order = list(lengths)
    with _numpy_global_seed(seed):
        np.random.shuffle(order)
    return order


def assign_to_rows(
    lengths: list[int], seq_len: int, algorithm: str, seed: int, progress: Callable[[list[int]], Any] | None = None
) -> list[list[int]]:
    """Document indices per row (the bins of NeMo's ``algorithm``, module docstring).

    ``progress(order)`` may wrap the lengths fed to first fit (a sized iterable: a progress bar).

    Bins hold *lengths*; documents of equal length are interchangeable, so each length is mapped back
    to the next unused document of that length (in corpus order, hence deterministic).
    """
    order = pack_order(lengths, algorithm, seed)
    bins = first_fit(order if progress is None else progress(order), seq_len)
    by_length: dict[int, deque[int]] = defaultdict(deque)
    for index, n in enumerate(lengths):
        by_length[n].append(index)
    return [[by_length[n].popleft() for n in bin_lengths] for bin_lengths in bins]


def pack_documents(
    documents: DocumentTable | Sequence[Document | list[int]],
    seq_len: int,
    algorithm: str,
    pad_id: int,
    seed: int,
    long_documents: str = "split",
    progress: Callable[[list[int]], Any] | None = None,
) -> PackedRows:
    """Pack documents (or plain token lists: every token a target) into ``[N, seq_len]`` rows.

    See the module docstring for the fields; ``progress`` as in :func:`assign_to_rows`.

    Raises:
        ValueError: when no document has a token.
    """
    table = documents if isinstance(documents, DocumentTable) else DocumentTable.from_documents(documents)
    docs = fit_to_row(table, seq_len, long_documents)
    if not len(docs):
        raise ValueError("data: every document is empty after tokenization; nothing to train on")
    rows = assign_to_rows(docs.lengths.tolist(), seq_len, algorithm, seed, progress)
    return fill_rows(docs, rows, seq_len, pad_id)


def fill_rows(docs: DocumentTable, rows: list[list[int]], seq_len: int, pad_id: int) -> PackedRows:
    """The ``[N, seq_len]`` fields for ``rows`` (document indices per row, each row's documents fitting ``seq_len``).

    Vectorized over the tokens of :data:`FILL_ROWS` rows at a time (``benchmarks/packing.py --fill`` compares it
    with the per-document loop it replaced); the blocks bound the ``int64`` index arrays to a few MB each, so the
    only memory that grows with the corpus is the output (``int32``: 16 bytes a token slot).
    """
    shape = (len(rows), seq_len)
    fields = PackedRows(
        torch.full(shape, pad_id, dtype=PACKED_DTYPE),
        torch.full(shape, IGNORE_INDEX, dtype=PACKED_DTYPE),
        torch.zeros(shape, dtype=PACKED_DTYPE),
        torch.zeros(shape, dtype=PACKED_DTYPE),
    )
    for first in range(0, len(rows), FILL_ROWS):
        _fill_block(docs, rows[first : first + FILL_ROWS], seq_len, fields, first)
    return fields


def _fill_block(docs: DocumentTable, rows: list[list[int]], seq_len: int, out: PackedRows, first_row: int) -> None:
    """Write ``rows`` (rows ``first_row, ...`` of ``out``) in one scatter per field."""
    order = np.fromiter(chain.from_iterable(rows), np.int64)  # [D], documents in row order
    lengths = docs.lengths[order]
    row_of_doc = np.repeat(np.arange(len(rows)), [len(members) for members in rows])
    doc_number = np.fromiter(chain.from_iterable(range(1, len(m) + 1) for m in rows), np.int64, len(order))
    ends = np.cumsum(lengths)
    first = ends - lengths  # [D], each document's first token in the flat order
    start_in_row = first - first[doc_number == 1][row_of_doc]  # minus its row's first document's
    total = int(ends[-1]) if len(order) else 0
    flat = np.arange(total)
    within = flat - np.repeat(first, lengths)  # [T], offset within its document
    source = np.repeat(docs.offsets[:-1][order], lengths) + within
    ids = torch.from_numpy(docs.ids[source].astype(np.int32))
    # labels[t] = ids[t + 1] when token t + 1 is a target of the same document (a last token's successor is
    # another document, or padding)
    keep = np.append(docs.targets[source][1:], False)
    keep[ends - 1] = False
    successors = torch.where(
        torch.from_numpy(keep), torch.cat([ids[1:], ids.new_full((1,), IGNORE_INDEX)]), IGNORE_INDEX
    )
    destination = torch.from_numpy(
        (first_row + np.repeat(row_of_doc, lengths)) * seq_len + np.repeat(start_in_row, lengths) + within
    )
    for field, values in (
        (out.input_ids, ids),
        (out.labels, successors),
        (out.position_ids, torch.from_numpy(within)),
        (out.seq_ids, torch.from_numpy(np.repeat(doc_number, lengths))),
    ):
        field.view(-1)[destination] = values.to(PACKED_DTYPE)

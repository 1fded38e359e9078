"""Tokenized documents held as flat arrays, so a million conversations fit in a few bytes a token.

A :class:`~nemo_automodel.components.datasets.formats.Document` (Python lists) costs about 45 bytes a
token (a list slot plus an ``int`` object per id above 256, a slot per target); a corpus held as a list
of them is what made 1M conversations need ~13 GB. A :class:`DocumentTable` keeps every token id in one
``int32`` array and every target flag in one ``bool`` array: 5 bytes a token, whatever the count.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from nemo_automodel.components.datasets.formats import Document


@dataclass(frozen=True)
class DocumentTable:
    """``D`` documents: ids ``[T]`` int32, targets ``[T]`` bool, offsets ``[D + 1]`` int64.

    Document ``d`` is ``ids[offsets[d]:offsets[d + 1]]`` with those ``targets``
    (a target as in :class:`~nemo_automodel.components.datasets.formats.Document`; plain text: all).
    """

    ids: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Each document's token count ``[D]``."""
        return np.diff(self.offsets)

    def document(self, index: int) -> Document:
        """Document ``index`` as lists (for tests and references; the pipeline stays on the arrays)."""
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return Document(self.ids[start:end].tolist(), self.targets[start:end].tolist())

    def subset(self, keep: np.ndarray) -> DocumentTable:
        """The documents where ``keep [D]`` (bool) is true, in order (a token mask: no per-token index array)."""
        lengths = self.lengths[keep]
        tokens = np.repeat(keep, self.lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return DocumentTable(self.ids[tokens], self.targets[tokens], offsets)

    @classmethod
    def from_documents(cls, documents: Iterable[Document | list[int]]) -> DocumentTable:
        """A table of ``documents`` (a plain token list: every token a target)."""
        builder = DocumentTableBuilder()
        for doc in documents:
            builder.append(doc if isinstance(doc, Document) else Document(list(doc)))
        return builder.build()


class DocumentTableBuilder:
    """Appends documents into growing typed buffers (``array``/``bytearray``: no Python object per token)."""

    def __init__(self) -> None:
        self._ids = array("i")
        self._targets = bytearray()
        self._ends = array("q", [0])

    def __len__(self) -> int:
        return len(self._ends) - 1

    def append(self, doc: Document) -> None:
        """Add ``doc`` (its ``targets=None``: every token a target)."""
        self._ids.extend(doc.ids)
        self._targets.extend(b"\x01" * len(doc.ids) if doc.targets is None else bytes(doc.targets))
        self._ends.append(len(self._ids))

    def build(self) -> DocumentTable:
        """The table (shares the buffers: append nothing after)."""
        return DocumentTable(
            np.frombuffer(self._ids, np.int32),
            np.frombuffer(self._targets, np.bool_),
            np.frombuffer(self._ends, np.int64),
        )

"""Document geometry of a packed sequence, computed on the host from replicated ids.

Everything here is a pure function of the document ids, the CP size and the
local length, so every rank derives identical answers without communicating.
The kernels' varlen metadata, the exchange plans and the reported figures
(lower bound, attention work) are all built on these two types.

Contiguous layout: rank ``r`` holds global rows ``[r * L, (r + 1) * L)``.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DocRuns:
    """The real documents of one packed row, as contiguous runs (host ints).

    Attributes:
        starts: Global start position of each document, ascending.
        ends: Global end position (exclusive) of each document.
        ids: The document id of each run (unique, all > 0).
        total_len: Length of the (padded) row; ``[n_real, total_len)`` is padding.
    """

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    ids: tuple[int, ...]
    total_len: int

    @property
    def n_real(self) -> int:
        """Number of real (non-padding) tokens; they form a prefix of the row."""
        return self.ends[-1] if self.ends else 0

    @property
    def lengths(self) -> tuple[int, ...]:
        """Length of every document."""
        return tuple(e - s for s, e in zip(self.starts, self.ends))

    def padded_to(self, total_len: int) -> DocRuns:
        """The same documents in a row extended with padding to ``total_len``."""
        if total_len < self.total_len:
            raise ValueError(f"cannot shrink a packed row from {self.total_len} to {total_len}")
        return DocRuns(self.starts, self.ends, self.ids, total_len)

    def cu_seqlens(self) -> list[int]:
        """Boundaries of the padded row: every document, then the padding tail as one segment."""
        bounds = [0, *self.ends]
        if self.total_len > self.n_real:
            bounds.append(self.total_len)
        return bounds


def doc_runs_from_lengths(lengths: list[int] | tuple[int, ...], total_len: int | None = None) -> DocRuns:
    """Build :class:`DocRuns` for documents of the given lengths packed back to back.

    Args:
        lengths: Positive document lengths in packing order.
        total_len: Padded row length (defaults to ``sum(lengths)``).
    """
    if any(n <= 0 for n in lengths):
        raise ValueError(f"document lengths must be positive, got {list(lengths)}")
    ends = tuple(itertools.accumulate(int(n) for n in lengths))
    starts = (0, *ends[:-1]) if ends else ()
    n_real = ends[-1] if ends else 0
    total = n_real if total_len is None else int(total_len)
    if total < n_real:
        raise ValueError(f"total_len={total} is shorter than the {n_real} packed tokens")
    return DocRuns(starts, ends, tuple(range(1, len(ends) + 1)), total)


def doc_runs_from_ids(doc_ids: torch.Tensor, field: str = "_packed_seq_ids") -> DocRuns:
    """Validate per-token document ids of ONE row and return its document runs.

    Args:
        doc_ids: Integer or bool ids ``[S]`` or ``[1, S]``; ``0`` marks padding,
            documents are numbered ``>= 1``.
        field: Name used in error messages (the batch field the ids came from).

    Raises:
        ValueError: for negative ids, padding that is not only a tail, or a
            document id that reappears after another document.
    """
    if doc_ids.dim() == 2 and doc_ids.shape[0] == 1:
        doc_ids = doc_ids[0]
    if doc_ids.dim() != 1:
        raise ValueError(f"{field} must be [S] or [1, S] for one packed row, got shape {tuple(doc_ids.shape)}")
    if doc_ids.is_floating_point() or doc_ids.is_complex():
        raise ValueError(f"{field} must hold integer document ids, got dtype {doc_ids.dtype}")
    ids = doc_ids.detach().to("cpu", torch.long)
    total = int(ids.numel())
    if total == 0:
        raise ValueError(f"{field} is empty: a packed row needs at least one token")
    if bool((ids < 0).any()):
        raise ValueError(f"{field} holds negative ids; use 0 for padding and ids >= 1 for documents")
    change = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
    starts = [0, *change]
    ends = [*change, total]
    run_ids = ids[starts].tolist()
    if 0 in run_ids[:-1]:
        at = starts[run_ids.index(0)]
        raise ValueError(
            f"{field}: padding (id 0) at position {at} is followed by real tokens; padding must be a tail only. "
            "Pack documents first and append padding at the end of the row."
        )
    if run_ids[-1] == 0:
        starts, ends, run_ids = starts[:-1], ends[:-1], run_ids[:-1]
    repeated = _first_repeated(run_ids)
    if repeated is not None:
        raise ValueError(
            f"{field}: document id {repeated} reappears after another document; each document must be one "
            "contiguous run (renumber the documents of the packed row)."
        )
    return DocRuns(tuple(starts), tuple(ends), tuple(run_ids), total)


def _first_repeated(values: list[int]) -> int | None:
    """The first value that occurs a second time, or ``None``."""
    seen: set[int] = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


@dataclass(frozen=True)
class RankSegments:
    """One rank's local documents and the keys they need (host ints).

    Local rows ``[0, n_real)`` are real and split into per-document query runs
    of lengths ``q_lens``; run ``i`` attends the ``k_lens[i]`` keys of its
    document that end at its last row (bottom-right causal). Only the first run
    can have ``k_lens[0] > q_lens[0]``: its document began on an earlier rank.

    Attributes:
        rank: CP rank.
        row_offset: Global position of local row 0.
        local_len: Local rows ``L``.
        n_real: Real local rows (a prefix of the local rows).
        q_lens: Query rows per local document run.
        k_lens: Keys per local document run.
        kv_ranges: Global ``[start, end)`` K/V ranges, in the order the kernel
            consumes them (their concatenation is the packed key tensor).
    """

    rank: int
    row_offset: int
    local_len: int
    n_real: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    kv_ranges: tuple[tuple[int, int], ...]

    @property
    def straddle(self) -> int:
        """Keys of the first local document that live before this rank's rows."""
        return self.k_lens[0] - self.q_lens[0] if self.q_lens else 0

    @property
    def kv_len(self) -> int:
        """Length of the packed key tensor the kernel consumes."""
        return sum(self.k_lens)

    @property
    def remote_kv_tokens(self) -> int:
        """Needed key positions that live on other ranks: the lower bound to receive."""
        lo, hi = self.row_offset, self.row_offset + self.local_len
        return sum((e - s) - max(0, min(e, hi) - max(s, lo)) for s, e in self.kv_ranges)

    @property
    def attention_work(self) -> int:
        """(query, key) pairs the real local rows attend to (block-diagonal causal)."""
        return sum(q * k - q * (q - 1) // 2 for q, k in zip(self.q_lens, self.k_lens))


def rank_segments(runs: DocRuns, rank: int, local_len: int) -> RankSegments:
    """Local document runs of ``rank`` under the contiguous layout.

    Args:
        runs: Document runs of the padded row (``runs.total_len == cp * local_len``).
        rank: CP rank.
        local_len: Local rows per rank ``L``.
    """
    lo = rank * local_len
    hi = min(lo + local_len, runs.n_real)
    q_lens: list[int] = []
    k_lens: list[int] = []
    doc = bisect.bisect_right(runs.starts, lo) - 1
    while hi > lo and doc < len(runs.starts) and runs.starts[doc] < hi:
        q_start, q_end = max(lo, runs.starts[doc]), min(hi, runs.ends[doc])
        q_lens.append(q_end - q_start)
        k_lens.append(q_end - runs.starts[doc])
        doc += 1
    n_real = max(0, hi - lo)
    kv_ranges = ((lo - (k_lens[0] - q_lens[0]), lo + n_real),) if q_lens else ()
    return RankSegments(rank, lo, local_len, n_real, tuple(q_lens), tuple(k_lens), kv_ranges)


def all_rank_segments(runs: DocRuns, cp_size: int) -> list[RankSegments]:
    """:func:`rank_segments` for every rank of a row already padded to a multiple of ``cp_size``."""
    if runs.total_len % cp_size:
        raise ValueError(f"row length {runs.total_len} is not a multiple of cp_size={cp_size}")
    local_len = runs.total_len // cp_size
    return [rank_segments(runs, r, local_len) for r in range(cp_size)]

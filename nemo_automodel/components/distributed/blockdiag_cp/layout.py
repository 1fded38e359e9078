"""Where every token of a packed row lives under CP, computed on the host from replicated ids.

Everything here is a pure, deterministic function of the document ids, the CP
size and the layout name, so every rank derives identical answers without
communicating. The kernels' varlen metadata, the exchange plans, the cost model
and the reported figures (lower bound, attention work, balance) build on it.

Layouts (``ShardPlan.layout``):

- ``contiguous``: the packed row is cut into ``cp`` equal chunks; rank ``r``
  holds positions ``[r * L, (r + 1) * L)``. Causal work is uneven: with one long
  document the last rank does about ``2 - 1/cp`` times the mean.
- ``balanced``: documents are independent under a block-diagonal mask, so
  their order is free. Whole documents are placed greedily by attention work,
  and only the largest documents needed to reach balance are cut zig-zag over a
  group of ``g`` ranks (``2 g`` chunks; the ``i``-th rank of the group takes chunk
  ``i`` and chunk ``2 g - 1 - i``: an early, cheap piece and a late, expensive
  one), with ``g`` as small as the document's tokens and work allow, so each
  rank fetches keys of at most one document's prefix per cut. Tokens are
  permuted accordingly; each rank still holds exactly ``L`` rows, the pieces whose
  keys are all on the rank first (so the attention groups are contiguous rows).

Terms: the *physical order* is the token order after the layout's permutation;
rank ``r`` holds physical rows ``[r * L, (r + 1) * L)``, its real tokens first and
its padding last. A *segment* is a run of local rows of one document with
consecutive positions; it attends to its document's keys from position 0 up to
its last row (bottom-right causal).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import torch

LAYOUTS = ("contiguous", "balanced")
# Balance (max/mean attention work) the balanced layout aims for. Every extra cut fragments the
# documents into more, smaller kernel segments (slower per pair on CPU) and adds K/V traffic, so the
# layout stops cutting as soon as this is reached.
BALANCE_TARGET = 1.05


@dataclass(frozen=True)
class DocRuns:
    """The real documents of one packed row, as contiguous runs in the original order (host ints).

    Attributes:
        starts: Start position of each document, ascending.
        ends: End position (exclusive) of each document.
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


def _first_repeated(values: list[int]) -> int | None:
    """The first value that occurs a second time, or ``None``."""
    seen: set[int] = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


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


def pair_count(start: int, stop: int, window: int | None = None) -> int:
    """(query, key) pairs of document positions ``[start, stop)`` attending causally inside their document.

    With a sliding ``window`` the query at position ``i`` attends ``min(i + 1, window)`` keys.
    """
    if window is None or window >= stop:
        return (stop * (stop + 1) - start * (start + 1)) // 2
    ramp_stop = max(start, min(stop, window))  # positions below the window see all earlier keys
    return pair_count(start, ramp_stop) + (stop - ramp_stop) * window


def window_start(start: int, window: int | None) -> int:
    """First key position a segment starting at document position ``start`` needs (its first row's window)."""
    return 0 if window is None else max(0, start - window + 1)


@dataclass(frozen=True)
class DocPiece:
    """Positions ``[start, stop)`` of document ``doc`` (an index into :class:`DocRuns`)."""

    doc: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def work(self) -> int:
        """Attention pairs of this piece's queries."""
        return pair_count(self.start, self.stop)


Range = tuple[int, int]


def _merge(ranges: list[Range]) -> list[Range]:
    """Sort and merge overlapping or touching ``[start, end)`` ranges."""
    out: list[Range] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


@dataclass(frozen=True)
class RankSegments:
    """One rank's local segments and the keys they need (host ints).

    Local rows ``[0, n_real)`` are real and split into segments of lengths
    ``q_lens``; segment ``i`` attends ``k_lens[i] >= q_lens[i]`` keys, found at
    the physical ranges ``seg_kv[i]`` (in key order). Under the contiguous
    layout only the first segment can have more keys than queries. With a
    sliding ``window`` a segment's keys start at its first row's window
    (:func:`window_start`), so only keys some row can see are needed.

    Attributes:
        rank: CP rank.
        row_offset: Physical position of local row 0 (``rank * local_len``).
        local_len: Local rows ``L``.
        n_real: Real local rows (a prefix of the local rows).
        q_lens: Query rows per segment.
        k_lens: Keys per segment.
        seg_kv: Physical ``[start, end)`` key ranges of each segment.
        window: The sliding window these segments attend with (``None``: full causal).
    """

    rank: int
    row_offset: int
    local_len: int
    n_real: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    seg_kv: tuple[tuple[Range, ...], ...]
    window: int | None = None

    @property
    def kv_ranges(self) -> tuple[Range, ...]:
        """All segments' key ranges in packed order (touching ranges merged)."""
        return self.packed_ranges(range(len(self.q_lens)))

    def packed_ranges(self, members: Iterable[int]) -> tuple[Range, ...]:
        """Key ranges of the ``members`` segments in packed order (touching ranges merged)."""
        out: list[Range] = []
        for s, e in itertools.chain.from_iterable(self.seg_kv[i] for i in members):
            if out and out[-1][1] == s:
                out[-1] = (out[-1][0], e)
            else:
                out.append((s, e))
        return tuple(out)

    def split_local_remote(self) -> tuple[list[int], list[int]]:
        """Segment indices whose keys are all on this rank, and the others (which need exchanged keys)."""
        local = [i for i in range(len(self.q_lens)) if self.is_local(i)]
        return local, [i for i in range(len(self.q_lens)) if not self.is_local(i)]

    @property
    def straddle(self) -> int:
        """Keys of the first segment's document that precede the segment (contiguous: the left straddle)."""
        return self.k_lens[0] - self.q_lens[0] if self.q_lens else 0

    @property
    def kv_len(self) -> int:
        """Length of the packed key tensor over all segments."""
        return sum(self.k_lens)

    def is_local(self, segment: int) -> bool:
        """True when every key of ``segment`` lives on this rank."""
        lo, hi = self.row_offset, self.row_offset + self.local_len
        return all(lo <= s and e <= hi for s, e in self.seg_kv[segment])

    @property
    def remote_ranges(self) -> list[Range]:
        """Unique physical key ranges needed from other ranks (merged)."""
        lo, hi = self.row_offset, self.row_offset + self.local_len
        remote: list[Range] = []
        for s, e in itertools.chain.from_iterable(self.seg_kv):
            remote += [r for r in ((s, min(e, lo)), (max(s, hi), e)) if r[0] < r[1]]
        return _merge(remote)

    @property
    def remote_kv_tokens(self) -> int:
        """Needed key positions that live on other ranks: the lower bound to receive."""
        return sum(e - s for s, e in self.remote_ranges)

    @property
    def attention_work(self) -> int:
        """(query, key) pairs the real local rows attend to."""
        return self.work_of(range(len(self.q_lens)))

    def work_of(self, members: Iterable[int]) -> int:
        """(query, key) pairs of the ``members`` segments."""
        # Relative to a segment's first key the rows sit at [prefix, k_len): when the window moved the first
        # key, every row sees exactly W keys, which is also what pair_count gives for prefix = W - 1.
        return sum(pair_count(self.k_lens[i] - self.q_lens[i], self.k_lens[i], self.window) for i in members)


@dataclass(frozen=True)
class ShardPlan:
    """Which document pieces every rank holds, in local order; identical on every rank.

    Attributes:
        runs: The documents in their original packed order (row padded to ``cp * local_len``).
        cp: Number of CP ranks.
        local_len: Rows per rank ``L``.
        layout: ``contiguous`` or ``balanced``.
        pieces: ``pieces[r]``: rank ``r``'s document pieces, in local row order.
    """

    runs: DocRuns
    cp: int
    local_len: int
    layout: str
    pieces: tuple[tuple[DocPiece, ...], ...]

    def __post_init__(self) -> None:
        for r, pieces in enumerate(self.pieces):
            if sum(p.length for p in pieces) > self.local_len:
                raise ValueError(f"internal layout error: rank {r} holds more than {self.local_len} rows")
        covered = sorted((p.doc, p.start, p.stop) for pieces in self.pieces for p in pieces)
        position = {}
        for doc, start, stop in covered:
            if position.get(doc, 0) != start:
                raise ValueError(f"internal layout error: document {doc} is not tiled exactly by its pieces")
            position[doc] = stop
        if position != dict(enumerate(self.runs.lengths)):
            raise ValueError("internal layout error: some document is not fully placed")

    @cached_property
    def _doc_locations(self) -> dict[int, list[tuple[int, int, int]]]:
        """Per document: ``(start, stop, physical start)`` of its pieces, sorted by position."""
        where: dict[int, list[tuple[int, int, int]]] = {}
        for r, pieces in enumerate(self.pieces):
            row = r * self.local_len
            for p in pieces:
                where.setdefault(p.doc, []).append((p.start, p.stop, row))
                row += p.length
        return {d: sorted(v) for d, v in where.items()}

    def physical_ranges(self, doc: int, stop: int, first: int = 0) -> tuple[Range, ...]:
        """Physical ranges holding positions ``[first, stop)`` of ``doc``, in position order (touching merged)."""
        out: list[Range] = []
        for start, end, phys in self._doc_locations[doc]:
            if start >= stop:
                break
            if end <= first:
                continue
            s, e = phys + max(0, first - start), phys + min(end, stop) - start
            if out and out[-1][1] == s:
                out[-1] = (out[-1][0], e)
            else:
                out.append((s, e))
        return tuple(out)

    def segments(self, rank: int, window: int | None = None) -> RankSegments:
        """Rank ``rank``'s :class:`RankSegments` for attention with sliding ``window`` (``None``: full causal)."""
        pieces = self.pieces[rank]
        firsts = [window_start(p.start, window) for p in pieces]
        return RankSegments(
            rank=rank,
            row_offset=rank * self.local_len,
            local_len=self.local_len,
            n_real=sum(p.length for p in pieces),
            q_lens=tuple(p.length for p in pieces),
            k_lens=tuple(p.stop - first for p, first in zip(pieces, firsts)),
            seg_kv=tuple(self.physical_ranges(p.doc, p.stop, first) for p, first in zip(pieces, firsts)),
            window=window,
        )

    @cached_property
    def all_segments(self) -> tuple[RankSegments, ...]:
        """:meth:`segments` of every rank (full causal attention)."""
        return self.windowed_segments(None)

    def windowed_segments(self, window: int | None) -> tuple[RankSegments, ...]:
        """:meth:`segments` of every rank for ``window`` (memoized per window: plans ask once per step)."""
        if window not in self._segments_by_window:
            self._segments_by_window[window] = tuple(self.segments(r, window) for r in range(self.cp))
        return self._segments_by_window[window]

    @cached_property
    def _segments_by_window(self) -> dict[int | None, tuple[RankSegments, ...]]:
        return {}

    def chunked(self, chunk: int) -> ShardPlan:
        """This plan with every document re-cut into chunks of ``chunk`` positions (memoized per chunk).

        Chunk ``k`` of a document (its positions ``[k C, (k + 1) C)``) becomes a document of its own, and
        every piece is cut at chunk boundaries, so each token keeps its rank and physical row: plain causal
        attention over the result is chunked attention over the original documents, and its segments,
        exchange plan and lower bound (only keys of a query's own chunk) follow from the usual code.
        """
        if chunk not in self._chunked:
            starts, ends, doc_of = [], [], {}
            for doc, (start, end) in enumerate(zip(self.runs.starts, self.runs.ends)):
                doc_of[doc] = len(starts)
                starts += range(start, end, chunk)
                ends += [min(s + chunk, end) for s in range(start, end, chunk)]
            runs = DocRuns(tuple(starts), tuple(ends), tuple(range(1, len(starts) + 1)), self.runs.total_len)
            pieces = tuple(
                tuple(
                    DocPiece(
                        doc_of[p.doc] + k, max(p.start, k * chunk) - k * chunk, min(p.stop, (k + 1) * chunk) - k * chunk
                    )
                    for p in rank_pieces
                    for k in range(p.start // chunk, -(-p.stop // chunk))
                )
                for rank_pieces in self.pieces
            )
            self._chunked[chunk] = ShardPlan(runs, self.cp, self.local_len, self.layout, pieces)
        return self._chunked[chunk]

    @cached_property
    def _chunked(self) -> dict[int, ShardPlan]:
        return {}

    @cached_property
    def permutation(self) -> torch.Tensor:
        """``[S_full]`` long: the original position of the token at each physical position."""
        perm: list[int] = []
        pads = iter(range(self.runs.n_real, self.runs.total_len))
        for pieces in self.pieces:
            for p in pieces:
                base = self.runs.starts[p.doc]
                perm.extend(range(base + p.start, base + p.stop))
            perm.extend(itertools.islice(pads, self.local_len - sum(p.length for p in pieces)))
        return torch.tensor(perm, dtype=torch.long)

    @cached_property
    def is_identity(self) -> bool:
        """True when the physical order is the original order (always for ``contiguous``)."""
        return bool(torch.equal(self.permutation, torch.arange(self.runs.total_len)))

    @property
    def rank_work(self) -> list[int]:
        """Attention work (pairs) of every rank."""
        return [sum(p.work for p in pieces) for pieces in self.pieces]

    @property
    def balance(self) -> float:
        """Max over mean attention work (1.0 is perfect; 1.0 when there is no work)."""
        return balance(self.rank_work)

    def physical_cu_seqlens(self) -> list[int]:
        """Boundaries of the physical row: runs of one document with consecutive positions, and padding runs.

        Under the contiguous layout these are the original document boundaries
        followed by the padding tail as one segment.
        """
        runs: list[tuple[int, int, int]] = []  # (doc or -1 for padding, stop position, length)
        for pieces in self.pieces:
            for p in pieces:
                if runs and runs[-1][0] == p.doc and runs[-1][1] == p.start:
                    runs[-1] = (p.doc, p.stop, runs[-1][2] + p.length)
                else:
                    runs.append((p.doc, p.stop, p.length))
            pad = self.local_len - sum(p.length for p in pieces)
            if pad and runs and runs[-1][0] == -1:
                runs[-1] = (-1, 0, runs[-1][2] + pad)
            elif pad:
                runs.append((-1, 0, pad))
        return [0, *itertools.accumulate(length for _, _, length in runs)]


def balance(work: list[int]) -> float:
    """Max over mean (1.0 when all are zero)."""
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


def contiguous_pieces(runs: DocRuns, cp: int, local_len: int) -> tuple[tuple[DocPiece, ...], ...]:
    """Cut the original row into ``cp`` chunks of ``local_len`` rows."""
    out = []
    for rank in range(cp):
        lo = rank * local_len
        hi = min(lo + local_len, runs.n_real)
        pieces = []
        doc = bisect.bisect_right(runs.starts, lo) - 1
        while hi > lo and doc < len(runs.starts) and runs.starts[doc] < hi:
            base = runs.starts[doc]
            pieces.append(DocPiece(doc, max(lo, base) - base, min(hi, runs.ends[doc]) - base))
            doc += 1
        out.append(tuple(pieces))
    return tuple(out)


class _Bins:
    """Per-rank remaining capacity, accumulated work and pieces during greedy placement."""

    def __init__(self, cp: int, local_len: int) -> None:
        self.cap = [local_len] * cp
        self.work = [0] * cp
        self.pieces: list[list[DocPiece]] = [[] for _ in range(cp)]

    def put(self, rank: int, piece: DocPiece) -> None:
        self.cap[rank] -= piece.length
        self.work[rank] += piece.work
        self.pieces[rank].append(piece)


def _zigzag(bins: _Bins, doc: int, length: int, group: int) -> bool:
    """Cut ``doc`` into ``2 * group`` chunks over the ``group`` least-loaded ranks with room.

    The ``i``-th chosen rank takes chunk ``i`` (early, cheap) and chunk
    ``2 * group - 1 - i`` (late, expensive), so each gets the same share of the
    document's tokens and attention work. Keeping the group as small as balance
    allows bounds the keys each rank must fetch to one document. Returns False
    (placing nothing) when fewer than ``group`` ranks have room.
    """
    base, extra = divmod(length, group)
    by_load = sorted(range(len(bins.cap)), key=lambda r: (bins.work[r], -bins.cap[r], r))
    chosen = [r for r in by_load if bins.cap[r] >= base][:group]
    roomiest = set(sorted(chosen, key=lambda r: (-bins.cap[r], r))[:extra])  # they take the extra tokens
    chosen.sort()
    shares = [base + (r in roomiest) for r in chosen]
    if len(chosen) < group or any(n > bins.cap[r] for r, n in zip(chosen, shares)):
        return False
    heads = [n // 2 for n in shares]
    sizes = heads + [shares[i] - heads[i] for i in reversed(range(group))]
    start = 0
    for j, size in enumerate(sizes):
        if size:
            bins.put(chosen[j] if j < group else chosen[2 * group - 1 - j], DocPiece(doc, start, start + size))
        start += size
    return True


def _place_whole_or_split(bins: _Bins, doc: int, length: int) -> None:
    """Put ``doc`` whole on the least-loaded rank with room; else split it over the least-loaded ranks."""
    fits = [r for r in range(len(bins.cap)) if bins.cap[r] >= length]
    if fits:
        bins.put(min(fits, key=lambda r: (bins.work[r], r)), DocPiece(doc, 0, length))
        return
    start = 0
    for rank in sorted(range(len(bins.cap)), key=lambda r: (bins.work[r], r)):
        take = min(bins.cap[rank], length - start)
        if take > 0:
            bins.put(rank, DocPiece(doc, start, start + take))
            start += take
    assert start == length, "the row has room for every real token"


def _greedy(
    lengths: tuple[int, ...], order: list[int], cut: dict[int, int], cp: int, local_len: int
) -> tuple[tuple[DocPiece, ...], ...] | None:
    """Zig-zag the ``cut`` documents (``doc -> group size``), then place the rest by descending length.

    Returns ``None`` when a zig-zag does not fit.
    """
    bins = _Bins(cp, local_len)
    for doc in order:
        if doc in cut and not _zigzag(bins, doc, lengths[doc], cut[doc]):
            return None
    for doc in order:
        if doc not in cut:
            _place_whole_or_split(bins, doc, lengths[doc])
    return tuple(tuple(p) for p in bins.pieces)


def _joined(pieces: list[DocPiece]) -> list[DocPiece]:
    """A rank's pieces sorted by ``(doc, start)``, consecutive pieces of one document joined into one.

    The middle rank of a zig-zag group gets two adjacent chunks; as one piece they are one kernel
    segment whose keys are packed once (two segments would pack the shared prefix twice).
    """
    out: list[DocPiece] = []
    for p in sorted(pieces, key=lambda x: (x.doc, x.start)):
        if out and out[-1].doc == p.doc and out[-1].stop == p.start:
            out[-1] = DocPiece(p.doc, out[-1].start, p.stop)
        else:
            out.append(p)
    return out


def _local_first(pieces: Pieces) -> Pieces:
    """Each rank's pieces in local row order: those whose earlier keys all live on the rank first.

    A piece needs keys of other ranks when some earlier piece of its document lives elsewhere.
    With those pieces last, the rank's local-key and remote-key attention groups
    (:func:`~.metadata.plan_attention_groups`) are two contiguous runs of rows, so the
    runtime splits the queries and joins the outputs without any row gather or scatter.
    """
    owner = {(p.doc, p.start): rank for rank, ps in enumerate(pieces) for p in ps}
    firsts: dict[int, list[tuple[int, int]]] = {}
    for (doc, start), rank in owner.items():
        firsts.setdefault(doc, []).append((start, rank))

    def remote(rank: int, piece: DocPiece) -> bool:
        return any(start < piece.start and r != rank for start, r in firsts[piece.doc])

    return tuple(tuple(sorted(ps, key=lambda p, r=rank: remote(r, p))) for rank, ps in enumerate(pieces))


def _in_row_order(pieces: Pieces) -> Pieces:
    """The final placement's pieces per rank: adjacent pieces joined, local-key pieces first."""
    return _local_first(tuple(tuple(_joined(list(ps))) for ps in pieces))


def _group_size(length: int, cp: int, local_len: int, target_work: float) -> int:
    """Ranks to zig-zag a document over: enough for its tokens and its work, at least 2, at most ``cp``."""
    by_tokens = -(-length // local_len)
    by_work = -(-pair_count(0, length) // max(1, int(target_work)))
    return max(2, min(cp, max(by_tokens, by_work)))


Pieces = tuple[tuple[DocPiece, ...], ...]


def _fewest_cuts(
    lengths: tuple[int, ...], order: list[int], groups: dict[int, int], cp: int, local_len: int
) -> tuple[float, Pieces]:
    """Best placement cutting the fewest largest documents (with the given group sizes) that reaches the target.

    The count of cut documents is searched by doubling, then bisection; every
    candidate is one greedy pass.
    """
    cuttable = [d for d in order if lengths[d] >= 2 * groups[d]]

    def attempt(k: int) -> tuple[float, Pieces] | None:
        pieces = _greedy(lengths, order, {d: groups[d] for d in cuttable[:k]}, cp, local_len)
        return None if pieces is None else (balance([sum(p.work for p in ps) for ps in pieces]), pieces)

    best = attempt(0)
    assert best is not None, "placing whole documents is always feasible"
    if best[0] <= BALANCE_TARGET or not cuttable:
        return best
    k, low = 1, 0
    while True:
        result = attempt(k)
        if result is not None and result[0] < best[0]:
            best = result
        if (result is not None and result[0] <= BALANCE_TARGET) or k == len(cuttable):
            break
        low, k = k, min(2 * k, len(cuttable))
    high = k
    while high - low > 1 and best[0] <= BALANCE_TARGET:
        mid = (low + high) // 2
        result = attempt(mid)
        if result is not None and result[0] <= BALANCE_TARGET:
            best, high = result, mid
        else:
            low = mid
    return best


def balanced_pieces(runs: DocRuns, cp: int, local_len: int) -> Pieces:
    """Pieces of the balanced layout.

    Documents are cut zig-zag over the smallest groups of ranks their tokens and
    work require (see :func:`_group_size`); if no number of cut documents
    reaches the balance target with those groups, the groups are doubled (up to
    all ``cp`` ranks) and the search repeats. The best placement found is kept.
    """
    lengths = runs.lengths
    target = sum(pair_count(0, n) for n in lengths) / cp
    order = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))
    minimal = {d: _group_size(lengths[d], cp, local_len, target) for d in order}
    best: tuple[float, Pieces] | None = None
    scale = 1
    while True:
        result = _fewest_cuts(lengths, order, {d: min(cp, g * scale) for d, g in minimal.items()}, cp, local_len)
        if best is None or result[0] < best[0]:
            best = result
        if best[0] <= BALANCE_TARGET or all(g * scale >= cp for g in minimal.values()):
            return _in_row_order(best[1])
        scale *= 2


def make_shard_plan(runs: DocRuns, cp: int, layout: str = "contiguous") -> ShardPlan:
    """The :class:`ShardPlan` of a row padded to a multiple of ``cp``.

    Args:
        runs: Documents of the padded row (``runs.total_len % cp == 0``).
        cp: Number of CP ranks.
        layout: ``contiguous`` or ``balanced``.
    """
    if runs.total_len % cp:
        raise ValueError(f"row length {runs.total_len} is not a multiple of cp_size={cp}")
    local_len = runs.total_len // cp
    if layout == "contiguous" or cp == 1:
        pieces = contiguous_pieces(runs, cp, local_len)
    elif layout == "balanced":
        pieces = balanced_pieces(runs, cp, local_len)
    else:
        raise ValueError(f"Unknown layout {layout!r}. Valid values: {', '.join(LAYOUTS)}")
    return ShardPlan(runs, cp, local_len, layout if cp > 1 else "contiguous", pieces)

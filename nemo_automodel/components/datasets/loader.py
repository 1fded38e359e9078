"""The packed training (and validation) data for a config, and which row each dp rank trains on.

:func:`prepare_data` reads, converts, tokenizes and packs (one process, no cache);
the planner calls it too, so its rows are the recipe's rows. :func:`load_data` is
what the recipe's ranks call: file data is tokenized once into an on-disk cache
(:mod:`nemo_automodel.components.datasets.cache`) by rank 0 while the other ranks
wait, and every rank reads it.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from nemo_automodel.components.config.schema import DataConfig
from nemo_automodel.components.datasets.cache import DataCache
from nemo_automodel.components.datasets.documents import DocumentTable, DocumentTableBuilder
from nemo_automodel.components.datasets.formats import (
    Document,
    FormatStats,
    check_record,
    empty_answers,
    fit_conversation,
    records_to_documents,
    with_eos,
)
from nemo_automodel.components.datasets.packing import PackedData, PackedRows, pack_documents
from nemo_automodel.components.datasets.progress import progress
from nemo_automodel.components.datasets.sources import RecordLimit, read_records, resolve_files
from nemo_automodel.components.datasets.synthetic import synthetic_documents

logger = logging.getLogger("nemo_automodel.finetune")
T = TypeVar("T")
# Records converted together: their segments are tokenized in one batched call (a few hundred: the call's
# overhead is spread, the chunk's rows and strings stay small).
_CHUNK = 256


def eos_for(cfg: DataConfig, tokenizer: Any) -> int | None:
    """The EOS id appended to documents (``None`` with ``data.add_eos=false``)."""
    if not cfg.add_eos:
        return None
    if tokenizer.eos_id is None:
        raise ValueError(
            f"data.add_eos=true but the tokenizer {tokenizer.name} has no EOS token; use a tokenizer with an "
            "eos_token, or set data.add_eos=false (the model will then not learn where documents end)"
        )
    return tokenizer.eos_id


def to_documents(
    cfg: DataConfig, records: Iterable[tuple[str, dict[str, Any] | None]], tokenizer: Any, show: bool = False
) -> tuple[DocumentTable, FormatStats]:
    """Checked records as documents with EOS; chat/instruction rows fitted to ``seq_len`` per the policy.

    ``records`` are consumed as they come (read lazily, converted :data:`_CHUNK` at a time: their segments are
    tokenized in one batched call), and each document goes straight into a :class:`DocumentTable` (flat arrays,
    a few bytes a token). A ``None`` record is one over
    ``data.max_record_bytes`` that was dropped unread (counted).

    Raises:
        ValueError: naming the row, for a record the format or the length policy rejects.
    """
    eos = eos_for(cfg, tokenizer)
    if cfg.source == "chat" and not tokenizer.chat_template:
        tokenizer.render_chat([], add_generation_prompt=False)  # raises the no-template error, before any row
    docs = DocumentTableBuilder()
    stats = FormatStats()
    total = len(records) if isinstance(records, list) else None
    for chunk in _chunks(progress(records, "reading, rendering and tokenizing", show, total), _CHUNK):
        converted = iter(records_to_documents(cfg, [record for _, record in chunk if record is not None], tokenizer))
        for where, record in chunk:  # in record order: the first bad record is the one named
            stats.records += 1
            if record is None:
                stats.too_large += 1
                if len(stats.too_large_rows) < 3:
                    stats.too_large_rows.append(where)
                continue
            if cfg.source == "chat":
                _count_empty_answers(cfg, record[cfg.messages_field], where, stats)
            doc = next(converted)
            if isinstance(doc, ValueError):
                raise ValueError(f"{where}: {doc}") from None
            _add_document(cfg, doc, eos, where, docs, stats)
    if stats.empty_answers:
        logger.warning(
            "data: %d assistant answers are empty (e.g. %s): the model learns to end its turn there; fill them in "
            "or remove them, or set data.empty_answers=error to refuse them",
            stats.empty_answers,
            ", ".join(stats.empty_answer_rows[:3]),
        )
    return docs.build(), stats


def _add_document(
    cfg: DataConfig, doc: Document, eos: int | None, where: str, docs: DocumentTableBuilder, stats: FormatStats
) -> None:
    """Add ``doc`` with EOS, chat/instruction rows fitted to ``seq_len`` per ``data.long_conversations``."""
    if not doc.ids:
        stats.empty += 1
        return
    if cfg.source in ("synthetic", "text"):  # long text is split or truncated when packed
        docs.append(with_eos(doc, eos))
        return
    full = len(with_eos(doc, eos).ids)
    if full <= cfg.seq_len:
        docs.append(with_eos(doc, eos))
        return
    if cfg.long_conversations == "error":
        raise ValueError(
            f"{where}: {full} tokens, longer than data.seq_len={cfg.seq_len}; raise data.seq_len, or set "
            "data.long_conversations=leading_turns (keep the turns that fit) or drop"
        )
    fitted = fit_conversation(doc, cfg.seq_len, eos) if cfg.long_conversations == "leading_turns" else None
    if fitted is None:
        stats.dropped += 1
        stats.dropped_rows.append(where)
    else:
        stats.cut += 1
        docs.append(fitted)


def _chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """``items`` in lists of ``size``; an error while reading comes after the items read before it."""
    chunk: list[T] = []
    try:
        for item in items:
            chunk.append(item)
            if len(chunk) == size:
                yield chunk
                chunk = []
    except Exception:
        if chunk:
            yield chunk  # earlier rows first: their errors are named before the reader's
        raise
    if chunk:
        yield chunk


def _count_empty_answers(cfg: DataConfig, messages: list[dict[str, Any]], where: str, stats: FormatStats) -> None:
    """Count a conversation's empty assistant answers, or refuse the first under ``data.empty_answers=error``."""
    empty = empty_answers(messages)
    if empty and cfg.empty_answers == "error":
        raise ValueError(
            f"{where}: message {empty[0]} (assistant) is empty: the model would learn to end its turn at once; "
            "fill it in or remove the row, or set data.empty_answers=warn to train on it"
        )
    stats.empty_answers += len(empty)
    if empty and len(stats.empty_answer_rows) < 3:
        stats.empty_answer_rows.append(where)


def _records(cfg: DataConfig, path: str, split: str | None, field: str, scratch: Path):
    if cfg.source == "synthetic":
        return (("synthetic", {cfg.text_field: t}) for t in synthetic_documents(cfg))
    files = resolve_files(path, split, field)
    limit = RecordLimit(cfg.max_record_bytes, cfg.long_records)
    return read_records(files, scratch, lambda record: check_record(cfg, record), limit, field)


def _hold_out(docs: DocumentTable, fraction: float, seed: int) -> tuple[DocumentTable, DocumentTable]:
    """``(train, validation)``: a seeded ``fraction`` of the documents held out (at least one each), in order."""
    count = max(1, round(fraction * len(docs)))
    if count >= len(docs):
        raise ValueError(
            f"data.validation={fraction} holds out {count} of {len(docs)} documents, leaving none to train on; "
            "lower the fraction or pass a validation file"
        )
    held = np.zeros(len(docs), np.bool_)
    held[torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed))[:count].numpy()] = True
    return docs.subset(~held), docs.subset(held)


def _require_documents(cfg: DataConfig, docs: DocumentTable, stats: FormatStats, what: str) -> None:
    """Say why nothing is left (e.g. every record too long) before anything else is done with no documents."""
    if not len(docs):
        raise ValueError(f"{what}: no documents left ({stats.summary(cfg)}); raise data.seq_len or check the data")


def _pack(
    cfg: DataConfig, docs: DocumentTable, stats: FormatStats, tokenizer: Any, what: str, show: bool
) -> PackedRows:
    _require_documents(cfg, docs, stats, what)
    rows = pack_documents(
        docs,
        cfg.seq_len,
        cfg.packing_algorithm,
        tokenizer.pad_id,
        cfg.seed,
        cfg.long_documents,
        lambda lengths: progress(lengths, f"packing {what}", show, len(lengths)),
    )
    if not bool((rows.labels != -100).any()):
        raise ValueError(f"{what}: no token carries loss; check data.loss_on and the data")
    return rows


def prepare_data(cfg: DataConfig, tokenizer: Any, scratch: Path | None = None, show: bool = True) -> PackedData:
    """Read (or generate), convert, tokenize and pack the training and validation data (no cache).

    Args:
        cfg: The data section.
        tokenizer: A :class:`~nemo_automodel.components.datasets.tokenizer.TextTokenizer`.
        scratch: Scratch space for ``datasets``' Arrow copies (``None``: a temporary directory).
        show: Progress bars for phases longer than :data:`~.progress.PROGRESS_AFTER_S` (rank 0 only in a job).

    Raises:
        ValueError: naming the field, file and row of bad data.
    """
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        records = _records(cfg, cfg.path or "", cfg.split, "data.path", Path(tmp))
        docs, stats = to_documents(cfg, records, tokenizer, show)
        if not stats.records:
            raise ValueError(f"data.path={cfg.path}: no documents found (expected one JSON object per line / row)")
        _require_documents(cfg, docs, stats, "data")  # not "holds out 1 of 0 documents" when all were dropped
        held: DocumentTable | None = None
        held_stats = stats
        fraction = cfg.validation_fraction
        if fraction is not None:
            docs, held = _hold_out(docs, fraction, cfg.seed)
        elif cfg.validation is not None:
            val_records = _records(cfg, cfg.validation, None, "data.validation", Path(tmp))
            held, held_stats = to_documents(cfg, val_records, tokenizer, show)
    train = _pack(cfg, docs, stats, tokenizer, "data", show)
    validation = None if held is None else _pack(cfg, held, held_stats, tokenizer, "data.validation", show)
    summary = f"{stats.summary(cfg)}; {len(docs)} training documents"
    if held is not None:
        summary += f", {len(held)} validation documents"
        if held_stats is not stats:
            summary += f" (validation file: {held_stats.summary(cfg)})"
    return PackedData(train, validation, summary)


def load_data(cfg: DataConfig, tokenizer: Any, is_main: bool, store: Any) -> PackedData:
    """The packed data on every rank: file data through the on-disk cache (rank 0 builds it), synthetic in memory.

    Args:
        cfg: The data section.
        tokenizer: The run's tokenizer (part of the cache key).
        is_main: Global rank 0 (builds the cache when it is missing).
        store: The job's c10d store (rank 0 posts the outcome there; the others wait for it).
    """
    if cfg.source == "synthetic":
        return prepare_data(cfg, tokenizer, show=is_main)
    return DataCache.for_config(cfg, tokenizer).load(
        lambda scratch: prepare_data(cfg, tokenizer, scratch), is_main, store
    )


def rows_for_rank(rows: PackedRows, dp: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """Validation rows ``dp_rank, dp_rank + dp, ...``, topped up to ``ceil(N / dp)`` with a label-free row.

    Every dp rank must run the same number of forwards (FSDP gathers parameters in each);
    the top-up row is row 0 with every label ``-100``, so it adds nothing to the loss.
    """
    mine = [rows.row(i) for i in range(dp_rank, len(rows), dp)]
    first = rows.row(0)  # int64 fields: the stored int32 ones would reach the loss as int32 targets
    filler = {**first, "labels": torch.full_like(first["labels"], -100)}
    return mine + [filler] * (-(-len(rows) // dp) - len(mine))


@dataclass(frozen=True)
class RowSchedule:
    """Deterministic row order: a fresh seeded permutation per epoch, rows dealt out round-robin to dp ranks.

    The data position is a pure function of the step, so a checkpoint only needs
    the step (``rows_consumed`` is recorded to detect a changed ``dp * grad_accum``).
    CP ranks of one dp rank get the same row (the CP batch builder shards it).
    """

    num_rows: int
    dp_size: int
    grad_accum: int
    seed: int

    @property
    def rows_per_step(self) -> int:
        return self.dp_size * self.grad_accum

    def row_index(self, step: int, micro: int, dp_rank: int) -> int:
        """Dataset row for 0-based optimizer ``step``, micro-batch ``micro`` and ``dp_rank``."""
        slot = (step * self.grad_accum + micro) * self.dp_size + dp_rank
        epoch, offset = divmod(slot, self.num_rows)
        order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + epoch))
        return int(order[offset])

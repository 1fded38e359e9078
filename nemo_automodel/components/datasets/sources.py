"""Local data files (json, jsonl, parquet, arrow) read with Hugging Face ``datasets``, record by record.

``data.path`` is a file, a directory or a glob pattern. A directory holds one
format; its files are split by name the way ``datasets`` does (``train.jsonl``,
``validation-00000-of-00002.parquet``, ``test/...``): ``data.split`` picks one, and
without it the ``train`` files are used, or every file when none is named after a split.
The hub is never contacted: only the packaged ``json``/``parquet``/``arrow`` builders run.
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Read size for skipping the rest of an over-long line (and for peeking at a file's first bytes).
_SKIP_CHUNK = 1 << 20
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
# Split names and their synonyms, as file and directory names carry them (datasets' conventions).
SPLIT_SYNONYMS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}


def _split_of(relative: Path) -> str | None:
    """The split a file belongs to by its name (``None``: no split name in it)."""
    words = set(re.split(r"[^a-z0-9]+", str(relative).lower()))
    for split, names in SPLIT_SYNONYMS.items():
        if words & set(names):
            return split
    return None


def _directory_files(directory: Path, split: str | None, field: str) -> list[Path]:
    files = sorted(
        f
        for f in directory.rglob("*")
        if f.is_file() and f.suffix in BUILDERS and not any(p.startswith(".") for p in f.relative_to(directory).parts)
    )
    if not files:
        raise ValueError(f"{field}={directory}: no {', '.join(BUILDERS)} files in this directory")
    splits = {f: _split_of(f.relative_to(directory)) for f in files}
    wanted = _split_of(Path(split)) or split if split else "train"
    if not any(splits.values()) and wanted == "train":
        return files  # no file is named after a split: all of them are the training split
    chosen = [f for f in files if splits[f] == wanted]
    if not chosen:
        found = sorted({s for s in splits.values() if s})
        raise ValueError(
            f"{field}={directory}: no files of split {wanted!r} (found: {', '.join(found) or 'no split names'}); "
            "set data.split to one of them"
        )
    return chosen


def resolve_files(path: str, split: str | None, field: str = "data.path") -> list[Path]:
    """The data files ``path`` names (a file, a directory or a glob), all of one format.

    Raises:
        ValueError: naming ``field`` when nothing matches, formats mix or a split cannot apply.
    """
    target = Path(path)
    if target.is_dir():
        files = _directory_files(target, split, field)
    else:
        files = [target] if target.is_file() else sorted(Path(p) for p in glob.glob(path, recursive=True))
        files = [f for f in files if f.is_file()]
        if not files:
            raise ValueError(f"{field}={path}: no such file, directory or glob match")
        if split is not None:
            raise ValueError(
                f"data.split={split} selects files of a directory by name, but {field}={path} names files; "
                "drop data.split or point the path at the directory"
            )
    unknown = [f.name for f in files if f.suffix not in BUILDERS]
    if unknown:
        raise ValueError(f"{field}={path}: {unknown[0]} is not one of {', '.join(BUILDERS)}")
    kinds = sorted({BUILDERS[f.suffix] for f in files})
    if len(kinds) > 1:
        raise ValueError(f"{field}={path} mixes formats ({', '.join(kinds)}); use files of one format")
    return files


def _bounded_lines(path: Path, limit: int) -> Iterator[tuple[int, bytes | int]]:
    """``(line, bytes without the newline)`` of a file, or ``(line, its size)`` for a line over ``limit`` bytes.

    Read with ``readline(limit + 1)``: a longer line is never held whole (its rest is skipped in 1 MiB reads),
    so memory stays bounded by ``limit`` whatever the file holds.
    """
    with path.open("rb") as f:
        for line_no in itertools.count(1):
            line = f.readline(limit + 1)
            if not line:
                return
            if line.endswith(b"\n"):
                yield line_no, line[:-1]
            elif len(line) <= limit:  # the last line, without a newline
                yield line_no, line
            else:
                size = len(line)
                while line and not line.endswith(b"\n"):
                    line = f.readline(_SKIP_CHUNK)
                    size += len(line)
                yield line_no, size - line.endswith(b"\n")


def _is_json_lines(path: Path) -> bool:
    """Whether a ``.json``/``.jsonl`` file is JSON Lines (not one JSON array), from its first non-blank byte."""
    with path.open("rb") as f:
        while chunk := f.read(_SKIP_CHUNK):
            stripped = chunk.lstrip()
            if stripped:
                return not stripped.startswith(b"[")
    return True


def _scan_json(path: Path, field: str, limit: int) -> Iterator[tuple[int, Any]]:
    """``(line, object)`` of a JSON Lines file (or ``(i, item)`` of a JSON array), raising on bad JSON.

    JSON Lines are read line by line (lines over ``limit`` bytes are skipped: they were dropped or refused).
    """
    if not _is_json_lines(path):
        try:
            items = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{field}={path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}={path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        yield from enumerate(items, start=1)
        return
    for line_no, line in _bounded_lines(path, limit):
        if isinstance(line, int) or not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{field}={path}: line {line_no} is not valid UTF-8 (byte 0x{line[exc.start]:02x}); "
                "re-encode the file as UTF-8 (e.g. iconv -f <its encoding> -t UTF-8)"
            ) from None
        try:
            yield line_no, json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}={path}: line {line_no} is not valid JSON ({exc.msg})") from None
        except _DuplicateKeyError as exc:
            raise ValueError(f"{field}={path}: line {line_no} {exc}; keep one of them") from None


class _DuplicateKeyError(ValueError):
    """A JSON object that names one key twice (``json`` would keep the last silently; Arrow refuses it)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise _DuplicateKeyError(f"has the key {key!r} twice")
    return dict(pairs)


def _load(path: Path, cache_dir: Path) -> Any:
    """One file as a ``datasets.Dataset`` (its Arrow copy goes to ``cache_dir``)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)  # its own error lines would repeat ours
    return datasets.load_dataset(BUILDERS[path.suffix], data_files=[str(path)], split="train", cache_dir=str(cache_dir))


@dataclass(frozen=True)
class RecordLimit:
    """``data.max_record_bytes`` and ``data.long_records`` (``drop`` or ``error``): see ``DataConfig``."""

    max_bytes: int
    policy: str

    def refuse(self, where: str, size: int) -> None:
        """Raise for a record of ``size`` bytes at ``where`` under ``error``; return under ``drop``."""
        if self.policy == "error":
            raise ValueError(
                f"{where} is {size} bytes, more than data.max_record_bytes={self.max_bytes}; raise "
                "data.max_record_bytes, or set data.long_records=drop to skip such records (they are counted)"
            )


def _without_long_lines(path: Path, scratch: Path, limit: RecordLimit, where: str) -> tuple[Path, list[int], list[int]]:
    """``(file to load, the original line of each of its rows, dropped lines)`` for a JSON Lines file.

    The lines are measured before anything parses them. Without long lines the file itself is loaded
    (``[]``: rows are counted as they come); otherwise a copy of its other non-blank lines, written to ``scratch``.
    """
    long = []
    for line_no, line in _bounded_lines(path, limit.max_bytes):
        if isinstance(line, int):
            limit.refuse(f"{where}: line {line_no}", line)
            long.append(line_no)
    if not long:
        return path, [], []
    copy = scratch / f"within-limit-{len(list(scratch.iterdir()))}.jsonl"
    kept = []
    with copy.open("wb") as out:
        for line_no, line in _bounded_lines(path, limit.max_bytes):
            if not isinstance(line, int) and line.strip():
                out.write(line + b"\n")
                kept.append(line_no)
    return copy, kept, long


def _array_bytes(array: Any) -> np.ndarray:
    """Each element's data size in bytes ``[len(array)]``: string lengths and fixed widths, summed through
    lists and structs (Arrow's own buffers, never Python objects)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    is_ = pa.types
    if is_.is_string(kind) or is_.is_large_string(kind) or is_.is_binary(kind) or is_.is_large_binary(kind):
        return pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if is_.is_list(kind) or is_.is_large_list(kind):
        inner = np.concatenate([[0], np.cumsum(_array_bytes(array.values))])
        offsets = array.offsets.to_numpy()
        return (inner[offsets[1:]] - inner[offsets[:-1]]).astype(np.int64)
    if is_.is_struct(kind):
        return sum((_array_bytes(child) for child in array.flatten()), np.zeros(len(array), np.int64))
    try:
        return np.full(len(array), max(kind.bit_width // 8, 1), np.int64)
    except ValueError:  # no fixed width (null, dictionary, ...): no payload worth bounding
        return np.zeros(len(array), np.int64)


def row_bytes(table: Any) -> np.ndarray:
    """The data size of each row of a ``pyarrow.Table`` in bytes, ``[num_rows]``."""
    total = np.zeros(table.num_rows, np.int64)
    for column in table.columns:
        if column.num_chunks:
            total += np.concatenate([_array_bytes(chunk) for chunk in column.chunks])
    return total


def read_records(
    files: list[Path], cache_dir: Path, check: Any, limit: RecordLimit, field: str = "data.path"
) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """``(where, record)`` for every row of ``files`` in order; ``where`` is ``"<field>=<file>: row <n>"``
    (``line <n>`` once a JSON Lines file lost a line). A record over ``limit`` is ``(where, None)`` under
    ``drop``: counted, never parsed.

    Args:
        files: From :func:`resolve_files`.
        cache_dir: Scratch space for ``datasets``' Arrow copies (and copies of JSON Lines without long lines).
        check: ``check(record)`` raising a ``ValueError`` for a malformed record.
        limit: The record size limit and what to do beyond it.
        field: The config field that named the files (for messages).

    Raises:
        ValueError: naming the file and row (or line) of the first bad record, or why a file is unreadable.
    """
    for path in files:
        where = f"{field}={path}"
        source, lines, dropped = path, [], []
        if path.suffix in (".json", ".jsonl") and _is_json_lines(path):
            source, lines, dropped = _without_long_lines(path, cache_dir, limit, where)
        yield from ((f"{where}: line {n}", None) for n in dropped)
        if dropped and not lines:  # nothing but long lines (and blank ones): nothing to load
            continue
        try:
            table = _load(source, cache_dir)
        except Exception as exc:  # pyarrow / datasets errors: find the exact line when it is JSON
            if path.suffix in (".json", ".jsonl"):
                scanned = 0
                for line_no, record in _scan_json(path, field, limit.max_bytes):
                    _checked(check, record, f"{where}: line {line_no}")
                    scanned += 1
                if not scanned and not dropped:
                    raise ValueError(f"{where}: no documents found (expected one JSON object per line)") from None
            cause = exc.__cause__ or exc
            raise ValueError(f"{where}: could not be read as {BUILDERS[path.suffix]} ({cause})") from None
        unit, numbers = "line", lines
        if not lines:  # parquet, arrow, a JSON array: measure each row in Arrow, before it becomes Python objects
            sizes = row_bytes(table.data.table)
            over = np.flatnonzero(sizes > limit.max_bytes)
            for row in over:
                limit.refuse(f"{where}: row {row + 1}", int(sizes[row]))
            yield from ((f"{where}: row {row + 1}", None) for row in over)
            unit, numbers = "row", None
            if len(over):
                kept = np.setdiff1d(np.arange(len(sizes)), over)
                table, numbers = table.select(kept), (kept + 1).tolist()
        names = _RowNames(where, unit, numbers)
        for index, record in enumerate(_decoded_rows(table, names)):
            _checked(check, record, names[index])
            yield names[index], record


@dataclass(frozen=True)
class _RowNames:
    """``"<where>: <unit> <n>"`` for the ``index``-th row read: ``n`` from ``numbers`` (``None``: ``index + 1``)."""

    where: str
    unit: str
    numbers: list[int] | None

    def __getitem__(self, index: int) -> str:
        return f"{self.where}: {self.unit} {index + 1 if self.numbers is None else self.numbers[index]}"


def _decoded_rows(table: Any, names: _RowNames) -> Iterator[dict[str, Any]]:
    """The table's rows; a string that is not UTF-8 (Arrow keeps the bytes, decoding fails on access) is named."""
    rows = iter(table)
    for index in itertools.count():
        try:
            yield next(rows)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{names[index]} is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x}); re-encode the file "
                "as UTF-8 (e.g. iconv -f <its encoding> -t UTF-8)"
            ) from None


def _checked(check: Any, record: Any, where: str) -> None:
    try:
        check(record)
    except ValueError as exc:
        raise ValueError(f"{where} {exc}") from None

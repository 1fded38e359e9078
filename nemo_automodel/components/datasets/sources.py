"""Local data files (json, jsonl, parquet, arrow) read with Hugging Face ``datasets``, record by record.

``data.path`` is a file, a directory or a glob pattern. A directory holds one
format; its files are split by name the way ``datasets`` does (``train.jsonl``,
``validation-00000-of-00002.parquet``, ``test/...``): ``data.split`` picks one, and
without it the ``train`` files are used, or every file when none is named after a split.
The hub is never contacted: only the packaged ``json``/``parquet``/``arrow`` builders run.
"""

from __future__ import annotations

import glob
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def _scan_json(path: Path, field: str) -> Iterator[tuple[int, Any]]:
    """``(line, object)`` of a JSON Lines file (or ``(i, item)`` of a JSON array), raising on bad JSON."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_no = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{field}={path}: line {line_no} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "re-encode the file as UTF-8 (e.g. iconv -f <its encoding> -t UTF-8)"
        ) from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}={path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        yield from enumerate(items, start=1)
        return
    for line_no, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                yield line_no, json.loads(line, object_pairs_hook=_unique_keys)
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


def read_records(
    files: list[Path], cache_dir: Path, check: Any, field: str = "data.path"
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for every row of ``files`` in order; ``where`` is ``"<field>=<file>: row <n>"``.

    Args:
        files: From :func:`resolve_files`.
        field: The config field that named the files (for messages).
        cache_dir: Scratch space for ``datasets``' Arrow copies.
        check: ``check(record)`` raising a ``ValueError`` for a malformed record.

    Raises:
        ValueError: naming the file and row (or line) of the first bad record, or why a file is unreadable.
    """
    for path in files:
        try:
            table = _load(path, cache_dir)
        except Exception as exc:  # pyarrow / datasets errors: find the exact line when it is JSON
            if path.suffix in (".json", ".jsonl"):
                scanned = 0
                for line_no, record in _scan_json(path, field):
                    _checked(check, record, f"{field}={path}: line {line_no}")
                    scanned += 1
                if not scanned:
                    raise ValueError(
                        f"{field}={path}: no documents found (expected one JSON object per line)"
                    ) from None
            cause = exc.__cause__ or exc
            raise ValueError(f"{field}={path}: could not be read as {BUILDERS[path.suffix]} ({cause})") from None
        for row, record in enumerate(_decoded_rows(table, f"{field}={path}"), start=1):
            where = f"{field}={path}: row {row}"
            _checked(check, record, where)
            yield where, record


def _decoded_rows(table: Any, where: str) -> Iterator[dict[str, Any]]:
    """The table's rows; a string that is not UTF-8 (Arrow keeps the bytes, decoding fails on access) is named."""
    rows = iter(table)
    row = 0
    while True:
        row += 1
        try:
            yield next(rows)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{where}: row {row} is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x}); re-encode the file "
                "as UTF-8 (e.g. iconv -f <its encoding> -t UTF-8)"
            ) from None


def _checked(check: Any, record: Any, where: str) -> None:
    try:
        check(record)
    except ValueError as exc:
        raise ValueError(f"{where} {exc}") from None

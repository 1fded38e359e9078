"""Tokenize once: packed data cached on disk, keyed by the data files, the tokenizer and the data config.

Layout under ``data.cache_dir`` (default ``~/.cache/nemo_automodel/data``)::

    <key>/packed.pt     train (and validation) rows: input_ids, labels, position_ids, seq_ids [N, S]
    <key>/info.json     what the key covers and what conversion did (for humans)
    .tmp-<key>-<pid>/   an entry being written (renamed to <key> when complete)

The key hashes every data file's path, size and modification time, the tokenizer's
fingerprint (vocabulary, special tokens, chat template) and every data field but
``cache_dir``; any change makes a new entry. In a job, global rank 0 builds a
missing entry and posts the outcome in the c10d store; the other ranks wait for
it (outside any collective, so a long build cannot trip the process-group
timeout) and read the same file, which must therefore be on a file system
every node sees.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from nemo_automodel.components.config.errors import InputError
from nemo_automodel.components.config.schema import DataConfig
from nemo_automodel.components.datasets.packing import PackedData, PackedRows
from nemo_automodel.components.datasets.progress import progress
from nemo_automodel.components.datasets.sources import resolve_files

CACHE_VERSION = 2  # 2: the packed fields are int32 (packing.PACKED_DTYPE)
DATA_FILE = "packed.pt"
DEFAULT_CACHE_DIR = Path("~/.cache/nemo_automodel/data")
_FIELDS = ("input_ids", "labels", "position_ids", "seq_ids")
_POLL_S = 0.2
_TMP_PREFIX = ".tmp-"

logger = logging.getLogger("nemo_automodel.finetune")


def _file_entries(cfg: DataConfig) -> list[tuple[str, int, int]]:
    files = resolve_files(cfg.path or "", cfg.split)
    if cfg.validation is not None and cfg.validation_fraction is None:
        files += resolve_files(cfg.validation, None, "data.validation")
    return [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def cache_key(cfg: DataConfig, tokenizer: Any) -> str:
    """The entry name for ``cfg``'s files, ``tokenizer`` and data config (module docstring)."""
    settings = {k: v for k, v in asdict(cfg).items() if k != "cache_dir"}
    payload = {
        "version": CACHE_VERSION,
        "data": settings,
        "tokenizer": tokenizer.fingerprint(),
        "files": _file_entries(cfg),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def _rows_to_dict(rows: PackedRows | None) -> dict[str, torch.Tensor] | None:
    if rows is None:
        return None
    return dict(zip(_FIELDS, (rows.input_ids, rows.labels, rows.position_ids, rows.seq_ids)))


class _CountedWrites:
    """A binary file whose writes advance a progress bar (``torch.save`` streams its archive through ``write``)."""

    def __init__(self, file: BinaryIO, bar: Any) -> None:
        self._file, self._bar = file, bar

    def write(self, data: bytes) -> int:
        self._bar.update(len(data))
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()


def _save(data: PackedData, path: Path) -> None:
    """Write ``data`` to ``path`` with a progress bar (``data: writing the cache``) once it takes a few seconds."""
    saved = {"train": _rows_to_dict(data.train), "validation": _rows_to_dict(data.validation)}
    size = sum(t.nbytes for rows in saved.values() if rows is not None for t in rows.values())
    with path.open("wb") as file, progress(None, "writing the cache", True, size, unit="B") as bar:
        torch.save({**saved, "summary": data.summary}, _CountedWrites(file, bar))


def _rows_from_dict(tensors: dict[str, torch.Tensor] | None) -> PackedRows | None:
    return None if tensors is None else PackedRows(*(tensors[name] for name in _FIELDS))


@dataclass(frozen=True)
class DataCache:
    """One cache entry: ``root / key``."""

    root: Path
    key: str

    @classmethod
    def for_config(cls, cfg: DataConfig, tokenizer: Any) -> DataCache:
        root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else DEFAULT_CACHE_DIR.expanduser()
        return cls(root, cache_key(cfg, tokenizer))

    @property
    def path(self) -> Path:
        return self.root / self.key

    def exists(self) -> bool:
        return (self.path / DATA_FILE).is_file()

    def read(self) -> PackedData:
        """The entry's data; the tensors are memory-mapped (every rank shares the page cache)."""
        saved = torch.load(self.path / DATA_FILE, mmap=True, weights_only=True)
        return PackedData(_rows_from_dict(saved["train"]), _rows_from_dict(saved["validation"]), saved["summary"])

    def write(self, build: Callable[[Path], PackedData]) -> PackedData:
        """Build the data (``build(scratch_dir)``) and publish it atomically as this entry."""
        self.root.mkdir(parents=True, exist_ok=True)
        _remove_dead_builds(self.root)
        tmp = self.root / f"{_TMP_PREFIX}{self.key}-{socket.gethostname()}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            data = build(tmp)
            _save(data, tmp / DATA_FILE)
            info = {"key": self.key, "summary": data.summary, "rows": len(data.train), "written": time.time()}
            (tmp / "info.json").write_text(json.dumps(info, indent=1) + "\n")
            if self.exists():  # another job wrote the same entry meanwhile: keep theirs
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, self.path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return data

    def load(self, build: Callable[[Path], PackedData], is_main: bool, store: Any) -> PackedData:
        """Collective over the store: rank 0 builds the entry when missing, every rank reads it.

        Raises:
            ValueError: on every rank, with rank 0's message, when the data is bad.
        """
        signal = f"nemo_automodel/data/{self.path}"
        if is_main:
            try:
                if self.exists():
                    logger.info("data: reusing the tokenized cache %s", self.path)
                else:
                    logger.info("data: tokenizing and packing into the cache %s (once; later runs reuse it)", self.path)
                    self.write(build)
            except ValueError as exc:
                store.set(signal, f"input:{exc}")
                raise
            except Exception as exc:
                store.set(signal, f"other:{type(exc).__name__}: {exc}")
                raise
            store.set(signal, "ok")
        else:
            outcome = _wait(store, signal)
            kind, _, message = outcome.partition(":")
            if kind == "input":
                raise InputError(message, echo=True)  # rank 0 reports it
            if kind == "other":
                raise RuntimeError(f"rank 0 failed while preparing the data: {message}")
            if not self.exists():
                raise ValueError(
                    f"data.cache_dir={self.root}: rank 0 wrote {self.path}, but this rank cannot see it; put "
                    "data.cache_dir on a file system every node shares"
                )
        return self.read()


def _remove_dead_builds(root: Path) -> None:
    """Remove the temp dirs of builds on this host whose process is gone (killed, e.g. out of memory).

    Named ``.tmp-<key>-<host>-<pid>``: a build on another host (a shared cache dir) is never touched.
    """
    host = socket.gethostname()
    for tmp in root.glob(f"{_TMP_PREFIX}*-{host}-*"):
        pid = tmp.name.rsplit("-", 1)[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
            logger.info("removed %s, left by a data build that was killed", tmp)
        except PermissionError:  # alive, another user's
            pass


def _wait(store: Any, key: str) -> str:
    """Rank 0's outcome under ``key``, polled (no store timeout: a large corpus may take long to tokenize)."""
    while not store.check([key]):
        time.sleep(_POLL_S)
    return store.get(key).decode()

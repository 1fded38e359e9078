"""Checkpoint manifests: a SHA-256 and size per file, written last, verified before a resume loads.

``manifest.json`` is the last file written into a checkpoint's temp dir, after every rank's files
are there and just before the atomic rename that publishes the checkpoint, so every ``step_*``
directory carries the manifest of exactly its files (a manifest written after the rename would leave
a window in which a complete-looking checkpoint has none). Hashing is split over the ranks (file
``i`` of the sorted list on rank ``i % world``): each rank reads only its share.

On resume the newest checkpoint is verified; a damaged one (a file missing, of another size, with
another hash, a manifest or trainer state that does not parse) is named with the check that failed
and moved aside to ``damaged-step_*`` (kept for inspection, never loaded again), and the next newest
is tried: a requeue never crash-loops on one bad checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger("nemo_automodel.finetune")

MANIFEST = "manifest.json"
DAMAGED_PREFIX = "damaged-"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)


def _hash_share(directory: Path, names: list[str]) -> dict[str, dict[str, int | str]]:
    """Collective: ``{name: {size, sha256}}`` of every file in ``names``, each hashed by one rank."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    own = {}
    for name in names[rank::world]:
        path = directory / name
        own[name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    if world == 1:
        return own
    shares: list[dict[str, dict[str, int | str]]] = [{} for _ in range(world)]
    dist.all_gather_object(shares, own)
    return {name: entry for share in shares for name, entry in share.items()}


def write_manifest(directory: Path, rank: int) -> None:
    """Collective, after every rank's files are in ``directory``: rank 0 writes its manifest (durably)."""
    entries = _hash_share(directory, _files(directory))
    if rank == 0:
        path = directory / MANIFEST
        with open(path, "w") as out:
            out.write(json.dumps({"files": entries}, indent=1, sort_keys=True) + "\n")
            out.flush()
            os.fsync(out.fileno())


def _listing_damage(directory: Path) -> str | None:
    """What the manifest and the directory listing alone show is wrong (no file is read but the manifest)."""
    try:
        expected = json.loads((directory / MANIFEST).read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"{directory / MANIFEST}: unreadable manifest ({exc})"
    missing = sorted(set(expected) - set(_files(directory)))
    if missing:
        return f"{directory / missing[0]}: missing (listed in {MANIFEST})"
    for name, entry in sorted(expected.items()):
        size = (directory / name).stat().st_size
        if size != entry["size"]:
            return f"{directory / name}: size {size} bytes, the manifest says {entry['size']} (truncated?)"
    return None


def damage(directory: Path) -> str | None:
    """Collective: what is wrong with the checkpoint ``directory`` (file and failed check), or ``None``.

    Rank 0's listing checks are broadcast, so every rank takes the same branch (and the same collectives)
    even on a file system that shows the ranks different states for a moment. A checkpoint without a
    manifest (written before manifests existed) passes with a warning.
    """
    if not (directory / MANIFEST).is_file():
        logger.warning("%s has no %s (an older checkpoint): loading it unverified", directory, MANIFEST)
        return None
    found = [_listing_damage(directory)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        return found[0]
    expected = json.loads((directory / MANIFEST).read_text())["files"]
    actual = _hash_share(directory, sorted(expected))
    for name, entry in sorted(expected.items()):
        if actual[name]["sha256"] != entry["sha256"]:
            return f"{directory / name}: SHA-256 differs from the manifest's (the file's contents changed)"
    return None


def set_aside(directory: Path) -> Path:
    """Rank 0: rename a damaged checkpoint to ``damaged-<name>`` (not a checkpoint any more, kept to inspect)."""
    aside = directory.with_name(f"{DAMAGED_PREFIX}{directory.name}")
    n = 1
    while aside.exists():
        aside, n = directory.with_name(f"{DAMAGED_PREFIX}{directory.name}.{n}"), n + 1
    os.replace(directory, aside)
    return aside

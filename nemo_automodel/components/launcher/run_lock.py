"""One run per run dir: an exclusive lock file the launcher holds for the whole run.

``<run_dir>/run.lock`` is created with ``O_CREAT | O_EXCL`` (atomic on local file systems and on
NFSv3+, unlike ``flock``, which NFS may not honour across hosts) and holds the holder's host, pid,
the pid's start time (``/proc/<pid>/stat``; tells a live holder from a recycled pid) and the wall
time it started. A second run on the same dir fails at start naming the holder.

A lock whose holder is gone is stale and taken over with a warning: on the same host, when its pid
is not running or now belongs to a process that started at another time. A lock from another
host cannot be checked from here: it is refused, and the message says how to remove it by hand.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunDirInUseError(ValueError):
    """Another live run holds the run dir's lock (an input error: the user picks another dir)."""


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (``/proc/<pid>/stat`` field 22), or ``None``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after "(comm)" start at field 3


def _holder() -> dict[str, object]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _start_ticks(pid), "started": time.time()}


def _alive(holder: dict[str, object]) -> bool:
    """Whether the holder (on this host) still runs: its pid exists and started when the lock says."""
    pid = int(holder["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    recorded, now = holder.get("pid_start"), _start_ticks(pid)
    return recorded is None or now is None or recorded == now


def _describe(holder: dict[str, object]) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started", 0))))
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {started}"


def _try_create(path: Path, holder: dict[str, object]) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(holder) + "\n")
        out.flush()
        os.fsync(out.fileno())
    return True


def _read(path: Path) -> dict[str, object] | None:
    """The lock's holder, or ``None`` when the file vanished or is still being written."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return {}


def acquire(run_dir: Path) -> dict[str, object]:
    """Take ``run_dir``'s lock; return what it records.

    Raises:
        RunDirInUseError: a live run (or one on another host) holds it; the message names the holder.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path, me = run_dir / LOCK_FILE, _holder()
    for _ in range(3):  # a stale lock removed under us by a concurrent start: try again
        if _try_create(path, me):
            return me
        holder = _read(path)
        if holder is None:
            continue
        if not holder:
            time.sleep(0.2)  # created but not yet written: read it again
            holder = _read(path) or {}
        same_host = holder.get("host") == me["host"]
        if holder and same_host and not _alive(holder):
            logger.warning("run dir %s: taking over the stale lock of a finished run (%s)", run_dir, _describe(holder))
            path.unlink(missing_ok=True)
            continue
        where = "" if same_host or not holder else " (on another host: it cannot be checked from here)"
        raise RunDirInUseError(
            f"run dir {run_dir} is in use by another run: {_describe(holder) if holder else 'unreadable lock'}"
            f"{where}; wait for it to finish or pass a new hydra.run.dir. If that run is gone, delete {path}"
        )
    raise RunDirInUseError(f"run dir {run_dir}: could not take {path} (runs starting at the same time); retry")


def release(run_dir: Path, holder: dict[str, object]) -> None:
    """Remove the lock if it is still the one ``holder`` took."""
    path = run_dir / LOCK_FILE
    if _read(path) == json.loads(json.dumps(holder)):
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def hold_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the block (module docstring)."""
    holder = acquire(run_dir)
    try:
        yield
    finally:
        release(run_dir, holder)

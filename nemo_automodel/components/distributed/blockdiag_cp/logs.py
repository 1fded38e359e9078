"""The one log-once helper of the package (warn-once flags live here, not in every module)."""

from __future__ import annotations

import logging
import threading

_SEEN: set[str] = set()
_LOCK = threading.Lock()


def log_once(logger: logging.Logger, key: str, level: int, msg: str, *args: object) -> bool:
    """Log ``msg % args`` the first time ``key`` is seen in this process.

    A key already seen costs one set lookup (no lock): the lock only orders two threads that see a new key at once.

    Returns:
        True when the message was emitted by this call.
    """
    if key in _SEEN:
        return False
    with _LOCK:
        if key in _SEEN:
            return False
        _SEEN.add(key)
    logger.log(level, msg, *args)
    return True


def reset_log_once() -> None:
    """Forget every key (tests use it to observe the first-time messages again)."""
    with _LOCK:
        _SEEN.clear()

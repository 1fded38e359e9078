"""Name the rank that failed: one rank's exception becomes an error on every rank that says who and why.

When a rank raises, it stops issuing collectives, so its peers block in their
next one until that errors: at once when the failed process has exited (gloo
closes its connections: "Connection closed by peer"), else after the process
group's timeout (``dist.pg_timeout_s``). Neither error says which rank failed or
why. :func:`propagate_failures`, held around each worker's training, uses the
c10d store the ranks already share:

- a rank whose own exception is not a broken collective writes
  ``"rank r: <Type>: <message>"`` under ``failure/<r>`` and re-raises; the worker
  then exits, which closes its connections, so peers blocked in a gloo collective
  fail at once instead of at the timeout;
- a rank whose collective broke raises :class:`PeerFailureError` naming the
  rank(s) that reported a failure and their messages (chained to its own
  error), or, when none did (a peer was killed, lost its host, or is stuck past
  the timeout), saying exactly that;
- when no rank reported but the broken connection's peer address belongs to
  another host (``blockdiag_cp.topology``, recorded at mesh build), the ranks on
  that host are reported as lost, for this rank and for peers whose collective
  breaks later because this rank left. The lost ranks are written as one value
  (``failure/lost-by/<reporter>``), so a peer reading while they are written
  sees all of them or none.

Errors every rank raises together (the CP core's kernel-failure consensus, the
step agreement check) are not broken collectives: every rank reports and raises
its own copy. Store access is best effort: when the store is gone (its host
process exited) the original error is raised unchanged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from collections.abc import Iterator

import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import topology

logger = logging.getLogger(__name__)

KEY_PREFIX = "failure/"
# One key per rank that deduced lost peers: all of one host's ranks in a single store write.
LOST_PREFIX = f"{KEY_PREFIX}lost-by/"
# How a broken collective reads on gloo (plain RuntimeErrors) and NCCL (DistBackendError).
_TRANSPORT_MARKERS = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Application timeout caused pair closure",
    "Timed out waiting",
    "NCCL communicator",
    "Watchdog caught collective operation timeout",
)
# A report is one line of a log; long tracebacks-in-messages are cut.
_MAX_REPORT_CHARS = 2000


class PeerFailureError(RuntimeError):
    """This rank's collective broke because other ranks failed first; names them and their errors."""


def is_broken_collective(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it wraps) is a collective that failed in the transport, not in this rank."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError) or any(m in str(current) for m in _TRANSPORT_MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False


def describe(rank: int, exc: BaseException) -> str:
    """``"rank r: <Type>: <message>"`` on one line, at most ``_MAX_REPORT_CHARS`` characters."""
    text = f"rank {rank}: {type(exc).__name__}: {exc}".replace("\n", " | ")
    return text if len(text) <= _MAX_REPORT_CHARS else text[: _MAX_REPORT_CHARS - 3] + "..."


def report_failure(store: dist.Store, rank: int, exc: BaseException) -> None:
    """Write this rank's failure under ``failure/<rank>`` for its peers to name."""
    store.set(f"{KEY_PREFIX}{rank}", describe(rank, exc))


def peer_reports(store: dist.Store, rank: int, world: int) -> dict[int, str]:
    """Failures reported so far, ``{rank: report}`` (non-blocking: ``check`` before ``get``).

    Other ranks' own reports, plus every rank's deduced lost peers (this rank's
    included: a later failure reads what an earlier one deduced). A rank's own
    report wins over a deduction about it.
    """
    lost: dict[int, str] = {}
    for reporter in range(world):
        key = f"{LOST_PREFIX}{reporter}"
        if store.check([key]):
            lost.update({int(r): text for r, text in json.loads(store.get(key).decode()).items()})
    keys = {r: f"{KEY_PREFIX}{r}" for r in range(world) if r != rank}
    return lost | {r: store.get(key).decode() for r, key in keys.items() if store.check([key])}


def report_lost_peers(store: dist.Store, rank: int, exc: BaseException) -> dict[int, str]:
    """Report the ranks on the host behind ``exc``'s peer address as lost (they could not report themselves).

    Written in one store write: a peer reading concurrently names all of them or none.
    """
    reports = {
        lost: f"rank {lost}: lost without a report: the connection to {place.host} ({place.address}) broke "
        f"(killed, or its host went down)"
        for lost, place in topology.lost_peers(exc, rank).items()
    }
    if reports:
        store.set(f"{LOST_PREFIX}{rank}", json.dumps(reports))
    return reports


def peer_failure_error(rank: int, reports: dict[int, str], exc: BaseException) -> PeerFailureError:
    """The error of a rank whose collective broke, given its peers' ``reports`` (possibly none)."""
    own = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if not reports:
        return PeerFailureError(
            f"rank {rank}: a collective failed and no rank reported an error: a peer was killed, lost its host, "
            f"or is stuck past the process-group timeout (dist.pg_timeout_s); check which worker exited first "
            f"({own})"
        )
    return PeerFailureError(
        f"training failed on rank(s) {sorted(reports)}: {'; '.join(reports[r] for r in sorted(reports))}. "
        f"Rank {rank} stopped as a consequence ({own})"
    )


def translate_failure(store: dist.Store, rank: int, world: int, exc: Exception) -> Exception:
    """Report ``exc``, or name the peers behind it (module docstring); return the exception to raise.

    Args:
        store: The job's c10d store (``torch.distributed.distributed_c10d._get_default_store()``).
        rank: This process's global rank.
        world: Number of ranks.
        exc: What this rank raised.
    """
    try:
        if is_broken_collective(exc):
            reports = peer_reports(store, rank, world) or report_lost_peers(store, rank, exc)
            error = peer_failure_error(rank, reports, exc)
            # logged, not only raised: a launcher may reap this worker without printing its traceback
            logger.error("%s: %s", type(error).__name__, error)
            return error
        report_failure(store, rank, exc)
    except Exception as store_error:  # the store's host may be gone: keep the original error
        logger.error("rank %d: could not use the c10d store to report a failure (%s)", rank, store_error)
        return exc
    logger.error("%s (reported to the other ranks)", describe(rank, exc))
    return exc


@contextlib.contextmanager
def _termination_deferred() -> Iterator[None]:
    """Hold off SIGTERM while a failure is reported and logged.

    A launcher sends SIGTERM to every worker once one has failed; arriving while
    this rank reports its own failure, it would end the process silently and
    lose the report. Deferred, it is ignored: the worker exits with the error anyway.
    """
    if threading.current_thread() is not threading.main_thread():  # handlers live on the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def propagate_failures(rank: int, world: int) -> Iterator[None]:
    """Around a worker's collective work on an initialized process group: see the module docstring."""
    store = dist.distributed_c10d._get_default_store()
    try:
        yield
    except Exception as exc:
        with _termination_deferred():
            translated = translate_failure(store, rank, world, exc)
        if translated is exc:
            raise
        raise translated from exc

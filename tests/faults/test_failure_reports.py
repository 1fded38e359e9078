"""The recipe's failure reports (training/failure.py): the first failure is named on every rank.

End-to-end runs (a checkpointed backward failure, a killed and a stuck worker under the real
launcher) are in ``test_recipe_faults.py``; here the decisions, with an in-process store.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import topology
from nemo_automodel.components.training import failure
from nemo_automodel.components.training.failure import PeerFailureError, is_broken_collective, translate_failure

GLOO_CLOSED = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
GLOO_TIMEOUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation")


def test_a_rank_failing_on_its_own_reports_and_reraises_unchanged():
    store, own = dist.HashStore(), ValueError("bad batch")
    assert translate_failure(store, 1, 3, own) is own
    assert store.get("failure/1").decode() == "rank 1: ValueError: bad batch"


def test_a_broken_collective_names_the_ranks_that_reported_and_their_errors():
    store = dist.HashStore()
    translate_failure(store, 2, 3, RuntimeError("injected backward failure\nsecond line"))
    error = translate_failure(store, 0, 3, GLOO_CLOSED)
    assert isinstance(error, PeerFailureError)
    assert str(error).startswith("training failed on rank(s) [2]: rank 2: RuntimeError: injected backward failure")
    assert "Rank 0 stopped as a consequence (RuntimeError: [third_party/gloo" in str(error)
    assert not store.check(["failure/0"]), "a consequence is not reported as a failure"


def test_a_broken_collective_nobody_reported_says_a_peer_died_or_is_stuck():
    error = translate_failure(dist.HashStore(), 0, 2, GLOO_TIMEOUT)
    assert isinstance(error, PeerFailureError)
    assert "no rank reported an error: a peer was killed, lost its host, or is stuck" in str(error)


def test_an_error_every_rank_raises_together_is_each_ranks_own():
    """The core's consensus errors are raised on every rank at once: none of them is a broken collective."""
    store = dist.HashStore()
    consensus = RuntimeError("block-diagonal CP attention forward failed on CP rank(s) [1] (path=halo)")
    assert all(translate_failure(store, r, 2, consensus) is consensus for r in range(2))
    assert store.check(["failure/0"]) and store.check(["failure/1"])


@pytest.mark.parametrize(
    ("exc", "broken"),
    [
        (GLOO_CLOSED, True),
        (GLOO_TIMEOUT, True),
        (RuntimeError("Application timeout caused pair closure"), True),
        (dist.DistBackendError("NCCL communicator was aborted"), True),
        (ValueError("data.seq_len"), False),
        (RuntimeError("block-diagonal CP ranks disagree on kv_exchange"), False),
    ],
)
def test_broken_collectives_are_told_from_a_ranks_own_errors(exc, broken):
    assert is_broken_collective(exc) is broken


def test_a_broken_collective_wrapped_by_another_error_is_still_one():
    try:
        try:
            raise GLOO_CLOSED
        except RuntimeError as inner:
            raise OSError("checkpoint save failed") from inner
    except OSError as outer:
        assert is_broken_collective(outer)


class _WriteDuringRead:
    """A store whose ``writer`` runs just before the ``at``-th ``check``: a peer writing while this rank reads."""

    def __init__(self, at: int, writer) -> None:
        self.store, self.at, self.writer, self.checks = dist.HashStore(), at, writer, 0

    def check(self, keys):
        self.checks += 1
        if self.checks == self.at:
            self.writer(self.store)
        return self.store.check(keys)

    def set(self, key, value):
        self.store.set(key, value)

    def get(self, key):
        return self.store.get(key)


def test_lost_ranks_written_while_a_peer_reads_are_read_all_or_none(monkeypatch):
    """Both ranks of a killed node are named, never one (a survivor read between two writes in CI)."""
    node2 = topology.RankHost("node2", "10.0.0.12")
    monkeypatch.setattr(topology, "lost_peers", lambda exc, rank: {2: node2, 3: node2})
    seen = []
    for at in range(1, 12):  # the write lands before each of the reader's checks in turn (4 ranks, 2 kinds of key)
        store = _WriteDuringRead(at, lambda s: failure.report_lost_peers(s, 1, GLOO_CLOSED))
        seen.append(sorted(failure.peer_reports(store, 0, 4)))
    assert set(map(tuple, seen)) == {(), (2, 3)}, seen


class _GoneStore:
    """A store whose host process has exited."""

    def set(self, key, value):
        raise RuntimeError("Connection refused (store)")

    check = get = set


def test_an_unreachable_store_leaves_the_original_error():
    own = ValueError("bad batch")
    assert translate_failure(_GoneStore(), 0, 2, own) is own
    assert translate_failure(_GoneStore(), 0, 2, GLOO_CLOSED) is GLOO_CLOSED


def _fail_and_get_sigterm_while_reporting() -> str:
    """Pool worker: raise inside ``propagate_failures`` while a SIGTERM arrives mid-report (as from a launcher)."""
    real = failure.report_failure

    def report_under_sigterm(store, rank, exc):
        os.kill(os.getpid(), signal.SIGTERM)
        real(store, rank, exc)

    failure.report_failure = report_under_sigterm
    store = dist.distributed_c10d._get_default_store()
    try:
        with failure.propagate_failures(0, 1):
            raise ValueError("own failure")
    except ValueError:
        return store.get("failure/0").decode()
    finally:
        failure.report_failure = real
        store.delete_key("failure/0")
    return "no error raised"


def test_a_sigterm_while_reporting_does_not_kill_the_report(pools):
    """Without the deferral the worker dies silently (the pool reports the rank dead)."""
    assert pools.get(1).run_ok(_fail_and_get_sigterm_while_reporting, timeout=60) == ["rank 0: ValueError: own failure"]

"""Where ranks run: hostnames gathered once per process group, and what is decided from them.

Cross-node CP (``runtime._cp_group_spans_nodes``), the placement log and warning, the shared
run dir check and the naming of peers lost with their host. Made-up hosts are passed in
through the gather's ``place`` argument (a pool's ranks all run on this machine); the live
two-node cluster (``tests/slurm/test_multinode.py``) covers real hostnames.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import (
    cp_blockdiag_sdpa,
    exchange_stats,
    make_cp_blockdiag_batch_and_ctx,
    runtime,
    topology,
)
from nemo_automodel.components.distributed.blockdiag_cp.logs import reset_log_once
from nemo_automodel.components.distributed.blockdiag_cp.topology import GroupHosts, RankHost
from nemo_automodel.components.distributed.parallel import (
    check_shared_run_dir,
    cp_groups_split_needlessly,
    record_placement,
)
from nemo_automodel.components.training.failure import peer_reports, translate_failure
from nemo_automodel.testing.cases import cp_mesh, layout
from nemo_automodel.testing.syncs import count_syncs

TWO_NODES = ("node1", "node2")
ONE_NODE = ("node1", "node1")


def _place(hosts: tuple[str, ...], rank: int) -> RankHost:
    """Rank ``rank`` on ``hosts[rank]``, whose address is ``10.0.0.1<k>`` for the k-th distinct host."""
    return RankHost(hosts[rank], f"10.0.0.1{sorted(set(hosts)).index(hosts[rank]) + 1}")


def _world(*hosts: str) -> GroupHosts:
    return GroupHosts(tuple(range(len(hosts))), tuple(_place(hosts, r) for r in range(len(hosts))))


def test_group_hosts_group_ranks_by_host_in_rank_order() -> None:
    world = _world("node1", "node1", "node2", "node2")
    assert world.describe() == "ranks 0,1 on node1; ranks 2,3 on node2"
    assert world.spans_nodes and not world.subgroup([2, 3]).spans_nodes
    assert world.subgroup([3]).describe() == "rank 3 on node2"
    assert world.ranks_at("10.0.0.12") == (2, 3) and world.ranks_at("10.9.9.9") == ()


@pytest.mark.parametrize(
    ("hosts", "cp", "split"),
    [
        (("node1", "node1", "node2", "node2"), 2, []),  # torchrun: node by node
        (("node1", "node2", "node1", "node2"), 2, [0, 1]),  # cyclic numbering splits groups that fit a node
        (("node1", "node1", "node2", "node2"), 4, []),  # cp=4 > 2 ranks per node: spanning is unavoidable
        (("node1", "node1", "node1", "node2", "node2", "node2"), 2, []),  # 3 per node: group [2, 3] must span
    ],
)
def test_placement_warning_only_for_cp_groups_split_needlessly(hosts, cp, split) -> None:
    groups = [list(range(i, i + cp)) for i in range(0, len(hosts), cp)]
    assert cp_groups_split_needlessly(_world(*hosts), groups) == split


# ----------------------------------------------------------------------------- on a 2-rank gloo pool


@contextlib.contextmanager
def _world_on(hosts: tuple[str, ...]) -> Iterator[None]:
    """Pool worker: the default group's ranks on made-up ``hosts``; the real hosts recorded again afterwards."""
    topology.gather_hosts(None, _place(hosts, dist.get_rank()))
    try:
        yield
    finally:
        topology.gather_hosts(None)


@contextlib.contextmanager
def _warnings(logger: logging.Logger) -> Iterator[list[str]]:
    buffer = logging.handlers.BufferingHandler(capacity=1000)
    buffer.setLevel(logging.WARNING)
    logger.addHandler(buffer)
    messages: list[str] = []
    try:
        yield messages
    finally:
        logger.removeHandler(buffer)
        messages.extend(record.getMessage() for record in buffer.buffer)


def _spans_nodes(hosts: tuple[str, ...], allow: bool) -> tuple[list[bool], list[str]]:
    """``_cp_group_spans_nodes`` three times on the gathered hosts, the later calls on rank 0 alone."""
    with mock.patch.dict(os.environ), _world_on(hosts), _warnings(runtime.logger) as warnings:
        reset_log_once()
        answers = [runtime._cp_group_spans_nodes(topology.known_hosts(None), allow)]
        if dist.get_rank() == 0:
            answers += [runtime._cp_group_spans_nodes(topology.known_hosts(dist.group.WORLD), allow) for _ in range(2)]
    return answers, warnings


@pytest.mark.parametrize(
    ("hosts", "allow", "spans", "reason"),
    [
        (ONE_NODE, False, False, None),
        (TWO_NODES, False, True, "needed-only K/V exchange disabled"),
        (TWO_NODES, True, False, "NEMO_CP_ALLOW_XNODE=1 keeps needed-only"),
    ],
    ids=["one-host", "two-hosts", "two-hosts-allowed"],
)
def test_cp_group_spans_nodes_from_hostnames_gathered_once_reason_logged_once(pools, hosts, allow, spans, reason):
    for rank, (answers, warnings) in enumerate(pools.get(2).run_ok(_spans_nodes, hosts, allow, timeout=60)):
        assert answers == [spans] * (3 if rank == 0 else 1)
        assert len(warnings) == (reason is not None)
        if reason:
            assert reason in warnings[0] and "rank 0 on node1; rank 1 on node2" in warnings[0]


def _fresh_group_gathered_when_its_row_is_built() -> tuple[bool, bool, int]:
    """A fresh CP group: its hosts are unknown, gathered by the row's build, and no attention call gathers."""
    mesh = cp_mesh()
    fresh = dist.new_group([0, 1])
    before = topology.known_hosts(fresh) is None
    ids = layout("straddle", 2)
    batch = {"input_ids": torch.zeros(1, ids.shape[1], dtype=torch.long), "_packed_seq_ids": ids}
    with mock.patch.object(mesh, "get_group", return_value=fresh):
        ctx, _, shard = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, kv_exchange="allgather")
    after = topology.known_hosts(fresh) is not None
    q = torch.randn(1, 2, shard.local_len, 4)
    with count_syncs() as counts, ctx():
        cp_blockdiag_sdpa(q, q, q)
    return before, after, counts.control_collectives


def test_a_group_s_hosts_are_gathered_when_its_row_is_built_never_in_an_attention_call(pools):
    for before, after, control in pools.get(2).run_ok(_fresh_group_gathered_when_its_row_is_built, timeout=60):
        assert before and after
        assert control == 2  # the row agreement and the settlement of kernel failures: no hidden gather


def _path_across_nodes() -> tuple[str, str]:
    ids = layout("straddle", 2)
    batch = {"input_ids": torch.zeros(1, ids.shape[1], dtype=torch.long), "_packed_seq_ids": ids}
    with mock.patch.dict(os.environ), _world_on(TWO_NODES):
        os.environ.pop("NEMO_CP_ALLOW_XNODE", None)
        ctx, _, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, batch, kv_exchange="halo")
        q = torch.randn(1, 2, shard.local_len, 4)
        with ctx():
            cp_blockdiag_sdpa(q, q, q)
        stats = exchange_stats()
    return stats["path"], stats["reason"]


def test_needed_only_exchange_falls_back_to_allgather_across_nodes_naming_why(pools):
    for path, reason in pools.get(2).run_ok(_path_across_nodes, timeout=60):
        assert path == "allgather" and "CP group spans nodes" in reason


def _placement_logged() -> tuple[list[str], bool]:
    buffer = logging.handlers.BufferingHandler(capacity=100)
    logger = logging.getLogger("nemo_automodel.components.distributed.parallel")
    logger.addHandler(buffer)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        group = dist.new_group([0, 1])
        record_placement({group}, [[0, 1]], dist.get_rank() == 0, _place(TWO_NODES, dist.get_rank()))
    finally:
        logger.removeHandler(buffer)
        logger.setLevel(old)
        topology.gather_hosts(None)  # the real hosts again for the default group
    return [record.getMessage() for record in buffer.buffer], topology.known_hosts(group).spans_nodes


def test_mesh_build_logs_every_ranks_host_and_each_cp_groups_hosts(pools):
    (rank0_log, spans0), (rank1_log, spans1) = pools.get(2).run_ok(_placement_logged, timeout=60)
    assert rank0_log == ["hosts: rank 0 on node1; rank 1 on node2", "cp group 0: rank 0 on node1; rank 1 on node2"]
    assert rank1_log == [] and spans0 and spans1


def _check_run_dir(base: str) -> list[str]:
    run_dir = Path(base) / "run"
    if dist.get_rank() == 0:
        run_dir.mkdir()
    check_shared_run_dir(run_dir, dist.get_rank(), settle_s=5)
    dist.barrier()  # rank 0 removed its marker before returning
    return sorted(path.name for path in run_dir.iterdir())


def test_a_run_dir_every_rank_sees_passes_and_leaves_nothing_behind(pools, tmp_path):
    assert pools.get(2).run_ok(_check_run_dir, str(tmp_path), timeout=60) == [[], []]


def _lost_host_named(hosts: tuple[str, ...], prefix: str) -> list[tuple[str, bool]]:
    """Rank 0's errors when its collective breaks at rank 1's address, then at its own host's address."""
    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())  # no keys left for other tests
    errors = []
    with _world_on(hosts):
        if dist.get_rank() == 0:
            for peer in (_place(hosts, 1), _place(hosts, 0)):
                broken = RuntimeError(f"[pair.cc:553] Connection closed by peer [{peer.address}]:4756")
                errors.append((str(translate_failure(store, 0, 2, broken)), 1 in peer_reports(store, 0, 2)))
    return errors


def test_a_peer_lost_with_its_host_is_named_and_reported_for_the_ranks_that_fail_later(pools):
    errors, _ = pools.get(2).run_ok(_lost_host_named, TWO_NODES, f"{uuid.uuid4()}/", timeout=60)
    lost = "training failed on rank(s) [1]: rank 1: lost without a report: the connection to node2 (10.0.0.12) broke"
    # at node2's address, then (a peer on this host that left first) at its own host's: named from the store
    assert [(lost in error, reported) for error, reported in errors] == [(True, True), (True, True)], errors
    assert "Rank 0 stopped as a consequence" in errors[0][0]


def test_peers_on_this_host_are_not_guessed_from_the_address(pools):
    errors, _ = pools.get(2).run_ok(_lost_host_named, ONE_NODE, f"{uuid.uuid4()}/", timeout=60)
    assert all("no rank reported an error" in error and not reported for error, reported in errors), errors

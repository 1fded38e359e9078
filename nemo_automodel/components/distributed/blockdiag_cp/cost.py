"""One cost model for choosing a K/V exchange and a layout: ``kv_exchange=auto``, ``layout=auto``, the planner.

Inputs are replicated (the shard plan, the exchange plan, the attention shape),
so every rank predicts the same costs and picks the same path.

Per rank and per training step of one attention layer (forward + backward):

- compute = attention work (query-key pairs) x heads x head_dim x ``seconds_per_pair_dim``;
- exchange = messages x ``latency_s`` + bytes x 1 / ``bytes_per_s``, twice (the
  backward mirrors the forward): ``allgather`` is a ring of ``cp - 1`` steps of ``L``
  tokens; ``halo`` one message each way; ``a2a`` one message per peer; ``ulysses``
  two all-to-alls with every peer (q/k/v of the peer's heads, then the output of this
  rank's heads), whose bytes depend on the heads, not on the document lengths;
- exposed exchange = what the local-key segments' compute cannot hide (overlap; under
  ``ulysses`` all of it: every kernel needs the received rows);
- ``ulysses`` compute = the whole row's attention work x this rank's query heads
  (balanced by construction, whatever the layout);
- the heads x sequence hybrid ``ulysses+P`` with ``h x s`` ranks: a rank pays the ``ulysses`` all-to-alls
  of its head group (``h`` members, all exposed) plus path ``P``'s exchange of its sequence group over
  the head group's unions of rows, for its own heads only (``P``'s compute and overlap on those unions);
- topology: messages of a group whose ranks sit on more than one node cross the inter-node link
  (``Machine.inter_latency_s`` / ``inter_bytes_per_s``); under the hybrid the head groups are
  consecutive ranks (inside a node when a node's ranks are consecutive) and only the sequence part
  crosses nodes;
- step = max over ranks of compute + exposed exchange (the slowest rank sets the pace).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from nemo_automodel.components.distributed.blockdiag_cp.exchange import KVPlan, compute_kv_plan
from nemo_automodel.components.distributed.blockdiag_cp.heads import sequence_plan, split_heads
from nemo_automodel.components.distributed.blockdiag_cp.layout import LAYOUTS, DocRuns, ShardPlan, make_shard_plan

PATHS = ("allgather", "halo", "a2a", "ulysses")
# The heads x sequence hybrids: the exchange of their sequence part.
HYBRID_PATHS = {"ulysses+halo": "halo", "ulysses+a2a": "a2a", "ulysses+allgather": "allgather"}
# Ties prefer needed-only (the least memory), then ulysses (the row for a share of the heads), then the hybrids,
# then all-gather.
_PREFERENCE = {"halo": 0, "a2a": 1, "ulysses": 2, "ulysses+halo": 3, "ulysses+a2a": 4, "ulysses+allgather": 5}
_PREFERENCE["allgather"] = 6


@dataclass(frozen=True)
class Machine:
    """Link and kernel speed of the CP group's devices.

    Attributes:
        latency_s: Fixed cost of one message (one collective step).
        bytes_per_s: Bytes per second a rank receives.
        seconds_per_pair_dim: Attention forward + backward time per (query, key) pair,
            per head and per head-dim element.
        inter_latency_s: Fixed cost of one message between nodes (``None``: as inside a node).
        inter_bytes_per_s: Bytes per second a rank receives from other nodes (``None``: as inside a node).
    """

    latency_s: float
    bytes_per_s: float
    seconds_per_pair_dim: float
    inter_latency_s: float | None = None
    inter_bytes_per_s: float | None = None

    def across_nodes(self) -> Machine:
        """This machine with every message on the inter-node link."""
        return dataclasses.replace(
            self,
            latency_s=self.inter_latency_s if self.inter_latency_s is not None else self.latency_s,
            bytes_per_s=self.inter_bytes_per_s if self.inter_bytes_per_s is not None else self.bytes_per_s,
        )


# Calibrated on this project's machines (CPU: gloo over loopback, one thread per
# rank; benchmarks/cp_attention.py: the exchange-alone times of R512, W8K and
# MIX32K give ~0.25 ms per message and 0.3-1 GB/s, the attention times of
# DOC131K/MIX131K the pair cost) and from public H100/H200 figures (NVLink,
# FlashAttention bf16). Only the ranking of paths matters for `auto`; a too
# cheap link made `layout=auto` pick the balanced layout for 512-token rows,
# where its second message per rank costs more than the balance saves. Between nodes: public figures of a
# 400 Gb/s NIC per GPU (~45 GB/s, ~3x slower than NVLink) and of gloo over 10 GbE for CPU ranks.
MACHINES = {
    "cpu": Machine(
        latency_s=2.5e-4, bytes_per_s=5e8, seconds_per_pair_dim=1.6e-10, inter_latency_s=5e-4, inter_bytes_per_s=2.5e8
    ),
    "cuda": Machine(
        latency_s=2e-5, bytes_per_s=1.5e11, seconds_per_pair_dim=3.5e-14, inter_latency_s=3e-5, inter_bytes_per_s=4.5e10
    ),
}

# The node of every CP rank, in CP rank order (``None``: all on one node).
Nodes = tuple[int, ...] | None


def spans_nodes(nodes: Nodes, ranks: range | list[int] | None = None) -> bool:
    """True when ``ranks`` (default: all) of the CP group sit on more than one node."""
    if nodes is None:
        return False
    return len({nodes[r] for r in (ranks if ranks is not None else range(len(nodes)))}) > 1


def _link(machine: Machine, nodes: Nodes, ranks: range | list[int] | None = None) -> Machine:
    """``machine`` with the inter-node link when ``ranks`` span nodes."""
    return machine.across_nodes() if spans_nodes(nodes, ranks) else machine


def machine_for(device: torch.device | str) -> Machine:
    """The machine model of ``device``'s type (``cuda`` for accelerators without one of their own)."""
    return MACHINES.get(torch.device(device).type, MACHINES["cuda"])


@dataclass(frozen=True)
class Shape:
    """Attention shape: query heads, K/V heads, head dim and bytes per element.

    The default (8 heads of 128, bf16) stands in for a model the caller did not describe.
    """

    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 128
    elem_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("heads", "kv_heads", "head_dim", "elem_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"attn_shape.{name}: expected a positive int, got {value!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's fused ``[K; V]``."""
        return 2 * self.kv_heads * self.head_dim * self.elem_bytes


@dataclass(frozen=True)
class PathCost:
    """Predicted cost of one exchange path; per-rank lists are indexed by CP rank.

    ``recv_tokens`` are K/V rows received (under ``ulysses`` and the hybrids: rows for the rank's heads only);
    ``recv_bytes`` everything one forward receives (under ``ulysses``: q/k/v and the output; under a hybrid:
    its head group's all-to-alls plus its sequence exchange); ``factorization``: a hybrid's ``(h, s)``;
    ``head_bytes`` / ``sequence_bytes``: a hybrid's received bytes per part.
    """

    path: str
    recv_tokens: tuple[int, ...]
    messages: tuple[int, ...]
    compute_s: tuple[float, ...]
    exchange_s: tuple[float, ...]
    exposed_s: tuple[float, ...]
    recv_bytes: tuple[int, ...] = ()
    factorization: tuple[int, int] | None = None
    head_bytes: tuple[int, ...] = ()
    sequence_bytes: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """The path, with a hybrid's factorization: ``ulysses+a2a (2x4)``."""
        return (
            self.path
            if self.factorization is None
            else f"{self.path} ({self.factorization[0]}x{self.factorization[1]})"
        )

    @property
    def step_s(self) -> float:
        """Predicted time of the slowest rank (compute + exposed exchange)."""
        return max(c + e for c, e in zip(self.compute_s, self.exposed_s))


def _recv_and_messages(path: str, shard: ShardPlan, kv: KVPlan, rank: int) -> tuple[int, int, int]:
    """``(tokens received, tokens sent, messages)`` of one direction of ``path`` on ``rank``.

    Messages count every send and every receive the rank takes part in: a ring
    step of ``allgather`` is one of each, like a halo rank that both receives
    from its left and sends to its right.
    """
    cp, local = shard.cp, shard.local_len
    if path == "allgather":
        return (cp - 1) * local, (cp - 1) * local, 2 * (cp - 1)
    recv = kv.remote_tokens(rank)
    sent = sum(kv.recv_count(dst, rank) for dst in range(cp))
    if path == "halo":
        return recv, sent, int(recv > 0) + int(sent > 0)
    return recv, sent, kv.peers(rank) + sum(1 for dst in range(cp) if kv.recv_count(dst, rank))


def predict(
    path: str,
    shard: ShardPlan,
    kv: KVPlan,
    shape: Shape,
    machine: Machine,
    overlap: bool = True,
    window: int | None = None,
    nodes: Nodes = None,
) -> PathCost:
    """Predict ``path``'s per-rank compute, exchange and exposed exchange time.

    ``kv`` must be the plan of ``window`` (``None``: full causal); a window
    shrinks both the needed keys and the (query, key) pairs scored. ``nodes``: the node of every
    CP rank; a group that spans nodes pays the inter-node link.
    """
    machine = _link(machine, nodes)
    if path == "ulysses":
        return _predict_ulysses(shard, shape, machine, window)
    recv, msgs, compute, exchange, exposed = [], [], [], [], []
    per_pair = shape.heads * shape.head_dim * machine.seconds_per_pair_dim
    for rank, seg in enumerate(shard.windowed_segments(window)):
        tokens_in, tokens_out, messages = _recv_and_messages(path, shard, kv, rank)
        one_way = messages * machine.latency_s + max(tokens_in, tokens_out) * shape.kv_bytes_per_token / (
            machine.bytes_per_s
        )
        hidden_by = seg.work_of(seg.split_local_remote()[0]) * per_pair if overlap else 0.0
        recv.append(tokens_in)
        msgs.append(messages)
        compute.append(seg.attention_work * per_pair)
        exchange.append(2 * one_way)
        exposed.append(max(0.0, 2 * one_way - hidden_by))
    received = tuple(n * shape.kv_bytes_per_token for n in recv)
    return PathCost(path, tuple(recv), tuple(msgs), tuple(compute), tuple(exchange), tuple(exposed), received)


def _predict_ulysses(shard: ShardPlan, shape: Shape, machine: Machine, window: int | None) -> PathCost:
    """Head-parallel CP: each rank attends the whole row for its heads; both all-to-alls are exposed."""
    split = split_heads(shape.heads, shape.kv_heads, shard.cp)
    pairs = sum(seg.attention_work for seg in shard.windowed_segments(window))
    recv, received, msgs, compute, exchange = [], [], [], [], []
    for rank in range(shard.cp):
        moved = split.all_to_all_elements(rank, shard.local_len, shape.head_dim, shape.head_dim)
        busiest = sum(max(sent, received) for sent, received in moved)
        one_way = split.forward_messages * machine.latency_s + busiest * shape.elem_bytes / machine.bytes_per_s
        recv.append((shard.cp - 1) * shard.local_len if split.kv[rank] else 0)
        received.append(sum(r for _, r in moved) * shape.elem_bytes)
        msgs.append(split.forward_messages)
        compute.append(pairs * split.n_query(rank) * shape.head_dim * machine.seconds_per_pair_dim)
        exchange.append(2 * one_way)
    costs = (tuple(compute), tuple(exchange), tuple(exchange))
    return PathCost("ulysses", tuple(recv), tuple(msgs), *costs, tuple(received))


def _head_all_to_alls(split_cp: int, shape: Shape, local_len: int, rank: int, machine: Machine) -> tuple[float, int]:
    """``(seconds of both directions, bytes one forward receives)`` of ``rank``'s head all-to-alls over ``split_cp``."""
    split = split_heads(shape.heads, shape.kv_heads, split_cp)
    moved = split.all_to_all_elements(rank, local_len, shape.head_dim, shape.head_dim)
    busiest = sum(max(sent, received) for sent, received in moved)
    one_way = split.forward_messages * machine.latency_s + busiest * shape.elem_bytes / machine.bytes_per_s
    return 2 * one_way, sum(r for _, r in moved) * shape.elem_bytes


def predict_hybrid(
    path: str,
    h: int,
    shard: ShardPlan,
    shape: Shape,
    machine: Machine,
    overlap: bool = True,
    window: int | None = None,
    nodes: Nodes = None,
) -> PathCost:
    """The heads x sequence hybrid ``path`` (``ulysses+halo`` etc.) with ``h`` head-parallel x ``cp / h`` ranks.

    Rank ``r = g h + j``: the all-to-alls of head group ``g`` (its own link: inside a node when its ``h``
    consecutive ranks are), then the sequence path over the re-sharded row (:func:`.heads.sequence_plan`)
    with member ``j``'s heads, on the link of sequence group ``j``. ``halo`` is upgraded to ``a2a`` where
    the re-sharded row needs more than the left neighbour (as the runtime does).
    """
    cp, s = shard.cp, shard.cp // h
    merged = sequence_plan(shard, h)
    kv = compute_kv_plan(merged, window)
    sequence_path = HYBRID_PATHS[path]
    if sequence_path == "halo" and not kv.use_halo:
        sequence_path = "a2a"
    split = split_heads(shape.heads, shape.kv_heads, h)
    parts = []
    for j in range(h):
        nq, nkv = split.n_query(j), len(split.kv[j])
        if nq == 0:
            parts.append(None)
            continue
        member = Shape(nq, nkv, shape.head_dim, shape.elem_bytes)
        link = _link(machine, nodes, [g * h + j for g in range(s)])
        parts.append(predict(sequence_path, merged, kv, member, link, overlap, window))
    rows = []
    for r in range(cp):
        g, j = divmod(r, h)
        head_link = _link(machine, nodes, range(g * h, (g + 1) * h))
        head_s, head_bytes = _head_all_to_alls(h, shape, shard.local_len, j, head_link)
        rows.append(_hybrid_rank(parts[j], g, (h - 1) * shard.local_len, split.forward_messages, head_s, head_bytes))
    columns = [tuple(column) for column in zip(*rows)]
    return PathCost(path, *columns[:6], factorization=(h, s), head_bytes=columns[6], sequence_bytes=columns[7])


def _hybrid_rank(
    part: PathCost | None, g: int, head_rows: int, head_messages: int, head_s: float, head_bytes: int
) -> tuple[int, int, float, float, float, int, int, int]:
    """One rank's hybrid figures: its head group's all-to-alls plus rank ``g`` of its sequence part ``part``.

    ``part`` is ``None`` for a head member without query heads (its sequence group moves nothing).
    Returns ``(recv tokens, messages, compute, exchange, exposed, recv bytes, head bytes, sequence bytes)``.
    """
    if part is None:
        return 0, head_messages, 0.0, head_s, head_s, head_bytes, head_bytes, 0
    sequence_bytes = part.recv_bytes[g]
    return (
        head_rows + part.recv_tokens[g],
        head_messages + part.messages[g],
        part.compute_s[g],
        head_s + part.exchange_s[g],
        head_s + part.exposed_s[g],
        head_bytes + sequence_bytes,
        head_bytes,
        sequence_bytes,
    )


def hybrid_degrees(cp: int) -> tuple[int, ...]:
    """The head-parallel degrees ``h`` of the hybrid factorizations of ``cp``: ``1 < h < cp``, ``cp % h == 0``."""
    return tuple(h for h in range(2, cp) if cp % h == 0)


def default_degree(cp: int, nodes: Nodes = None) -> int | None:
    """The hybrid's default ``h`` (``head_parallel=None``): the ranks of one node when the CP group spans nodes
    (every node holding as many), else the largest proper divisor of ``cp``; ``None`` when there is none."""
    if spans_nodes(nodes):
        per_node = {nodes.count(node) for node in set(nodes)}
        h = per_node.pop() if len(per_node) == 1 else None
        return h if h is not None and 1 < h < cp and cp % h == 0 else None
    return next((h for h in range(cp - 1, 1, -1) if cp % h == 0), None)


def candidate_paths(kv: KVPlan) -> tuple[str, ...]:
    """Paths that can run the row (``halo`` only when every rank needs its left neighbour alone)."""
    return PATHS if kv.use_halo else ("allgather", "a2a", "ulysses")


def choose(
    shard: ShardPlan,
    kv: KVPlan,
    shape: Shape,
    machine: Machine,
    overlap: bool = True,
    window: int | None = None,
    nodes: Nodes = None,
    degrees: tuple[int, ...] = (),
    paths: tuple[str, ...] | None = None,
    hybrids: tuple[str, ...] = HYBRID_PATHS,
) -> tuple[str, str, list[PathCost]]:
    """Pick the path with the lowest predicted step time for the calls of ``window``.

    Args:
        nodes: The node of every CP rank (``None``: one node).
        degrees: Head-parallel degrees ``h`` whose hybrids are candidates too.
        paths: The single paths to weigh (default: :func:`candidate_paths`).
        hybrids: The hybrids weighed for each degree (default: every sequence path).

    Returns:
        ``(path, reason, costs)``; ties prefer needed-only paths (less memory).
    """
    singles = candidate_paths(kv) if paths is None else paths
    costs = [predict(p, shard, kv, shape, machine, overlap, window, nodes) for p in singles]
    costs += [predict_hybrid(p, h, shard, shape, machine, overlap, window, nodes) for h in degrees for p in hybrids]
    best = min(costs, key=lambda c: (round(c.step_s, 12), _PREFERENCE[c.path]))
    others = ", ".join(f"{c.label} {c.step_s * 1e3:.3g} ms" for c in costs if c is not best)
    reason = f"kv_exchange=auto: {best.label} predicted {best.step_s * 1e3:.3g} ms per layer step ({others})"
    return best.path, reason, costs


def choose_auto(
    shard: ShardPlan,
    kv: KVPlan,
    shape: Shape,
    machine: Machine,
    overlap: bool = True,
    window: int | None = None,
    nodes: Nodes = None,
    allow_cross_node: bool = False,
) -> tuple[PathCost, str]:
    """``kv_exchange=auto``'s pick, the runtime's and the planner's: ``(best, reason)``.

    Candidates: the single paths and the hybrids of the default factorization (:func:`default_degree`: heads
    inside a node x sequence between nodes). On a group that spans nodes, needed-only messages between nodes
    are opt-in (``allow_cross_node``): without it only collectives cross nodes (``allgather``, ``ulysses``,
    ``ulysses+allgather``).
    """
    singles, hybrids = candidate_paths(kv), HYBRID_PATHS
    if spans_nodes(nodes) and not allow_cross_node:
        singles, hybrids = ("allgather", "ulysses"), ("ulysses+allgather",)
    h = default_degree(shard.cp, nodes)
    _, reason, costs = choose(shard, kv, shape, machine, overlap, window, nodes, (h,) if h else (), singles, hybrids)
    best = min(costs, key=lambda c: (round(c.step_s, 12), _PREFERENCE[c.path]))
    return best, reason


def choose_layout(runs: DocRuns, cp: int, shape: Shape, machine: Machine, overlap: bool = True) -> ShardPlan:
    """``layout=auto``: the layout whose best exchange path has the lowest predicted step time.

    Both candidate plans are pure functions of the replicated document ids, so
    every rank picks the same one. Ties keep ``contiguous`` (no permutation).
    The layout is fixed before the model runs, so it is judged on full-causal
    layers; sliding-window layers then pick their own exchange path. Only the
    sequence-split paths judge it: ``ulysses`` attends whole rows whatever the layout.
    """
    best: tuple[float, ShardPlan] | None = None
    for layout in LAYOUTS:
        shard = make_shard_plan(runs, cp, layout)
        costs = choose(shard, compute_kv_plan(shard), shape, machine, overlap)[2]
        step = min(c.step_s for c in costs if c.path != "ulysses")
        if best is None or step < best[0] * (1 - 1e-9):
            best = (step, shard)
    assert best is not None
    return best[1]

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
- step = max over ranks of compute + exposed exchange (the slowest rank sets the pace).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_automodel.components.distributed.blockdiag_cp.exchange import KVPlan, compute_kv_plan
from nemo_automodel.components.distributed.blockdiag_cp.heads import split_heads
from nemo_automodel.components.distributed.blockdiag_cp.layout import LAYOUTS, DocRuns, ShardPlan, make_shard_plan

PATHS = ("allgather", "halo", "a2a", "ulysses")
# Ties prefer needed-only (the least memory), then ulysses (the row for a share of the heads), then all-gather.
_PREFERENCE = {"halo": 0, "a2a": 1, "ulysses": 2, "allgather": 3}


@dataclass(frozen=True)
class Machine:
    """Link and kernel speed of the CP group's devices.

    Attributes:
        latency_s: Fixed cost of one message (one collective step).
        bytes_per_s: Bytes per second a rank receives.
        seconds_per_pair_dim: Attention forward + backward time per (query, key) pair,
            per head and per head-dim element.
    """

    latency_s: float
    bytes_per_s: float
    seconds_per_pair_dim: float


# Calibrated on this project's machines (CPU: gloo over loopback, one thread per
# rank; benchmarks/cp_attention.py: the exchange-alone times of R512, W8K and
# MIX32K give ~0.25 ms per message and 0.3-1 GB/s, the attention times of
# DOC131K/MIX131K the pair cost) and from public H100/H200 figures (NVLink,
# FlashAttention bf16). Only the ranking of paths matters for `auto`; a too
# cheap link made `layout=auto` pick the balanced layout for 512-token rows,
# where its second message per rank costs more than the balance saves.
MACHINES = {
    "cpu": Machine(latency_s=2.5e-4, bytes_per_s=5e8, seconds_per_pair_dim=1.6e-10),
    "cuda": Machine(latency_s=2e-5, bytes_per_s=1.5e11, seconds_per_pair_dim=3.5e-14),
}


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

    ``recv_tokens`` are K/V rows received (under ``ulysses``: rows for the rank's heads only);
    ``recv_bytes`` everything one forward receives (under ``ulysses``: q/k/v and the output).
    """

    path: str
    recv_tokens: tuple[int, ...]
    messages: tuple[int, ...]
    compute_s: tuple[float, ...]
    exchange_s: tuple[float, ...]
    exposed_s: tuple[float, ...]
    recv_bytes: tuple[int, ...] = ()

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
) -> PathCost:
    """Predict ``path``'s per-rank compute, exchange and exposed exchange time.

    ``kv`` must be the plan of ``window`` (``None``: full causal); a window
    shrinks both the needed keys and the (query, key) pairs scored.
    """
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
) -> tuple[str, str, list[PathCost]]:
    """Pick the path with the lowest predicted step time for the calls of ``window``.

    Returns:
        ``(path, reason, costs)``; ties prefer needed-only paths (less memory).
    """
    costs = [predict(p, shard, kv, shape, machine, overlap, window) for p in candidate_paths(kv)]
    best = min(costs, key=lambda c: (round(c.step_s, 12), _PREFERENCE[c.path]))
    others = ", ".join(f"{c.path} {c.step_s * 1e3:.3g} ms" for c in costs if c is not best)
    reason = f"kv_exchange=auto: {best.path} predicted {best.step_s * 1e3:.3g} ms per layer step ({others})"
    return best.path, reason, costs


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

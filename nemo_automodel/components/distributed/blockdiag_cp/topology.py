"""Which host every rank of a process group runs on: gathered once per group, then looked up.

Whether a CP group spans nodes decides the K/V exchange (needed-only exchanges are many
point-to-point messages: cheap over a node's own links, each one paying the inter-node
fabric's latency otherwise). The answer comes from the ranks' real hostnames, never from
launcher arithmetic: :func:`gather_hosts` is one ``all_gather_object`` over the group, which
every rank of the group must reach at the same point (building the mesh, or the first CP call
that needs the answer); its result is kept per process group, so a step never gathers.
"""

from __future__ import annotations

import re
import socket
import weakref
from dataclasses import dataclass

import torch.distributed as dist

# "[10.0.0.12]:41234" in a transport error (gloo: "Read error [addr]:port: Connection reset by peer").
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


@dataclass(frozen=True)
class RankHost:
    """Where one rank runs: ``host`` (its hostname) and ``address`` (what the hostname resolves to, or ``""``)."""

    host: str
    address: str


def this_rank_host() -> RankHost:
    """This process's hostname and the address it resolves to (the one gloo binds to by default)."""
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = ""
    return RankHost(host, address)


@dataclass(frozen=True)
class GroupHosts:
    """The hosts of a process group's ranks: ``places[i]`` is where global rank ``ranks[i]`` runs (group order)."""

    ranks: tuple[int, ...]
    places: tuple[RankHost, ...]

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(place.host for place in self.places)

    @property
    def spans_nodes(self) -> bool:
        """True when the group's ranks run on more than one host."""
        return len(set(self.hosts)) > 1

    @property
    def nodes(self) -> tuple[int, ...]:
        """The node of every rank, in group order (hosts numbered in the order of their first rank)."""
        number = {host: i for i, host in enumerate(self.ranks_by_host())}
        return tuple(number[host] for host in self.hosts)

    def ranks_by_host(self) -> dict[str, tuple[int, ...]]:
        """``{host: global ranks}``, hosts in the order of their first rank."""
        grouped: dict[str, list[int]] = {}
        for rank, host in zip(self.ranks, self.hosts, strict=True):
            grouped.setdefault(host, []).append(rank)
        return {host: tuple(ranks) for host, ranks in grouped.items()}

    def describe(self) -> str:
        """``"ranks 0,1 on node1; ranks 2,3 on node2"``."""
        return "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))} on {host}"
            for host, ranks in self.ranks_by_host().items()
        )

    def subgroup(self, ranks: list[int]) -> GroupHosts:
        """The hosts of the given global ranks (all of them members of this group), in that order."""
        place = dict(zip(self.ranks, self.places, strict=True))
        return GroupHosts(tuple(ranks), tuple(place[rank] for rank in ranks))

    def ranks_at(self, address: str) -> tuple[int, ...]:
        """The ranks whose host resolves to ``address``."""
        return tuple(rank for rank, place in zip(self.ranks, self.places, strict=True) if place.address == address)


# Facts per live process group; an entry goes with its group.
_KNOWN: weakref.WeakKeyDictionary[dist.ProcessGroup, GroupHosts] = weakref.WeakKeyDictionary()


def _resolved(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return dist.group.WORLD if group is None else group


def gather_hosts(group: dist.ProcessGroup | None, place: RankHost | None = None) -> GroupHosts:
    """Collective over ``group`` (``None``: the default group): every rank's host, remembered for the group.

    Args:
        group: The process group; every rank of it must call this at the same point.
        place: This rank's host (default :func:`this_rank_host`; tests pass made-up hosts).
    """
    group = _resolved(group)
    mine = place or this_rank_host()
    places: list[RankHost | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, mine, group=group)
    hosts = GroupHosts(tuple(dist.get_process_group_ranks(group)), tuple(places))  # type: ignore[arg-type]
    _KNOWN[group] = hosts
    return hosts


def remember_hosts(group: dist.ProcessGroup, known: GroupHosts) -> GroupHosts:
    """Record ``group``'s hosts from a gather over a larger group ``known`` (no collective)."""
    hosts = known.subgroup(dist.get_process_group_ranks(group))
    _KNOWN[group] = hosts
    return hosts


def known_hosts(group: dist.ProcessGroup | None) -> GroupHosts | None:
    """The hosts recorded for ``group``, or ``None`` before its gather (never a collective)."""
    if group is None and not dist.is_initialized():
        return None
    return _KNOWN.get(_resolved(group))


def group_hosts(group: dist.ProcessGroup | None) -> GroupHosts:
    """The hosts of ``group``: recorded ones, else :func:`gather_hosts` (a collective, once per group)."""
    return known_hosts(group) or gather_hosts(group)


def lost_peers(error: BaseException, own_rank: int) -> dict[int, RankHost]:
    """The ranks behind the peer addresses a broken collective names (``error`` and its causes).

    From the default group's recorded hosts (nothing before its gather; never a collective).
    Only addresses of other hosts count: peers on this rank's own host share its address,
    which cannot tell them apart.
    """
    world = known_hosts(None)
    if world is None or own_rank not in world.ranks:
        return {}
    own = world.places[world.ranks.index(own_rank)].address
    lost: dict[int, RankHost] = {}
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for address in _PEER_ADDRESS.findall(str(current)):
            if address != own:
                lost.update({rank: world.places[world.ranks.index(rank)] for rank in world.ranks_at(address)})
        current = current.__cause__ or current.__context__
    return lost

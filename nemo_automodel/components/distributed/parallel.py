"""Process group, the ``(dp, cp)`` device mesh, and FSDP2 gradient reduction over ``dp x cp``.

Gradients: FSDP2 ``fully_shard`` over the flattened ``dp x cp`` mesh (works with
gloo on CPU in torch 2.13). Every CP rank holds a different slice of the same
packed row, so a parameter's gradient is the SUM of the per-rank gradients over
CP *and* DP; the loss is already divided by the global label-token count, so the
reduce-scatter must not average: each FSDP module gets a divide factor of 1 and
forced SUM collectives (gloo rejects FSDP's default ``PREMUL_SUM``).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from nemo_automodel.components.distributed.blockdiag_cp import topology as hosts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """This process's place: ``world = dp * cp`` ranks, CP ranks adjacent (``rank = dp_rank * cp + cp_rank``)."""

    world: int
    rank: int
    local_rank: int
    dp: int
    cp: int

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_topology(world: int, rank: int, local_rank: int, cp_size: int, dp_size: int | None) -> Topology:
    """Check that ``cp.size`` (and ``dist.dp_size``) fit ``world``; no collective is involved.

    Raises:
        ValueError: naming the field and the fix.
    """
    if world % cp_size:
        raise ValueError(
            f"cp.size={cp_size} does not divide the world size {world}: the world must be dp * cp ranks; "
            f"launch a multiple of {cp_size} processes or change cp.size"
        )
    dp = world // cp_size
    if dp_size is not None and dp_size != dp:
        raise ValueError(
            f"dist.dp_size={dp_size} with cp.size={cp_size} needs {dp_size * cp_size} ranks, but the world has "
            f"{world}; drop dist.dp_size (it is derived) or launch {dp_size * cp_size} processes"
        )
    return Topology(world=world, rank=rank, local_rank=local_rank, dp=dp, cp=cp_size)


def training_device(local_rank: int) -> torch.device:
    """CUDA (this process's local GPU) when available, else CPU (threads: :func:`set_threads`)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@dataclass(frozen=True)
class ThreadChoice:
    """Intra-op threads per worker and why: ``threads=None`` leaves torch's own default (CUDA, nothing set)."""

    threads: int | None
    reason: str


def omp_num_threads(env: str | None) -> int | None:
    """``OMP_NUM_THREADS`` as a number (``None``: unset or empty); torchrun sets it to 1 when it is unset.

    Raises:
        ValueError: set but not a positive integer (checked before any worker starts).
    """
    if env is None or not env.strip():
        return None
    if not env.strip().isdigit() or int(env) < 1:
        raise ValueError(
            f"OMP_NUM_THREADS={env!r} is not a positive integer; set it to the threads per worker "
            "(e.g. OMP_NUM_THREADS=4), unset it, or set dist.threads"
        )
    return int(env)


def choose_threads(
    explicit: int | None, env: str | None, cpu_count: int, local_world: int, device_type: str
) -> ThreadChoice:
    """The threads per worker: ``dist.threads`` > ``OMP_NUM_THREADS`` > a CPU worker's share of the cores.

    The share (``cpu_count // local_world``) keeps the ``local_world`` CPU workers of a node from starting one
    thread per core each and oversubscribing it several times over; a user's setting is never overridden.

    Raises:
        ValueError: ``OMP_NUM_THREADS`` set but not a positive integer.
    """
    omp = omp_num_threads(env)
    if explicit is not None:
        ignored = f"; OMP_NUM_THREADS={omp} not used" if omp is not None and omp != explicit else ""
        return ThreadChoice(explicit, f"dist.threads={explicit}{ignored}")
    if omp is not None:
        return ThreadChoice(omp, f"OMP_NUM_THREADS={omp} from the environment")
    if device_type != "cpu":
        return ThreadChoice(None, "torch's default (set dist.threads or OMP_NUM_THREADS to change)")
    share = max(1, cpu_count // local_world)
    return ThreadChoice(
        share,
        f"default: {cpu_count} cores // {local_world} local worker(s); set dist.threads or OMP_NUM_THREADS to change",
    )


def set_threads(explicit: int | None, local_world: int, device: torch.device) -> str:
    """Apply :func:`choose_threads` to this process (``torch.set_num_threads``); return the line to log."""
    choice = choose_threads(explicit, os.environ.get("OMP_NUM_THREADS"), os.cpu_count() or 1, local_world, device.type)
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    return f"{torch.get_num_threads()} intra-op threads per worker ({choice.reason})"


def init_process_group(device: torch.device, pg_timeout_s: float) -> None:
    """NCCL on CUDA, gloo on CPU, from the ``env://`` variables (``MASTER_ADDR``/``PORT``, ``RANK``, ``WORLD_SIZE``).

    The timeout turns a dead or stuck peer into an error instead of a hang.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=pg_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


@dataclass(frozen=True)
class Meshes:
    """``cp``: the 1-D CP sub-mesh (K/V exchange); ``dp_cp``: every rank, flattened (gradients, loss count)."""

    cp: DeviceMesh
    dp_cp: DeviceMesh


def build_meshes(topology: Topology, device: torch.device, pg_timeout_s: float) -> Meshes:
    """The 2-D ``("dp", "cp")`` mesh's CP dimension and its flattened ``dp x cp`` dimension.

    Every group of the mesh gets the ``pg_timeout_s`` timeout: ``init_device_mesh``
    creates the groups of dimensions smaller than the world with torch's default
    (30 min for gloo, 10 min for NCCL), not the default group's timeout, so with
    ``dp > 1`` a stuck CP peer would otherwise hang its group for that long.

    CP is the innermost dimension (consecutive ranks), so a launcher that numbers
    ranks node by node (torchrun, ``srun`` block distribution) puts every CP group
    inside one node whenever ``cp`` divides the workers per node. Where every rank
    runs is gathered here, once (:func:`record_placement`).
    """
    mesh = init_device_mesh(device.type, (topology.dp, topology.cp), mesh_dim_names=("dp", "cp"))
    meshes = Meshes(cp=mesh["cp"], dp_cp=mesh["dp", "cp"]._flatten("dp_cp"))
    groups = {mesh["dp"].get_group(), meshes.cp.get_group(), meshes.dp_cp.get_group()}
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=pg_timeout_s), group)
    record_placement(groups, mesh.mesh.tolist(), topology.is_main)
    return meshes


def record_placement(
    groups: set[dist.ProcessGroup], cp_groups: list[list[int]], log: bool, place: hosts.RankHost | None = None
) -> hosts.GroupHosts:
    """Collective: every rank's host, gathered once over the default group and recorded for ``groups``.

    The CP core then decides whether its group spans nodes without another collective
    (``blockdiag_cp.topology``), and a failure report can name the ranks behind a
    peer address. With ``log``: every rank's host and each CP group's hosts.

    Args:
        groups: The mesh's process groups.
        cp_groups: The global ranks of each CP group (the ``[dp, cp]`` mesh as nested lists).
        log: Whether this rank logs the placement (rank 0).
        place: This rank's host (default: the real one; tests pass made-up hosts).
    """
    world = hosts.gather_hosts(None, place)
    for group in groups:
        hosts.remember_hosts(group, world)
    if log:
        logger.info("hosts: %s", world.describe())
        for index, ranks in enumerate(cp_groups):
            logger.info("cp group %d: %s", index, world.subgroup(ranks).describe())
        misplaced = cp_groups_split_needlessly(world, cp_groups)
        if misplaced:
            logger.warning(
                "cp group(s) %s span nodes although every node runs whole CP groups of %d ranks: the launcher "
                "numbered the ranks across nodes; start them node by node (torchrun, or srun --distribution=block)",
                misplaced,
                len(cp_groups[0]),
            )
    return world


def cp_groups_split_needlessly(world: hosts.GroupHosts, cp_groups: list[list[int]]) -> list[int]:
    """Indices of the CP groups that span nodes although every node's ranks make whole CP groups."""
    cp = len(cp_groups[0])
    if any(len(ranks) % cp for ranks in world.ranks_by_host().values()):
        return []  # some group must span nodes, whatever the numbering
    return [index for index, ranks in enumerate(cp_groups) if world.subgroup(ranks).spans_nodes]


def check_shared_run_dir(run_dir: Path, rank: int, settle_s: float = 5.0) -> None:
    """Collective (default group): every rank must see the run dir rank 0 created, or every rank raises.

    Checkpoints (``torch.distributed.checkpoint`` writes each rank's shard, rank 0 the
    metadata), ``metrics.jsonl`` and ``trainer.resume=auto`` assume one directory shared by
    every node. Rank 0 writes a file with a random token into ``run_dir``; each rank looks
    for it for up to ``settle_s`` seconds (a network filesystem may show a new file late).

    Raises:
        RuntimeError: on every rank, naming the ranks (and hosts) that do not see it and the fix.
    """
    shared = [secrets.token_hex(8), f".shared-fs-check-{os.getpid()}"] if rank == 0 else ["", ""]
    if rank == 0:
        (run_dir / shared[1]).write_text(shared[0])
    dist.broadcast_object_list(shared, src=0)
    token, name = shared
    marker = run_dir / name  # this rank's own view of the run dir
    deadline = time.monotonic() + settle_s
    while not (seen := _holds(marker, token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    seen_by = [False] * dist.get_world_size()
    dist.all_gather_object(seen_by, seen)
    if rank == 0:
        marker.unlink(missing_ok=True)
    blind = [r for r, ok in enumerate(seen_by) if not ok]
    if blind:
        where = hosts.known_hosts(None)
        on = f" on {', '.join(dict.fromkeys(where.subgroup(blind).hosts))}" if where else ""
        raise RuntimeError(
            f"hydra.run.dir={run_dir}: rank(s) {blind}{on} do not see the run directory rank 0 created: checkpoints, "
            f"metrics and resume need one directory that every node shares; put hydra.run.dir (RUN_ROOT or RUN_DIR "
            f"under Slurm) on a filesystem every node mounts at the same path (NFS, Lustre, ...)"
        )


def _holds(marker: Path, token: str) -> bool:
    try:
        return marker.read_text() == token
    except OSError:
        return False


def shard_model(model: torch.nn.Module, flat: DeviceMesh) -> FSDPModule:
    """FSDP2 over the flattened ``dp x cp`` mesh: one unit per decoder layer, then the root; SUM-reduced gradients."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers if layers is not None else []:
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model

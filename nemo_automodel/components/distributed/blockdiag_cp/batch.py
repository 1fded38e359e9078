"""Batch validation, padding, layout permutation and sharding, and the per-step train context."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from nemo_automodel.components.distributed.blockdiag_cp import consensus, cost, gpu_libraries, hybrid, topology
from nemo_automodel.components.distributed.blockdiag_cp import state as state_module
from nemo_automodel.components.distributed.blockdiag_cp.layout import (
    DocRuns,
    ShardPlan,
    doc_runs_from_ids,
    make_shard_plan,
)
from nemo_automodel.components.distributed.blockdiag_cp.metadata import build_window_plan
from nemo_automodel.components.distributed.blockdiag_cp.state import RowState

# Sequence-aligned batch fields that are padded and sharded (``position_ids``
# may also be mRoPE ``[3, B, S]``; every other field is ``[B, S, ...]``).
SEQ_FIELDS = ("input_ids", "inputs_embeds", "labels", "position_ids", "loss_mask", "padding_mask", "_packed_seq_ids")


@dataclass(frozen=True)
class ShardLayout:
    """How a packed row was padded and split over the CP group.

    Attributes:
        original_seq_len: ``S`` before padding.
        padded_seq_len: ``S_full``, a multiple of ``2 * cp_size``.
        cp_size: Number of CP ranks.
        cp_rank: This rank.
        row_offset: Physical position of this rank's first local row (``cp_rank * local_len``).
        local_len: Local rows per rank ``S_full / cp_size``.
        layout: ``contiguous`` or ``balanced``.
        positions: Original (padded-row) position of each local row ``[local_len]``;
            ``arange(row_offset, row_offset + local_len)`` under the contiguous layout.
    """

    original_seq_len: int
    padded_seq_len: int
    cp_size: int
    cp_rank: int
    row_offset: int
    local_len: int
    layout: str
    positions: torch.Tensor


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "may attend" from a bool, integer (non-zero) or additive float (0 = allowed) mask."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask == 0
    return mask != 0


def _ids_from_block_causal_mask(mask: torch.Tensor) -> torch.Tensor:
    """Document ids ``[1, S]`` from a 4-D block-causal mask ``[1, 1, S, S]``.

    A valid row (it sees itself) starts a document when it cannot see the
    previous token. The mask must be exactly block-diagonal causal on its
    valid rows; padding rows (not seeing themselves) are id 0.
    """
    allowed = _allowed(mask[:, 0])
    valid = allowed.diagonal(dim1=-2, dim2=-1)
    sees_prev = torch.zeros_like(valid)
    sees_prev[:, 1:] = allowed[:, 1:, :-1].diagonal(dim1=-2, dim2=-1)
    ids = torch.cumsum(valid & ~sees_prev, dim=1) * valid
    pos = torch.arange(ids.shape[1], device=ids.device)
    rebuilt = (ids[:, :, None] == ids[:, None, :]) & (pos[None, None, :] <= pos[None, :, None])
    if bool(((rebuilt != allowed) & valid[:, :, None]).any()):
        raise ValueError(
            "attention_mask: the 4-D mask is not block-diagonal causal (a row sees keys outside its own "
            "document's prefix); pass `_packed_seq_ids` [B, S] instead"
        )
    return ids.long()


def _document_ids(batch: dict[str, Any], batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Per-token document ids ``[B, S]`` (0 == pad) from the best source in ``batch``.

    Order: ``_packed_seq_ids``; a 4-D block-causal ``attention_mask``; a ``[B, S]``
    mask (0/1 validity, or indexed document ids); else one document.
    """
    seq_ids = batch.get("_packed_seq_ids")
    mask = batch.get("attention_mask")
    if seq_ids is not None:
        field, ids = "_packed_seq_ids", _require_tensor("_packed_seq_ids", seq_ids)
    elif mask is not None and _require_tensor("attention_mask", mask).dim() == 4:
        if tuple(mask.shape) != (batch_size, 1, seq_len, seq_len):
            raise ValueError(
                f"attention_mask: 4-D mask must be [B, 1, S, S] = [{batch_size}, 1, {seq_len}, "
                f"{seq_len}], got {tuple(mask.shape)}"
            )
        field, ids = "attention_mask", _ids_from_block_causal_mask(mask)
    elif mask is not None:
        field, ids = "attention_mask", mask
    else:
        return torch.ones(batch_size, seq_len, dtype=torch.long, device=device)
    if tuple(ids.shape) != (batch_size, seq_len):
        raise ValueError(
            f"{field}: document ids must be [B, S] = [{batch_size}, {seq_len}] like the inputs, got {tuple(ids.shape)}"
        )
    if ids.is_floating_point():
        raise ValueError(f"{field}: document ids must be integer or bool, got {ids.dtype}")
    return ids.to(device=device, dtype=torch.long)


def _require_tensor(field: str, value: Any) -> torch.Tensor:
    """``value`` when it is a tensor, else a ``ValueError`` naming ``field``."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{field}: expected a tensor, got {type(value).__name__}")
    return value


def _seq_dim(field: str, tensor: torch.Tensor) -> int:
    return 2 if field == "position_ids" and tensor.dim() == 3 else 1


def _check_seq_field(field: str, tensor: Any, batch_size: int, seq_len: int) -> None:
    dim = _seq_dim(field, _require_tensor(field, tensor))
    if field == "position_ids" and tensor.dim() == 3 and tensor.shape[0] != 3:
        raise ValueError(f"position_ids: a 3-D tensor must be mRoPE [3, B, S], got {tuple(tensor.shape)}")
    if tensor.dim() <= dim or tensor.shape[dim] != seq_len or tensor.shape[dim - 1] != batch_size:
        raise ValueError(
            f"{field}: expected batch {batch_size} and sequence length {seq_len} like the inputs, "
            f"got shape {tuple(tensor.shape)}"
        )


def _pad_and_shard(
    field: str,
    tensor: torch.Tensor,
    pad_len: int,
    fill: float | int | bool,
    row_offset: int,
    local_len: int,
    positions: torch.Tensor | None,
) -> torch.Tensor:
    """Pad ``tensor`` on its sequence dim with ``fill`` and take this rank's rows.

    ``positions`` (original positions of the local rows) is ``None`` when the
    layout keeps the original order: the rows are then the slice
    ``[row_offset, row_offset + local_len)``.
    """
    dim = _seq_dim(field, tensor)
    if pad_len:
        shape = list(tensor.shape)
        shape[dim] = pad_len
        tensor = torch.cat((tensor, torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)), dim=dim)
    if positions is None:
        return tensor.narrow(dim, row_offset, local_len)
    return tensor.index_select(dim, positions.to(tensor.device))


def _cp_group(cp_mesh: DeviceMesh | None) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(group, cp_size, cp_rank)``; ``cp_mesh=None`` means a single rank without a process group."""
    if cp_mesh is None:
        return None, 1, 0
    if cp_mesh.ndim != 1:
        raise ValueError(f"cp_mesh must be the 1-D CP sub-mesh (e.g. mesh['cp']), got a {cp_mesh.ndim}-D mesh")
    world = cp_mesh.size()
    group = cp_mesh.get_group()
    group_world = dist.get_world_size(group)
    if group_world != world:
        raise RuntimeError(
            f"cp_mesh: its process group has {group_world} ranks but the mesh has {world}; the CP sub-group is "
            "mis-resolved (build the mesh with init_device_mesh(..., mesh_dim_names=(..., 'cp')) and pass mesh['cp'])"
        )
    return group, world, cp_mesh.get_local_rank()


def _row_options(options: state_module.CPOptions | None, knobs: dict[str, Any]) -> state_module.CPOptions:
    """The step's options: ``options``, else the process default with the knob arguments applied.

    Raises:
        ValueError: when both ``options`` and knob arguments are given (which should win is ambiguous).
    """
    given = {name: value for name, value in knobs.items() if value is not None}
    if options is not None:
        if not isinstance(options, state_module.CPOptions):
            raise ValueError(f"options: expected blockdiag_cp.CPOptions or None, got {type(options).__name__}")
        if given:
            raise ValueError(
                f"pass the knobs either in options= or as arguments, not both (got options= and "
                f"{', '.join(f'{k}=' for k in sorted(given))}); set them on the CPOptions: options.replace(...)"
            )
        return options
    return state_module.default_options().replace(**given) if given else state_module.default_options()


def make_cp_blockdiag_batch_and_ctx(
    cp_mesh: DeviceMesh | None,
    tp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    shard_primary: bool = True,
    options: state_module.CPOptions | None = None,
    agreement: state_module.StepAgreement | None = None,
    attn_backend: str | None = None,
    kv_exchange: str | None = None,
    layout: str | None = None,
    attn_shape: cost.Shape | None = None,
) -> tuple[Callable[..., contextlib.AbstractContextManager[RowState]], dict[str, Any], ShardLayout]:
    """Validate, pad and shard one packed batch, and build its step context.

    Everything is validated before anything is built, so a bad batch raises a
    ``ValueError`` naming the field and leaves no state behind; the caller's
    ``batch`` dict is never modified.

    Args:
        cp_mesh: The 1-D CP device (sub)mesh (``None``: one rank, no process group).
        tp_mesh: Unused (block-diagonal CP shards only the sequence); kept for the sharder signature.
        batch: Exactly one of ``input_ids [1, S]`` / ``inputs_embeds [1, S, H]``; optional
            ``labels``, ``position_ids`` (``[1, S]`` or mRoPE ``[3, 1, S]``), ``loss_mask``,
            ``_packed_seq_ids [1, S]`` (1-based per token, 0 = padding) or ``attention_mask``.
        loss_mask: Optional per-token loss weights ``[1, S]`` (stored as ``batch["loss_mask"]``).
        padding_token_id: Fill for padded ``input_ids``.
        shard_primary: ``False`` leaves ``input_ids`` / ``inputs_embeds`` whole (unpadded, original
            order) for models that embed inputs inside ``forward`` and shard the embeddings
            themselves (``current_blockdiag_cp_state().positions`` says which rows are this
            rank's, ``padded_seq_len`` how far to pad); every other sequence-aligned field is sharded.
        options: The step's knobs (:class:`~.state.CPOptions`; ``None``: the process default
            of ``configure_cp_varlen`` with the knob arguments below applied).
        agreement: The optimizer step's :class:`~.state.StepAgreement`: pass one to every row of a
            step (``grad_accum`` rows) and all of them are agreed on by one collective, at the first
            CP call of the step (``None``: this row is agreed on alone, at its own first call).
        attn_backend: Kernel for this step (``None``: from ``options`` / the default).
        kv_exchange: Exchange for this step.
        layout: ``contiguous``, ``balanced`` or ``auto``. The balanced layout reorders whole
            documents (and zig-zag splits a few) so every rank does the same attention work;
            every sequence-aligned field is permuted with its tokens, so position ids, labels and
            loss weights stay with them. ``auto`` picks per step with the cost model.
        attn_shape: The model's attention shape for ``layout=auto``'s cost model
            (``cost.Shape(heads, kv_heads, head_dim, elem_bytes)``; ``None``: a generic 8 x 128
            bf16 shape). The layout is chosen here, before any attention call shows the real shape.

    Returns:
        ``(train_ctx, batch, layout)``: ``train_ctx()`` is a context manager that activates the
        row state for forward *and* backward (wrap both) and restores the previous state on
        exit. On a normal exit it settles the step's kernel failures (one all-reduce over the CP
        group: every rank raises if a kernel failed on any rank); ``train_ctx(settle=False)``
        leaves that to the caller, who must call ``consensus.settle_failures`` (or fold the state's
        failure row into its own step all-reduce, as the recipe does) before updating weights.
        ``batch`` is a new dict holding this rank's rows (``attention_mask`` dropped,
        ``padding_mask`` added, True = pad); ``layout`` records the original and padded lengths.
    """
    knobs = {"attn_backend": attn_backend, "kv_exchange": kv_exchange, "layout": layout, "attn_shape": attn_shape}
    step_options = _row_options(options, knobs)
    group, world, rank = _cp_group(cp_mesh)

    if ("input_ids" in batch) == ("inputs_embeds" in batch):
        raise ValueError("batch: pass exactly one of 'input_ids' or 'inputs_embeds'")
    primary_field = "input_ids" if "input_ids" in batch else "inputs_embeds"
    primary = _require_tensor(primary_field, batch[primary_field])
    if primary.dim() < 2:
        raise ValueError(f"{primary_field}: expected [B, S, ...], got shape {tuple(primary.shape)}")
    batch_size, seq_len, device = primary.shape[0], primary.shape[1], primary.device
    if batch_size != 1:
        raise ValueError(
            f"{primary_field}: block-diagonal CP needs local batch size 1 (one packed row per rank), "
            f"got {batch_size}; pack the documents into one row and set the local batch size to 1"
        )

    doc_ids = _document_ids(batch, batch_size, seq_len, device)
    # errors name the field the ids came from (without one, the row itself: one document)
    source = next((f for f in ("_packed_seq_ids", "attention_mask") if batch.get(f) is not None), primary_field)
    runs = doc_runs_from_ids(doc_ids, source)
    fields = {k: v for k, v in batch.items() if k in SEQ_FIELDS and v is not None}
    fields["padding_mask"] = doc_ids.eq(0)
    if loss_mask is not None:
        fields["loss_mask"] = loss_mask
    for name, tensor in fields.items():
        _check_seq_field(name, tensor, batch_size, seq_len)
    if not shard_primary:
        del fields[primary_field]

    pad_len = (-seq_len) % (2 * world)
    padded_len = seq_len + pad_len
    plan = _shard_plan(runs.padded_to(padded_len), world, step_options, device)
    local_len = plan.local_len
    row_offset = rank * local_len
    positions = plan.permutation[row_offset : row_offset + local_len]
    fills = {"input_ids": padding_token_id, "labels": -100, "padding_mask": True}
    out = {k: v for k, v in batch.items() if k != "attention_mask"}
    for name, tensor in fields.items():
        out[name] = _pad_and_shard(
            name, tensor, pad_len, fills.get(name, 0), row_offset, local_len, None if plan.is_identity else positions
        )
    row_state = _build_row_state(group, rank, plan, device, step_options)
    if agreement is not None:
        row_state.agreement = agreement
    row_state.agreement.add(row_state)

    @contextlib.contextmanager
    def train_ctx(settle: bool = True) -> Iterator[RowState]:
        with state_module.activate_row_state(row_state):
            yield row_state
        # Only on a normal exit: after an exception peers may be anywhere, and a collective here could hang.
        if settle:
            consensus.settle_failures([row_state.failures], group, device)

    return train_ctx, out, ShardLayout(seq_len, padded_len, world, rank, row_offset, local_len, plan.layout, positions)


def _shard_plan(runs: DocRuns, cp: int, options: state_module.CPOptions, device: torch.device) -> ShardPlan:
    """The step's shard plan; ``auto`` asks the cost model (the options' attention shape, the device's machine)."""
    if options.layout != "auto":
        return make_shard_plan(runs, cp, options.layout)
    shape = options.attn_shape or cost.Shape()
    return cost.choose_layout(runs, cp, shape, cost.machine_for(device), options.overlap)


def _build_row_state(
    group: dist.ProcessGroup | None,
    rank: int,
    plan: ShardPlan,
    device: torch.device,
    options: state_module.CPOptions,
) -> RowState:
    """Precompute everything the attention layers of this row share: no call gathers, probes or syncs.

    The group's hosts (one collective the first time a group is seen, :mod:`.topology`), the GPU
    libraries (imported and probed once per process) and a hybrid's sub-groups (created the first time a
    group and factorization are seen, :mod:`.hybrid`) are looked up here, when every rank builds its row.

    Raises:
        ValueError: on every rank, for a ``head_parallel`` that does not factor the CP size.
    """
    cu_cpu = torch.tensor(plan.physical_cu_seqlens(), dtype=torch.int32)
    hosts = topology.group_hosts(group) if plan.cp > 1 else None
    groups = None
    # the hybrid's sub-groups (also auto's candidate factorization): created here, never inside an attention call
    h = hybrid.degree(options, plan.cp, hosts) if plan.cp > 1 else None
    groups = hybrid.build_groups(group, rank, h, hosts) if h is not None else None
    return RowState(
        group=group,
        cp_rank=rank,
        cp_size=plan.cp,
        row_offset=rank * plan.local_len,
        local_len=plan.local_len,
        shard_plan=plan,
        packed_cu_seqlens=cu_cpu.to(device),
        packed_cu_seqlens_cpu=cu_cpu,
        positions=plan.permutation[rank * plan.local_len : (rank + 1) * plan.local_len].to(device),
        options=options,
        hosts=hosts,
        libraries=gpu_libraries.probe_gpu_libraries(device),
        hybrid=groups,
        # The full-attention plan now, so inconsistent metadata fails at batch build; windowed ones at first use.
        cache=state_module.RowCache(windows={None: build_window_plan(plan, rank, None, device)}),
    )

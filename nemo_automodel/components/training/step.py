"""One optimizer step over ``grad_accum`` packed rows with block-diagonal CP."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from nemo_automodel.components.config.schema import CPConfig
from nemo_automodel.components.datasets.packing import IGNORE_INDEX
from nemo_automodel.components.distributed.blockdiag_cp import (
    cost,
    cp_attn_fire_count,
    exchange_stats,
    make_cp_blockdiag_batch_and_ctx,
    nonfinite_attention_inputs,
    reset_cp_attn_fire_count,
)
from nemo_automodel.components.distributed.blockdiag_cp.state import StepState
from nemo_automodel.components.distributed.parallel import Meshes
from nemo_automodel.components.models.cp_attention import attention_scope
from nemo_automodel.components.training.loss import global_label_count, token_ce_sum

logger = logging.getLogger("nemo_automodel.finetune")


@dataclass(frozen=True)
class StepSetup:
    """What every step needs besides the model and the data.

    Attributes:
        meshes: The CP sub-mesh and the flattened ``dp x cp`` mesh.
        device: Where the model lives.
        cp: The CP knobs (canonical ``attn_backend`` / ``kv_exchange``).
        attention: The ``model.attention`` route.
        pad_id: Fill for CP padding of ``input_ids``.
        grad_clip: Max global grad norm (``0``: no clipping; the norm is still reported).
        bf16: bf16 autocast (applied on CUDA only).
        on_nonfinite: ``stop`` or ``skip`` a step with NaN/Inf (``trainer.on_nonfinite``).
        attn_shape: The model's attention shape, for ``cp.layout=auto``'s cost model.
    """

    meshes: Meshes
    device: torch.device
    cp: CPConfig
    attention: str
    pad_id: int
    grad_clip: float
    bf16: bool
    on_nonfinite: str = "stop"
    attn_shape: cost.Shape | None = None

    @property
    def autocast_bf16(self) -> bool:
        return bf16_autocast(self.bf16, self.device)

    @property
    def reduce_group(self) -> dist.ProcessGroup:
        return self.meshes.dp_cp.get_group()


@dataclass(frozen=True)
class StepResult:
    """Global (all-reduced) values of one step.

    Attributes:
        loss: Mean CE over every label token of the global batch.
        grad_norm: Global gradient norm before clipping.
        tokens: Non-padding tokens of the global batch.
        loss_tokens: Label tokens of the global batch (what the loss averages over).
        kv_path: K/V exchange of the step's last CP attention call (``None`` at ``cp = 1``).
        kv_tokens_received: K/V tokens that call received, summed over all ranks.
        skipped: The step saw NaN/Inf (``trainer.on_nonfinite=skip``): no optimizer update.
    """

    loss: float
    grad_norm: float
    tokens: int
    kv_path: str | None
    kv_tokens_received: int
    skipped: bool = False
    loss_tokens: int = 0


class NonFiniteStepError(RuntimeError):
    """A step saw NaN/Inf and ``trainer.on_nonfinite=stop``; raised on every rank."""


def bf16_autocast(bf16: bool, device: torch.device) -> bool:
    """Whether ``trainer.bf16`` turns autocast on for ``device`` (CUDA only; CPU trains in fp32)."""
    return bf16 and device.type == "cuda"


def attention_shape(hf_config: Any, half_precision: bool) -> cost.Shape:
    """A Hugging Face config's attention shape: query heads, K/V heads, head dim, bytes per K/V element."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return cost.Shape(heads, kv_heads, head_dim, 2 if half_precision else 4)


def _shard(setup: StepSetup, row: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """This rank's CP slice of one packed row and its step context."""
    row = {k: v.to(setup.device) for k, v in row.items()}
    train_ctx, local, _ = make_cp_blockdiag_batch_and_ctx(
        setup.meshes.cp,
        None,
        row,
        padding_token_id=setup.pad_id,
        attn_backend=setup.cp.attn_backend,
        kv_exchange=setup.cp.kv_exchange,
        layout=setup.cp.layout,
        attn_shape=setup.attn_shape,
    )
    return train_ctx, local


def _autocast(setup: StepSetup) -> contextlib.AbstractContextManager[None]:
    return torch.autocast(setup.device.type, dtype=torch.bfloat16, enabled=setup.autocast_bf16)


def _check_cp_reached_attention(setup: StepSetup) -> None:
    """After the first CP forward: fail on every rank if the model's attention never called CP attention."""
    if setup.meshes.cp.size() > 1 and cp_attn_fire_count() == 0:
        raise RuntimeError(
            f"cp.size={setup.meshes.cp.size()} but the model's attention never reached block-diagonal CP "
            f"(model.attention={setup.attention}): each rank attended only to its own shard. Use "
            "model.attention=hf_interface for HF models (AttentionInterface), or model.attention=patch_sdpa for "
            "models that call torch.nn.functional.scaled_dot_product_attention"
        )


def _grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Global L2 norm of the (FSDP-sharded) gradients; clips when ``max_norm > 0``."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def _nonfinite_report(
    step: int, flags: list[list[float]], grad_norm: float, own_attention: list[str], rank: int
) -> str | None:
    """What was non-finite in ``step`` on which rank (``None``: everything finite).

    Args:
        step: The 1-based step (as in ``metrics.jsonl``).
        flags: Per rank of the ``dp x cp`` group, ``[attention inputs non-finite, loss non-finite]``.
        grad_norm: The global gradient norm.
        own_attention: This rank's ``nonfinite_attention_inputs`` lines (other ranks log their own).
        rank: This rank in the ``dp x cp`` group.
    """
    attention = [r for r, (bad, _) in enumerate(flags) if bad]
    loss = [r for r, (_, bad) in enumerate(flags) if bad]
    parts = []
    if attention:
        details = f" (rank {rank}: {'; '.join(own_attention)})" if own_attention else ""
        parts.append(f"CP attention inputs on rank(s) {attention}{details}")
    if loss:
        parts.append(f"loss on rank(s) {loss}")
    if not math.isfinite(grad_norm):
        parts.append(f"gradient norm {grad_norm}")
    return f"non-finite values in step {step}: {'; '.join(parts)}" if parts else None


def _attention_lines(states: list[StepState]) -> list[str]:
    """This rank's non-finite CP attention calls per micro-batch (one host sync per micro-batch, after backward)."""
    return [f"micro-batch {i}: {line}" for i, st in enumerate(states) for line in nonfinite_attention_inputs(st)]


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rows: list[dict[str, torch.Tensor]],
    setup: StepSetup,
    step: int,
    check_cp: bool = False,
) -> StepResult:
    """Forward/backward every row (one micro-batch each), then clip and step.

    Each micro-batch loss is its CE sum divided by the label-token count of the
    whole step on all ``dp x cp`` ranks; FSDP2 SUM-reduces gradients on the last
    micro-batch, so the update equals the ``cp = 1`` update on the same rows.
    Before the update every rank learns, in the same all-reduce as the step's
    totals, whether any rank saw NaN/Inf in its CP attention inputs or its loss;
    with the global gradient norm that decides ``setup.on_nonfinite``.

    Args:
        rows: This dp rank's packed rows, each ``{input_ids, labels, position_ids, _packed_seq_ids}`` ``[1, S]``.
        step: The 1-based step, for messages.
        check_cp: Verify after the first forward that attention went through CP (first step of a run).

    Raises:
        NonFiniteStepError: on every rank, with ``on_nonfinite=stop`` and NaN/Inf anywhere.
    """
    if check_cp:
        reset_cp_attn_fire_count()
    shards = [_shard(setup, row) for row in rows]
    label_count = global_label_count([local["labels"] for _, local in shards], setup.reduce_group)
    # clamp: a step whose rows hold only one-token documents has no label (its loss is 0, not NaN)
    total_labels = label_count.clamp(min=1)
    ce_sum = torch.zeros((), dtype=torch.float64, device=setup.device)
    tokens = torch.zeros((), dtype=torch.int64, device=setup.device)
    states: list[StepState] = []
    for i, (train_ctx, local) in enumerate(shards):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(i == len(shards) - 1)  # reduce once, after the last micro-batch
        with train_ctx() as state, attention_scope(setup.attention):
            with _autocast(setup):
                logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            if check_cp and i == 0:
                _check_cp_reached_attention(setup)
            micro_ce = token_ce_sum(logits, local["labels"])
            (micro_ce / total_labels).backward()  # keep the CP context open: recompute reads it
        states.append(state)
        ce_sum += micro_ce.detach().double()
        tokens += (~local["padding_mask"]).sum()
    grad_norm = _grad_norm(model, setup.grad_clip)
    stats = exchange_stats() if setup.meshes.cp.size() > 1 else None
    kv_received = float(stats["kv_tokens_received"]) if stats else 0.0
    own_attention = _attention_lines(states)
    group = setup.reduce_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flags = torch.zeros(world, 2, dtype=torch.float64, device=setup.device)
    flags[rank, 0] = float(bool(own_attention))
    flags[rank, 1] = (~ce_sum.isfinite()).double()
    kv = torch.tensor([kv_received], dtype=torch.float64, device=setup.device)
    totals = torch.cat([ce_sum[None], tokens.double()[None], kv, flags.flatten()])
    dist.all_reduce(totals, group=group)  # one tiny all-reduce: step totals and every rank's non-finite flags
    report = _nonfinite_report(step, totals[3:].view(world, 2).tolist(), grad_norm, own_attention, rank)
    if report is not None and setup.on_nonfinite == "stop":
        raise NonFiniteStepError(f"{report}; trainer.on_nonfinite=stop (set trainer.on_nonfinite=skip to skip it)")
    if report is not None:
        logger.warning("%s; trainer.on_nonfinite=skip: gradients zeroed, optimizer step skipped", report)
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=float(totals[0] / total_labels),
        grad_norm=grad_norm,
        tokens=int(totals[1]),
        kv_path=stats["path"] if stats else None,
        kv_tokens_received=int(totals[2]),
        skipped=report is not None,
        loss_tokens=int(label_count),
    )


@dataclass(frozen=True)
class ValidationResult:
    """Global validation figures: mean CE over every label token, its exponential, and the token count."""

    loss: float
    ppl: float
    loss_tokens: int


def validate(model: torch.nn.Module, rows: list[dict[str, torch.Tensor]], setup: StepSetup) -> ValidationResult:
    """Collective over ``dp x cp``: the validation loss of ``rows`` through the training's CP path, without grads.

    Args:
        rows: This dp rank's validation rows, each ``{input_ids, labels, position_ids, _packed_seq_ids}``
            ``[1, S]``; every dp rank passes the same number (FSDP gathers parameters in each forward).
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=setup.device)  # [CE sum, label tokens]
    with torch.no_grad():
        for row in rows:
            train_ctx, local = _shard(setup, row)
            with train_ctx(), attention_scope(setup.attention), _autocast(setup):
                logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            totals[0] += token_ce_sum(logits, local["labels"]).double()
            totals[1] += (local["labels"] != IGNORE_INDEX).sum()
    model.train(was_training)
    dist.all_reduce(totals, group=setup.reduce_group)
    loss = float(totals[0] / totals[1].clamp(min=1))
    return ValidationResult(loss, math.exp(min(loss, 700.0)), int(totals[1]))

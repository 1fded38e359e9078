"""One optimizer step over ``grad_accum`` packed rows with block-diagonal CP."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from nemo_automodel.components.config.schema import CPConfig, bf16_autocast
from nemo_automodel.components.datasets.packing import IGNORE_INDEX
from nemo_automodel.components.distributed.blockdiag_cp import (
    CPOptions,
    RowState,
    StepAgreement,
    attention_inputs_nonfinite,
    cost,
    exchange_stats,
    failure_diagnostics,
    failure_message,
    failure_row,
    make_cp_blockdiag_batch_and_ctx,
    nonfinite_attention_inputs,
)
from nemo_automodel.components.distributed.parallel import Meshes
from nemo_automodel.components.models.cp_attention import attention_scope
from nemo_automodel.components.training.loss import token_ce_sum
from nemo_automodel.components.training.preemption import any_rank

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
        options: The CP options every step snapshots (:func:`cp_options`).
    """

    meshes: Meshes
    device: torch.device
    cp: CPConfig
    attention: str
    pad_id: int
    grad_clip: float
    bf16: bool
    on_nonfinite: str = "stop"
    options: CPOptions = field(default_factory=CPOptions)

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
        preempted: Some rank saw a preemption signal (every rank stops after this step).
        exchange_wait_s: Seconds this rank blocked on K/V exchanges, forward and backward (what
            overlap did not hide, plus waits for slower peers).
    """

    loss: float
    grad_norm: float
    tokens: int
    kv_path: str | None
    kv_tokens_received: int
    skipped: bool = False
    preempted: bool = False
    exchange_wait_s: float = 0.0
    loss_tokens: int = 0


class NonFiniteStepError(RuntimeError):
    """A step saw NaN/Inf and ``trainer.on_nonfinite=stop``; raised on every rank."""


def attention_shape(hf_config: Any, half_precision: bool) -> cost.Shape:
    """A Hugging Face config's attention shape: query heads, K/V heads, head dim, bytes per K/V element."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return cost.Shape(heads, kv_heads, head_dim, 2 if half_precision else 4)


def cp_options(cp: CPConfig, attn_shape: cost.Shape | None) -> CPOptions:
    """The recipe's ``cp`` node as the core's frozen options (built once per run, snapshotted into every row)."""
    return cp.options(attn_shape)


def _shard(
    setup: StepSetup, row: dict[str, torch.Tensor], agreement: StepAgreement | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """This rank's CP slice of one packed row and its context (agreed on with the rows of ``agreement``)."""
    row = {k: v.to(setup.device) for k, v in row.items()}
    train_ctx, local, _ = make_cp_blockdiag_batch_and_ctx(
        setup.meshes.cp, None, row, padding_token_id=setup.pad_id, options=setup.options, agreement=agreement
    )
    return train_ctx, local


def _autocast(setup: StepSetup) -> contextlib.AbstractContextManager[None]:
    return torch.autocast(setup.device.type, dtype=torch.bfloat16, enabled=setup.autocast_bf16)


def _check_cp_reached_attention(setup: StepSetup, state: RowState) -> None:
    """After the first forward: fail on every rank if the model's attention never called CP attention.

    At any cp (cp=1 included: a model whose attention bypasses the interface, such as Bloom's ALiBi code, lets
    packed documents attend each other); ``model.attention=eager`` never calls it by design (cp=1 only).
    """
    if setup.attention != "eager" and exchange_stats(state) is None:
        cp = setup.meshes.cp.size()
        shard = "each rank attended only to its own shard and " if cp > 1 else ""
        raise RuntimeError(
            f"cp.size={cp} but the model's attention never reached block-diagonal CP "
            f"(model.attention={setup.attention}): {shard}packed documents attended each other. Use "
            "model.attention=hf_interface for HF models (AttentionInterface), or model.attention=patch_sdpa for "
            "models that call torch.nn.functional.scaled_dot_product_attention; a model with its own attention "
            "code cannot be trained on packed rows"
        )


def _grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Global L2 norm of the (FSDP-sharded) gradients; clips when ``max_norm > 0``."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def _scale_grads(model: torch.nn.Module, factor: float) -> None:
    """Multiply every gradient by ``factor`` (sharded gradients in place: no communication)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


def _nonfinite_report(
    step: int,
    flags: list[list[float]],
    grad_norm: float,
    own_attention: list[str],
    rank: int,
    attention_checked: bool = True,
) -> str | None:
    """What was non-finite in ``step`` on which rank (``None``: everything finite).

    Args:
        step: The 1-based step (as in ``metrics.jsonl``).
        flags: Per rank of the ``dp x cp`` group, ``[attention inputs non-finite, loss non-finite]``.
        grad_norm: The global gradient norm.
        own_attention: This rank's ``nonfinite_attention_inputs`` lines (other ranks log their own).
        rank: This rank in the ``dp x cp`` group.
        attention_checked: ``cp.check_finite`` was on (else the report says how to name the attention call).
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
    if parts and not attention_checked:
        parts.append("set cp.check_finite=true to name the first CP attention call whose q/k/v were not finite")
    return f"non-finite values in step {step}: {'; '.join(parts)}" if parts else None


def _attention_lines(states: list[RowState]) -> list[str]:
    """This rank's non-finite CP attention calls per micro-batch (host syncs: called only when a rank saw some)."""
    return [f"micro-batch {i}: {line}" for i, st in enumerate(states) for line in nonfinite_attention_inputs(st)]


# The step's one control all-reduce: these global sums, then PER_RANK columns for every rank of dp x cp.
_SUMS = ("ce_sum", "tokens", "label_tokens", "kv_tokens_received", "preempt")
_PER_RANK = ("attention_nonfinite", "loss_nonfinite", "failed_micro_batch", "failed_forward", "failed_backward")


@dataclass(frozen=True)
class _Totals:
    """The step's all-reduced values (the same on every rank)."""

    sums: dict[str, float]
    per_rank: list[list[float]]  # [world][len(_PER_RANK)]

    def column(self, name: str) -> list[float]:
        return [row[_PER_RANK.index(name)] for row in self.per_rank]


def _step_totals(
    setup: StepSetup,
    sums: dict[str, torch.Tensor | float],
    states: list[RowState],
    ce_sum: torch.Tensor,
) -> _Totals:
    """One all-reduce over ``dp x cp``: loss, tokens, label tokens, K/V, preemption, every rank's flags and failures."""
    group = setup.reduce_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = setup.device
    own = torch.zeros(world, len(_PER_RANK), dtype=torch.float64, device=device)
    own[rank, 0] = attention_inputs_nonfinite(states, device)
    own[rank, 1] = (~ce_sum.isfinite()).double()
    own[rank, 2:] = torch.tensor(failure_row([st.failures for st in states]), dtype=torch.float64, device=device)
    head = torch.stack([torch.as_tensor(sums[name], dtype=torch.float64, device=device) for name in _SUMS])
    totals = torch.cat([head, own.flatten()])
    dist.all_reduce(totals, group=group)
    values = totals.tolist()  # the step's one host sync for its totals
    return _Totals(
        dict(zip(_SUMS, values)), [values[len(_SUMS) + r * len(_PER_RANK) :][: len(_PER_RANK)] for r in range(world)]
    )


def _exchange_wait_s(state: RowState) -> float:
    """Seconds this rank blocked on the row's K/V exchanges, forward and backward (0 before any CP call)."""
    stats = exchange_stats(state)
    return 0.0 if stats is None else stats["exchange_wait_s"] + stats["exchange_backward_wait_s"]


def _raise_on_kernel_failures(setup: StepSetup, totals: _Totals, states: list[RowState]) -> None:
    """Every rank raises, before the optimizer touches the weights, when a CP kernel failed on any rank."""
    rows = [[int(v) for v in row[2:]] for row in totals.per_rank]
    cp = setup.meshes.cp.size()
    message = failure_message(
        rows, lambda r: f"rank {r} (cp rank {r % cp})", failure_diagnostics([st.failures for st in states])
    )
    if message is not None:
        raise RuntimeError(message)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rows: list[dict[str, torch.Tensor]],
    setup: StepSetup,
    step: int,
    check_cp: bool = False,
    preempt: Callable[[], bool] = lambda: False,
) -> StepResult:
    """Forward/backward every row (one micro-batch each), then one all-reduce, then clip and step.

    Control collectives per optimizer step, whatever ``grad_accum`` is: the CP agreement on every
    row at once (the step's first CP attention call; none at ``cp = 1``) and the step all-reduce.

    Each micro-batch's backward starts from its CE *sum*; FSDP2 SUM-reduces
    gradients on the last micro-batch; after the step's single control
    all-reduce every gradient is divided by the global label-token count, so
    the update equals the ``cp = 1`` update on the same rows (mean CE over all
    label tokens). That all-reduce also carries the token counts, the K/V
    received, the preemption flag, whether any rank saw NaN/Inf in its CP
    attention inputs or its loss, and every rank's CP kernel failures: a failure
    anywhere makes every rank raise before the optimizer touches the weights.

    Args:
        rows: This dp rank's packed rows, each ``{input_ids, labels, position_ids, _packed_seq_ids}`` ``[1, S]``.
        step: The 1-based step, for messages.
        check_cp: Verify after the first forward that attention went through CP (first step of a run).
        preempt: Whether this rank saw a preemption signal; read as the step's all-reduce starts (so a
            signal during this step's compute stops the run after this step), agreed over all ranks there.

    Raises:
        NonFiniteStepError: on every rank, with ``on_nonfinite=stop`` and NaN/Inf anywhere.
        RuntimeError: on every rank, when a CP attention kernel failed on any rank.
    """
    agreement = StepAgreement()  # every row built first: one agreement collective for the whole step
    shards = [_shard(setup, row, agreement) for row in rows]
    ce_sum = torch.zeros((), dtype=torch.float64, device=setup.device)
    tokens = torch.zeros((), dtype=torch.int64, device=setup.device)
    label_tokens = torch.zeros((), dtype=torch.int64, device=setup.device)
    states: list[RowState] = []
    for i, (train_ctx, local) in enumerate(shards):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(i == len(shards) - 1)  # reduce once, after the last micro-batch
        # settle=False: kernel failures are settled below, in the step's one all-reduce
        with train_ctx(settle=False) as state, attention_scope(setup.attention):
            with _autocast(setup):
                logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            if check_cp and i == 0:
                _check_cp_reached_attention(setup, state)
            micro_ce = token_ce_sum(logits, local["labels"])
            micro_ce.backward()  # keep the CP context open: recompute reads it
        states.append(state)
        ce_sum += micro_ce.detach().double()
        tokens += (~local["padding_mask"]).sum()
        label_tokens += (local["labels"] != IGNORE_INDEX).sum()
    last = exchange_stats(states[-1]) if setup.meshes.cp.size() > 1 else None
    kv = last["kv_tokens_received"] if last is not None else 0
    sums = {"ce_sum": ce_sum, "tokens": tokens, "label_tokens": label_tokens, "kv_tokens_received": kv}
    totals = _step_totals(setup, {**sums, "preempt": float(preempt())}, states, ce_sum)
    _raise_on_kernel_failures(setup, totals, states)
    # clamp: a step whose rows hold only one-token documents has no label (its loss is 0, not NaN)
    total_labels = max(totals.sums["label_tokens"], 1.0)
    _scale_grads(model, 1.0 / total_labels)
    grad_norm = _grad_norm(model, setup.grad_clip)
    group = setup.reduce_group
    flags = [[a, b] for a, b in zip(totals.column("attention_nonfinite"), totals.column("loss_nonfinite"))]
    own_attention = _attention_lines(states) if flags[dist.get_rank(group)][0] else []
    checked = all(st.options.check_finite for st in states)
    report = _nonfinite_report(step, flags, grad_norm, own_attention, dist.get_rank(group), checked)
    if report is not None and setup.on_nonfinite == "stop":
        raise NonFiniteStepError(f"{report}; trainer.on_nonfinite=stop (set trainer.on_nonfinite=skip to skip it)")
    if report is not None:
        logger.warning("%s; trainer.on_nonfinite=skip: gradients zeroed, optimizer step skipped", report)
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=totals.sums["ce_sum"] / total_labels,
        grad_norm=grad_norm,
        tokens=int(totals.sums["tokens"]),
        kv_path=last["path"] if last is not None else None,
        kv_tokens_received=int(totals.sums["kv_tokens_received"]),
        skipped=report is not None,
        preempted=totals.sums["preempt"] > 0,
        exchange_wait_s=sum(_exchange_wait_s(st) for st in states),
        loss_tokens=int(totals.sums["label_tokens"]),
    )


@dataclass(frozen=True)
class ValidationResult:
    """Global validation figures: mean CE over every label token, its exponential, and the token count.

    ``interrupted``: a preemption signal cut the pass short (the figures cover only the batches before it).
    """

    loss: float
    ppl: float
    loss_tokens: int
    interrupted: bool = False


def validate(
    model: torch.nn.Module,
    rows: list[dict[str, torch.Tensor]],
    setup: StepSetup,
    stop: Callable[[], bool] | None = None,
) -> ValidationResult:
    """Collective over ``dp x cp``: the validation loss of ``rows`` through the training's CP path, without grads.

    Args:
        rows: This dp rank's validation rows, each ``{input_ids, labels, position_ids, _packed_seq_ids}``
            ``[1, S]``; every dp rank passes the same number (FSDP gathers parameters in each forward).
        stop: Whether this rank saw a preemption signal; agreed over every rank before each batch (one
            one-element all-reduce and host sync per batch), so a signal ends the pass within one batch.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=setup.device)  # [CE sum, label tokens]
    interrupted = False
    with torch.no_grad():
        for row in rows:
            if stop is not None and any_rank(stop(), setup.reduce_group, setup.device):
                interrupted = True
                break
            train_ctx, local = _shard(setup, row)
            with train_ctx(), attention_scope(setup.attention), _autocast(setup):
                logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            totals[0] += token_ce_sum(logits, local["labels"]).double()
            totals[1] += (local["labels"] != IGNORE_INDEX).sum()
    model.train(was_training)
    dist.all_reduce(totals, group=setup.reduce_group)
    loss = float(totals[0] / totals[1].clamp(min=1))
    return ValidationResult(loss, math.exp(min(loss, 700.0)), int(totals[1]), interrupted)

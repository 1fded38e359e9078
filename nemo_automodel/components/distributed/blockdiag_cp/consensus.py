"""Collective agreement: every rank takes the same path, and one rank's failure makes every rank raise.

Over the CP group:

- :func:`failed_ranks`: which ranks report a problem (one all-reduce of a ``[world]`` vector);
- :func:`check_agreement`: at a packed row's first CP attention call, every rank
  compares the row's settings, resolved kernel and path, document layout and q/k/v
  shapes with every other rank's (one all-reduce of fingerprints) and all raise the
  same error on a disagreement, before any path-dependent collective; later calls of
  the row are not re-checked;
- the failure protocol a caller with its own step all-reduce folds into it (as the recipe does):
  :func:`failure_row` (this rank's row of numbers to all-reduce), :func:`failure_message`
  (the error every rank raises from everyone's rows) and :func:`failure_diagnostics` (this
  rank's own lines);
- :class:`GuardedKernel` (no collective): runs a kernel so that an exception, forward or
  backward, is recorded in the row's :class:`~.state.FailureLog` instead of unwinding one
  rank alone; the rank continues with zeros, and :func:`settle_failures` (once per step, or
  folded into the recipe's step all-reduce) makes every rank raise together, naming the
  failing ranks.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp.state import FailureLog

logger = logging.getLogger(__name__)

# Exceptions that are control flow, not failures: non-reentrant checkpointing stops
# a recompute early by raising through the forward.
_CONTROL_FLOW: tuple[type[BaseException], ...] = (torch.utils.checkpoint._StopRecomputationError,)


def saved_tensor_hooks_active() -> bool:
    """True under saved-tensor hooks (non-reentrant activation checkpointing, CPU offloading).

    Their tensors are re-materialized per backward graph task, so a kernel graph
    differentiated from inside a backward node would trigger a second recompute
    (with its collectives) on some ranks only. Unknown torch internals count as active.
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _gather_rows(row: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[list[int]]:
    """Every rank's ``row`` (same length everywhere), as one all-reduce of a ``[world, len(row)]`` matrix."""
    world = group_size(group)
    if world == 1:
        return [row]
    table = torch.zeros(world, len(row), dtype=torch.int64, device=device)
    table[dist.get_rank(group)] = torch.tensor(row, dtype=torch.int64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    return table.tolist()


def failed_ranks(ok: bool, group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """Group ranks that reported ``ok=False``; every rank gets the same list."""
    return [r for r, (bad,) in enumerate(_gather_rows([0 if ok else 1], group, device)) if bad]


def fingerprint(value: Any) -> int:
    """A process-independent signed 63-bit hash of ``repr(value)`` (Python's ``hash`` is salted per process)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_agreement(fields: dict[str, Any], group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Raise the same ``RuntimeError`` on every rank unless all ranks report identical ``fields``.

    Args:
        fields: What must agree (configuration, sequence lengths, document
            layout, call shapes). Values are compared by fingerprint.
        group: The CP process group.
        device: Device for the collective's tensor.
    """
    names = sorted(fields)
    rows = _gather_rows([fingerprint(fields[n]) for n in names], group, device)
    differing = [n for i, n in enumerate(names) if len({row[i] for row in rows}) > 1]
    if differing:
        groups: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            groups.setdefault(fingerprint([row[names.index(n)] for n in differing]), []).append(rank)
        raise RuntimeError(
            f"block-diagonal CP ranks disagree on {', '.join(differing)} (rank groups that agree: "
            f"{sorted(groups.values())}; this rank has {', '.join(f'{n}={fields[n]!r}' for n in differing)}). "
            "Every CP rank must use the same configuration and the same packed batch; check the launch "
            "arguments and that the data loader feeds identical batches to the ranks of a CP group."
        )


# One rank's failures of a step, as the collective carries them: (micro-batch + 1, first failing
# forward call + 1, first failing backward call + 1); zeros when nothing failed.
FailureRow = tuple[int, int, int]


def failure_row(logs: Sequence[FailureLog]) -> FailureRow:
    """This rank's row for the settlement: the first micro-batch (of ``logs``) with a failure, and its calls."""
    for index, log in enumerate(logs):
        if log:
            forward, backward = log.first("forward"), log.first("backward")
            return index + 1, 0 if forward is None else forward + 1, 0 if backward is None else backward + 1
    return 0, 0, 0


def failure_message(rows: Sequence[Sequence[int]], rank_name: Callable[[int], str], own: Sequence[str]) -> str | None:
    """The error every rank raises for a step whose kernels failed somewhere (``None``: nothing failed).

    Args:
        rows: Every rank's :data:`FailureRow`, indexed by rank (identical on every rank).
        rank_name: How a rank is named in the message (``"CP rank 1"``, ``"rank 3 (dp 1, cp 1)"``).
        own: This rank's own diagnostics (appended to its message only).
    """
    parts = []
    for column, direction in ((1, "forward"), (2, "backward")):
        failed = [r for r, row in enumerate(rows) if row[column]]
        if failed:
            where = "; ".join(
                f"{rank_name(r)}: CP attention call {rows[r][column] - 1}"
                + (f" of micro-batch {rows[r][0] - 1}" if len(rows[r]) > 2 and rows[r][0] > 1 else "")
                for r in failed
            )
            parts.append(f"{direction} failed on CP rank(s) {failed} ({where})")
    if not parts:
        return None
    mine = f"; this rank: {'; '.join(own)}" if own else ""
    return (
        f"block-diagonal CP attention {'; '.join(parts)}: every rank raises instead of training on the zeros "
        f"the failed kernel left{mine}"
    )


def failure_diagnostics(logs: Sequence[FailureLog]) -> list[str]:
    """This rank's recorded failures, one line each."""
    return [
        f"{direction} of CP attention call {call}: {text}"
        for log in logs
        for direction in ("forward", "backward")
        for call, text in getattr(log, direction)
    ]


def settle_failures(logs: Sequence[FailureLog], group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Collective, once per step: raise the same error on every rank when a kernel failed on any rank.

    One all-reduce of every rank's :data:`FailureRow` (after backward, so
    backward failures are included). Ranks are named by CP rank.
    """
    mine = failure_diagnostics(logs)
    for line in mine:
        logger.error("CP attention failed on this rank: %s", line)
    rows = _gather_rows(list(failure_row(logs)), group, device)
    message = failure_message(rows, lambda r: f"CP rank {r}", mine)
    if message is not None:
        raise RuntimeError(message)


@dataclass(frozen=True)
class CallRecorder:
    """Where one CP attention call records its kernel failures: the step's log and the call's index."""

    log: FailureLog
    call: int

    def fail(self, direction: str, diagnostic: str) -> None:
        self.log.record(direction, self.call, diagnostic)

    def failed(self, direction: str) -> bool:
        """Whether this call failed in ``direction`` on this rank."""
        return any(call == self.call for call, _ in getattr(self.log, direction))


class GuardedKernel(torch.autograd.Function):
    """Run ``fn(q, k, v, *extra)``; an exception (forward or backward) is recorded instead of raised.

    ``extra`` are further differentiable inputs of the kernel (attention sinks).

    On failure the output (or the input gradients) are zeros of the right shape,
    so this rank keeps issuing the same collectives as its peers until the
    step's settlement makes every rank raise. The kernel's own autograd graph
    is built inside the forward and differentiated in the backward. A kernel may
    return its output as row pieces (a tuple, see :func:`_call`): they are returned as they are.
    """

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        recorder: CallRecorder,
        describe: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *extra: torch.Tensor,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        ctx.recorder, ctx.describe = recorder, describe
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in (q, k, v, *extra))
        with torch.enable_grad():
            out = _call(fn, recorder, describe, *inputs)
        ctx.inputs, ctx.out = inputs, out
        return tuple(p.detach() for p in out) if isinstance(out, tuple) else out.detach()

    @staticmethod
    def backward(ctx: Any, *grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs, out = ctx.inputs, ctx.out
        ctx.inputs = ctx.out = None  # free the kernel's graph as soon as it is used
        outs = out if isinstance(out, tuple) else (out,)
        wanted = [t for t in inputs if t.requires_grad]
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        try:
            if any(p.requires_grad for p in outs) and wanted:
                found = iter(torch.autograd.grad(outs, wanted, grad, allow_unused=True))
                grads = [next(found) if t.requires_grad else None for t in inputs]
        except Exception as exc:  # same contract as the forward
            ctx.recorder.fail("backward", f"{type(exc).__name__}: {exc} [{ctx.describe}]")
            grads = [torch.zeros_like(t) if t.requires_grad else None for t in inputs]
        grads = [torch.zeros_like(t) if g is None and t.requires_grad else g for g, t in zip(grads, inputs)]
        return (None, None, None, *grads)


def _call(
    fn: Callable[..., torch.Tensor | None],
    recorder: CallRecorder,
    describe: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *extra: torch.Tensor,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``fn(q, k, v, *extra)``; an exception or a missing/misshaped output is recorded and replaced by zeros.

    The expected output is the query's shape with the value head dim (``[B, Hq, L, Dv]``, or
    ``[n, Hq, Dv]`` for token-major kernels), or a tuple of row pieces (token-major kernels,
    one per library call) that together have that shape; zeros replace it in the same form.
    """
    shape = (*q.shape[:-1], v.shape[-1])
    try:
        out = fn(q, k, v, *extra)
    except _CONTROL_FLOW:
        raise
    except Exception as exc:  # settle first; every rank raises together
        recorder.fail("forward", f"{type(exc).__name__}: {exc} [{describe}]")
        return _zeros_like_output(q, shape, out=None)
    if not _has_shape(out, shape):
        got = "no output" if out is None else f"output {type(out).__name__} {getattr(out, 'shape', '')}"
        recorder.fail("forward", f"kernel returned {got}, expected a tensor {shape} [{describe}]")
        return _zeros_like_output(q, shape, out)
    return out


def _has_shape(out: object, shape: tuple[int, ...]) -> bool:
    """``out`` is a tensor of ``shape``, or row pieces (a non-empty tuple of tensors) that stack to it."""
    if isinstance(out, torch.Tensor):
        return out.shape == shape
    if not isinstance(out, tuple) or not out or not all(isinstance(p, torch.Tensor) for p in out):
        return False
    return all(p.shape[1:] == shape[1:] for p in out) and sum(p.shape[0] for p in out) == shape[0]


def _zeros_like_output(q: torch.Tensor, shape: tuple[int, ...], out: object) -> torch.Tensor | tuple[torch.Tensor]:
    """Zeros in the form the kernel's contract has: a tensor, or one piece for a kernel that returns pieces."""
    zeros = q.new_zeros(shape)
    return (zeros,) if isinstance(out, tuple) or q.dim() == 3 else zeros


def guarded(
    fn: Callable[..., torch.Tensor | None],
    recorder: CallRecorder,
    describe: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *extra: torch.Tensor,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``fn(q, k, v, *extra)`` with failures (an exception, or no output) recorded by ``recorder``.

    The backward is guarded too (see :class:`GuardedKernel`) unless autograd is
    off or saved-tensor hooks are active (non-reentrant checkpointing); then the
    kernel joins the caller's graph directly and only its forward is guarded: a
    backward failure raises on its rank, and its peers fail at their next
    collective (the process-group timeout bounds the wait).
    """
    inputs = (q, k, v, *extra)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs) and not saved_tensor_hooks_active():
        return GuardedKernel.apply(fn, recorder, describe, *inputs)
    return _call(fn, recorder, describe, *inputs)

"""Randomized fault trials: generated in the test process, run on every rank of a pool, judged in the test.

A trial is one step (forward and backward) of an :class:`~tests.faults.injection.AttentionStack`
on a random packed layout, with at most one injected fault. Each rank reports
what it raised and when, and whether the group was still in step afterwards.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from nemo_automodel.components.distributed.blockdiag_cp import make_cp_blockdiag_batch_and_ctx
from nemo_automodel.components.distributed.blockdiag_cp.layout import doc_runs_from_ids, make_shard_plan
from nemo_automodel.testing.cases import cp_mesh
from nemo_automodel.testing.reference import doc_ids_from_lengths
from tests.faults.injection import FAULT_TYPES, AttentionStack, Fault, in_step, injected

LOCAL = 16  # local rows per rank
EXCHANGES = ("allgather", "halo", "a2a", "auto")


@dataclass(frozen=True)
class Trial:
    """One step of a random model on a random layout, with ``fault`` injected (``None``: a clean step).

    Attributes:
        doc_ids: ``[1, S]`` document ids; ``knobs`` go to the batch builder.
        layers: Attention layers of the model.
        seed: Weights and inputs (identical on every rank).
        fault: The injected fault.
        checkpointed: Non-reentrant activation checkpointing around every layer.
        per_rank: Batch-builder overrides for single ranks, ``{rank: {"doc_ids" | knob: value}}``.
    """

    doc_ids: torch.Tensor
    knobs: dict[str, str]
    layers: int
    seed: int
    fault: Fault | None = None
    checkpointed: bool = False
    per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        what = self.fault.label if self.fault else "clean"
        return f"seed {self.seed}: {what} on rank {self.fault.rank if self.fault else '-'} / {self.knobs}"


@dataclass
class Outcome:
    """What one rank saw in one trial (``time.monotonic()`` stamps are comparable across local processes)."""

    error_type: str | None
    error: str | None
    started_at: float
    fired_at: float | None
    raised_at: float | None
    kernel_calls: int
    in_step: bool | None  # None: not checked (a trial on a fresh group that the fault may break)


def random_lengths(rng: random.Random, real: int) -> list[int]:
    """Random document lengths summing to ``real``: a mix of short documents and some longer than a shard."""
    lengths: list[int] = []
    while sum(lengths) < real:
        n = rng.choice([rng.randint(1, 6), rng.randint(5, LOCAL), rng.randint(LOCAL, 3 * LOCAL)])
        lengths.append(min(n, real - sum(lengths)))
    return lengths


def ranks_with_tokens(doc_ids: torch.Tensor, cp: int, layout: str) -> list[int]:
    """CP ranks holding real tokens under ``layout`` (a fault on an all-padding rank never fires: no kernel runs)."""
    padded = doc_ids.shape[1] + (-doc_ids.shape[1]) % (2 * cp)
    plan = make_shard_plan(doc_runs_from_ids(doc_ids).padded_to(padded), cp, layout)
    return [r for r, pieces in enumerate(plan.pieces) if pieces]


def kernel_fault_trials(cp: int, count: int, seed: int, exchanges: tuple[str, ...] = EXCHANGES) -> list[Trial]:
    """``count`` trials cycling through every exchange of ``exchanges`` x fault type, the rest random.

    Random: layout (contiguous/balanced), documents, padding tail, kernel
    (sdpa_varlen/dense), depth (2-4 layers), failing rank (one holding tokens), failing layer.
    """
    rng = random.Random(seed)
    trials = []
    for i in range(count):
        exchange = exchanges[i % len(exchanges)]
        phase, kind = FAULT_TYPES[(i // len(exchanges)) % len(FAULT_TYPES)]
        layout = rng.choice(["contiguous", "balanced"])
        total = cp * LOCAL
        real = total - rng.randint(0, LOCAL - 1)
        ids = doc_ids_from_lengths(random_lengths(rng, real), total)
        layers = rng.randint(2, 4)
        rank = rng.choice(ranks_with_tokens(ids, cp, layout))
        knobs = {"kv_exchange": exchange, "attn_backend": rng.choice(["sdpa_varlen", "dense"]), "layout": layout}
        fault = Fault(rank=rank, layer=rng.randrange(layers), phase=phase, kind=kind)
        trials.append(Trial(ids, knobs, layers, seed=seed * 1000 + i, fault=fault))
    return trials


def run_trials(trials: list[Trial], group_timeout_s: float | None = None) -> list[Outcome]:
    """Pool worker: run every trial on this rank; exceptions are outcomes, not failures of the worker.

    Args:
        trials: The trials, identical on every rank.
        group_timeout_s: Run each trial on a fresh CP group with this timeout, destroyed afterwards (faults
            that break a group: a stuck rank, an unguarded backward failure); ``None``: the world's CP
            mesh, which must still be in step after every trial.
    """
    if group_timeout_s is None:
        mesh = cp_mesh()
        return [_run_one(mesh, trial, check_in_step=True) for trial in trials]
    outcomes = []
    for trial in trials:
        group = dist.new_group(timeout=timedelta(seconds=group_timeout_s))
        outcomes.append(_run_one(DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",)), trial, False))
        dist.destroy_process_group(group)
    return outcomes


def _inputs(trial: Trial, rank: int) -> tuple[torch.Tensor, dict[str, str]]:
    """This rank's document ids and knobs (``per_rank`` overrides applied)."""
    override = dict(trial.per_rank.get(rank, {}))
    return override.pop("doc_ids", trial.doc_ids), {**trial.knobs, **override}


def _run_one(mesh: DeviceMesh, trial: Trial, check_in_step: bool) -> Outcome:
    rank = mesh.get_local_rank()
    doc_ids, knobs = _inputs(trial, rank)
    batch = {"input_ids": torch.zeros(1, doc_ids.shape[1], dtype=torch.long), "_packed_seq_ids": doc_ids}
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, **knobs)
    gen = torch.Generator().manual_seed(trial.seed)
    x_full = torch.randn(1, shard.padded_seq_len, AttentionStack.HIDDEN, generator=gen, dtype=torch.float64)
    x = x_full.index_select(1, shard.positions).requires_grad_()
    backend = knobs["attn_backend"]
    calls = [0]
    error_type = error = raised_at = None
    in_step(mesh.get_group(), trial.seed)  # start together: times are measured from here
    started_at = time.monotonic()
    with injected(backend, trial.fault, rank) as injector:
        real = injector.real

        def counting(*args: Any) -> torch.Tensor:
            calls[0] += 1
            return real(*args)

        injector.real = counting
        torch.manual_seed(trial.seed)
        model = AttentionStack(trial.layers, injector, trial.checkpointed)
        try:
            with ctx():
                model(x).pow(2).sum().backward()
        except Exception as exc:  # the outcome under test
            raised_at, error_type, error = time.monotonic(), type(exc).__name__, str(exc)
        fired_at = injector.fired_at
    synced = in_step(mesh.get_group(), trial.seed) if check_in_step else None
    return Outcome(error_type, error, started_at, fired_at, raised_at, calls[0], synced)

"""One CP agreement collective per optimizer step, whatever ``grad_accum`` is.

``training.step.train_step`` builds the step's ``grad_accum`` rows first and passes them one
``StepAgreement``: the step's first CP attention call agrees on every row at once, and the step's
all-reduce carries the loss, the counts and every rank's kernel failures. Counted with
``nemo_automodel.testing.syncs.count_syncs`` on a tiny Llama, CP over a 2-rank gloo pool.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from nemo_automodel.components.config.schema import CPConfig, ModelConfig
from nemo_automodel.components.distributed.blockdiag_cp import CPOptions
from nemo_automodel.components.distributed.parallel import Meshes
from nemo_automodel.components.models.causal_lm import build_causal_lm
from nemo_automodel.components.training.step import StepSetup, train_step
from nemo_automodel.testing.reference import doc_ids_from_lengths
from nemo_automodel.testing.syncs import count_syncs
from tests.recipe_helpers import TINY_MODEL

SEQ = 48


def _row(seed: int) -> dict[str, torch.Tensor]:
    """A packed row of three documents whose boundaries move with ``seed`` (each row has its own layout)."""
    lengths = [10 + seed, 20 - seed, SEQ - 30]
    ids = doc_ids_from_lengths(lengths, SEQ)
    tokens = torch.randint(1, 256, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": tokens, "labels": tokens.clone(), "position_ids": positions, "_packed_seq_ids": ids}


def _control_collectives_per_step(grad_accum: int) -> list[int]:
    """Control collectives of two optimizer steps of ``grad_accum`` rows (a fresh group's first row gathers hosts)."""
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "cp"))
    meshes = Meshes(cp=mesh["cp"], dp_cp=mesh["dp", "cp"]._flatten("dp_cp"))
    config = ModelConfig(attention="hf_interface", **TINY_MODEL)
    model = build_causal_lm(config, 256, seed=7, activation_checkpointing=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    options = CPOptions(attn_backend="sdpa_varlen", kv_exchange="halo")
    setup = StepSetup(meshes, torch.device("cpu"), CPConfig(), "hf_interface", 0, 1.0, False, options=options)
    counts = []
    for step in (1, 2):
        rows = [_row(step * grad_accum + i) for i in range(grad_accum)]
        with count_syncs() as synced:
            train_step(model, optimizer, scheduler, rows, setup, step)
        counts.append(synced.control_collectives)
    return counts


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_one_agreement_and_one_step_all_reduce_per_optimizer_step(pools, grad_accum):
    for _, second in pools.get(2).run_ok(_control_collectives_per_step, grad_accum, timeout=300):
        assert second == 2, f"grad_accum={grad_accum}: {second} control collectives, want the agreement + the step's"


def _rows_disagree(lengths_of_rows: dict[int, list[list[int]]]) -> tuple[str | None, int]:
    """Build this rank's rows (``lengths_of_rows[rank]``) under one agreement; attend the first. -> (error, calls)."""
    from nemo_automodel.components.distributed.blockdiag_cp import (
        StepAgreement,
        cp_attn_fire_count,
        cp_blockdiag_sdpa,
        make_cp_blockdiag_batch_and_ctx,
        reset_cp_attn_fire_count,
    )
    from nemo_automodel.testing.cases import cp_mesh

    agreement, mesh = StepAgreement(), cp_mesh()
    contexts = []
    for lengths in lengths_of_rows[dist.get_rank()]:
        ids = doc_ids_from_lengths(lengths, SEQ)
        batch = {"input_ids": torch.zeros(1, SEQ, dtype=torch.long), "_packed_seq_ids": ids}
        ctx, _, shard = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, agreement=agreement)
        contexts.append((ctx, shard))
    ctx, shard = contexts[0]
    q = torch.randn(1, 2, shard.local_len, 4)
    reset_cp_attn_fire_count()
    try:
        with ctx(settle=False):
            cp_blockdiag_sdpa(q, q, q)
    except RuntimeError as exc:
        return str(exc).split("; this rank has")[0], cp_attn_fire_count()
    return None, cp_attn_fire_count()


@pytest.mark.parametrize(
    ("odd_rows", "field"),
    [([[10, 20, 18], [12, 20, 16]], "document layout"), ([[10, 20, 18]], "rows agreed at once")],
    ids=["second-row-differs", "fewer-rows"],
)
def test_a_later_row_that_disagrees_makes_every_rank_raise_at_the_step_s_first_call(pools, odd_rows, field):
    same = [[10, 20, 18], [10, 22, 16]]
    errors = pools.get(2).run_ok(_rows_disagree, {0: same, 1: odd_rows}, timeout=120)
    assert len({error for error, _ in errors}) == 1, errors
    (error, _), *_ = errors
    assert error is not None and error.startswith("block-diagonal CP ranks disagree on ") and field in error, error
    pools.ensure_healthy(2)


def test_rows_that_agree_attend(pools):
    """The disagreement test is not vacuous: the same rows on both ranks agree and attend."""
    same = [[10, 20, 18], [10, 22, 16]]
    assert pools.get(2).run_ok(_rows_disagree, {0: same, 1: same}, timeout=120) == [(None, 1), (None, 1)]

"""The seed's documented private functions and upstream's state forms (``blockdiag_cp.compat``)."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import compat, consensus, make_cp_blockdiag_batch_and_ctx, state
from nemo_automodel.components.distributed.blockdiag_cp.state import BlockdiagCpModelState
from nemo_automodel.testing.cases import cp_mesh, layout
from nemo_automodel.testing.syncs import count_syncs


def test_needed_only_preflight_has_the_seeds_documented_signature():
    params = list(inspect.signature(compat._needed_only_preflight).parameters)
    assert params == ["state", "group", "backend", "query_dtype", "device", "query_len", "key_len"]
    assert inspect.signature(compat._needed_only_preflight).return_annotation == "tuple[bool, str | None]"


def _preflight(bad_rank: int) -> tuple[list[tuple[bool, str | None]], int]:
    ids = layout("straddle", dist.get_world_size())
    batch = {"input_ids": torch.zeros(1, ids.shape[1], dtype=torch.long), "_packed_seq_ids": ids}
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, batch)
    with ctx() as st:
        # rank `bad_rank` asks for a kernel its device cannot run: every rank learns it, in one collective
        backend = "flash_attn" if dist.get_rank() == bad_rank else "sdpa_varlen"
        device = torch.device("cpu")
        with count_syncs() as counts:
            answers = [
                compat._needed_only_preflight(
                    st, st.group, backend, torch.float32, device, shard.local_len, shard.local_len
                )
                for _ in range(4)  # per-layer calls: memoized
            ]
    return answers, counts.control_collectives


def test_needed_only_preflight_is_one_collective_decision_memoized_per_row(pools):
    for rank, (answers, collectives) in enumerate(pools.get(2).run_ok(_preflight, 1, timeout=60)):
        ok, reason = answers[0]
        assert not ok and "rank(s) [1] cannot run" in reason
        assert ("needs device cuda" in reason) == (rank == 1)  # the failing rank adds its own cause
        assert answers == [answers[0]] * 4 and collectives == 1


def test_model_state_is_buildable_from_upstreams_three_fields():
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    view = BlockdiagCpModelState(None, cu, cu)
    assert (view.cp_rank, view.cp_size, view.local_len, view.padded_seq_len, view.row_offset) == (0, 1, 12, 12, 0)
    assert view.layout == "contiguous" and view.positions.tolist() == list(range(12))


def test_retired_names_stay_importable_from_compat():
    """The names from before "step" meant only the optimizer step are the renamed objects themselves."""
    assert compat.StepState is state.RowState and compat.StepCache is state.RowCache
    assert compat.current_step_state is state.current_row_state
    assert compat.check_step_agreement is consensus.check_agreement and compat.settle_step is consensus.settle_failures

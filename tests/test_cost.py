"""The cost model behind ``kv_exchange=auto`` and ``layout=auto``: its choices on known workloads.

The expected choices are the measured winners of ``benchmarks/cp_attention.py`` on this
project's CPU machines (and, for ``cuda``, what the simulation's link figures imply).
"""

from __future__ import annotations

import pytest

from nemo_automodel.components.distributed.blockdiag_cp import cost
from nemo_automodel.components.distributed.blockdiag_cp.exchange import compute_kv_plan
from nemo_automodel.components.distributed.blockdiag_cp.layout import doc_runs_from_lengths, make_shard_plan

# benchmarks/cp_attention.py's R512: the recipe's scale (512 tokens, short documents)
RECIPE_ROW = (166, 130, 51, 32, 66, 49, 18)


def _layout(doc_lens: list[int] | tuple[int, ...], seq_len: int, cp: int, device: str) -> str:
    runs = doc_runs_from_lengths(list(doc_lens), seq_len)
    return cost.choose_layout(runs, cp, cost.Shape(), cost.MACHINES[device]).layout


@pytest.mark.parametrize("device", sorted(cost.MACHINES))
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_auto_layout_balances_one_long_document(device, cp):
    # the contiguous layout's worst case: the last rank does 2 - 1/cp times the mean work
    assert _layout([131072], 131072, cp, device) == "balanced"


@pytest.mark.parametrize("device", sorted(cost.MACHINES))
def test_auto_layout_keeps_contiguous_when_balancing_gains_nothing(device):
    # equal documents that never straddle a rank: both layouts cost the same; ties keep contiguous
    assert _layout([512] * 64, 32768, 4, device) == "contiguous"


def test_auto_layout_keeps_contiguous_for_short_rows_on_cpu():
    # measured (R512): balanced + a2a 1.3x slower than contiguous + halo; a second message per rank
    # costs more than the 1.29 -> 1.005 balance saves on 256-token shards
    assert _layout(RECIPE_ROW, 512, 2, "cpu") == "contiguous"


@pytest.mark.parametrize("device", sorted(cost.MACHINES))
def test_auto_exchange_never_all_gathers_keys_nobody_needs(device):
    shard = make_shard_plan(doc_runs_from_lengths([512] * 64, 32768), 4, "contiguous")
    path, reason, costs = cost.choose(shard, compute_kv_plan(shard), cost.Shape(), cost.MACHINES[device])
    assert path == "halo", reason
    by_path = {c.path: c for c in costs}
    assert by_path["halo"].recv_tokens == (0, 0, 0, 0)
    assert by_path["allgather"].step_s > by_path["halo"].step_s


def test_auto_exchange_offers_halo_only_when_every_rank_needs_its_left_neighbour_alone():
    # one document over 4 ranks: the last rank needs keys from three ranks, so halo cannot deliver them
    shard = make_shard_plan(doc_runs_from_lengths([4096], 4096), 4, "contiguous")
    path, _, costs = cost.choose(shard, compute_kv_plan(shard), cost.Shape(), cost.MACHINES["cpu"])
    assert {c.path for c in costs} == {"allgather", "a2a", "ulysses"} and path != "halo"


def test_messages_count_sends_and_receives():
    # cp=2, one document: rank 0 only sends its keys, rank 1 only receives them
    shard = make_shard_plan(doc_runs_from_lengths([1024], 1024), 2, "contiguous")
    kv = compute_kv_plan(shard)
    machine = cost.MACHINES["cpu"]
    assert cost.predict("halo", shard, kv, cost.Shape(), machine).messages == (1, 1)
    assert cost.predict("allgather", shard, kv, cost.Shape(), machine).messages == (2, 2)


def test_the_recipe_describes_its_model_to_the_layout_choice():
    from transformers import LlamaConfig

    from nemo_automodel.components.training.step import attention_shape

    config = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=4)
    assert attention_shape(config, half_precision=False) == cost.Shape(8, 4, 32, 4)
    assert attention_shape(config, half_precision=True).elem_bytes == 2

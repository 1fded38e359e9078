"""cp=2 (every K/V exchange) and dp=2 train exactly like cp=1 through the real recipe loop."""

from __future__ import annotations

import pytest
import torch

from tests.recipe_helpers import tiny_config, train_in_pool

STEPS = 20


@pytest.fixture(scope="module")
def cp1_run(pools, tmp_path_factory):
    """The reference: cp=1, dp=1 on one rank, 20 steps of 2 packed rows."""
    run_dir = tmp_path_factory.mktemp("cp1")
    (result,) = pools.get(1).run_ok(train_in_pool, tiny_config(), str(run_dir), timeout=300)
    assert result["code"] == 0 and sorted(result["losses"]) == list(range(1, STEPS + 1))
    return result


def _assert_same_training(run, reference, rel=1e-5):
    steps = sorted(reference["losses"])
    assert sorted(run["losses"]) == steps
    for step in steps:
        a, b = run["losses"][step], reference["losses"][step]
        assert abs(a - b) <= rel * abs(b), f"step {step}: loss {a} vs cp=1 {b}"
    for name, ref in reference["weights"].items():
        torch.testing.assert_close(run["weights"][name], ref, rtol=1e-4, atol=1e-5, msg=f"final weight {name}")


def test_cp1_loss_falls_so_parity_is_not_vacuous(cp1_run):
    losses = cp1_run["losses"]
    assert losses[STEPS] < 0.8 * losses[1]


@pytest.mark.parametrize("kv_exchange", ["allgather", "halo", "a2a"])
def test_cp2_losses_and_weights_equal_cp1(pools, tmp_path, cp1_run, kv_exchange):
    cfg = tiny_config(cp={"size": 2, "kv_exchange": kv_exchange, "layout": "contiguous"})
    result = pools.get(2).run_ok(train_in_pool, cfg, str(tmp_path), timeout=300)[0]
    assert result["code"] == 0
    _assert_same_training(result, cp1_run)


@pytest.mark.parametrize(("layout", "kv_exchange"), [("balanced", "a2a"), ("balanced", "auto"), ("auto", "auto")])
def test_cp2_with_reordered_layouts_equals_cp1(pools, tmp_path, cp1_run, layout, kv_exchange):
    """The balanced layout permutes tokens (and their labels and positions): the training must not notice."""
    cfg = tiny_config(cp={"size": 2, "layout": layout, "kv_exchange": kv_exchange})
    result = pools.get(2).run_ok(train_in_pool, cfg, str(tmp_path), timeout=300)[0]
    assert result["code"] == 0
    _assert_same_training(result, cp1_run)


def test_cp2_through_patched_sdpa_equals_cp1(pools, tmp_path, cp1_run):
    cfg = tiny_config(cp={"size": 2}, model={"attention": "patch_sdpa"})
    result = pools.get(2).run_ok(train_in_pool, cfg, str(tmp_path), timeout=300)[0]
    _assert_same_training(result, cp1_run)


def test_dp2_sums_gradients_like_cp1_with_accumulation(pools, tmp_path, cp1_run):
    """dp=2 x grad_accum=1 sees the same rows per step as dp=1 x grad_accum=2: same losses and weights."""
    cfg = tiny_config(trainer={"grad_accum": 1})
    result = pools.get(2).run_ok(train_in_pool, cfg, str(tmp_path), timeout=300)[0]
    _assert_same_training(result, cp1_run)


def test_cp2_with_activation_checkpointing_equals_cp1(pools, tmp_path, cp1_run):
    """Recompute in backward runs the layers' CP attention again and must see the same step state."""
    cfg = tiny_config(cp={"size": 2}, trainer={"activation_checkpointing": True})
    result = pools.get(2).run_ok(train_in_pool, cfg, str(tmp_path), timeout=300)[0]
    _assert_same_training(result, cp1_run)

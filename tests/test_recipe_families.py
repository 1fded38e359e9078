"""The recipe on saved windowed / soft-capped models: cp=2 trains like cp=1, and both honour the variants.

A tiny Mistral (sliding window on every layer) and a tiny Gemma 2 (soft-cap, sliding
and full layers) are saved with ``save_pretrained`` and trained through
``model.pretrained_path``. The recipe's cp=1 runs the same CP step at cp=1, so it
honours windows too; its first loss is checked against an independent unpacked
reference (each document alone through the eager model), and that reference with the
variants removed must differ (the check can fail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_automodel.components.config.errors import InputError
from nemo_automodel.components.config.schema import DataConfig, ModelConfig, TokenizerConfig
from nemo_automodel.components.datasets.loader import RowSchedule, prepare_data
from nemo_automodel.components.datasets.tokenizer import build_tokenizer
from nemo_automodel.components.models.causal_lm import build_causal_lm
from tests.recipe_helpers import per_document_loss, train_in_pool

STEPS = 4
GRAD_ACCUM = 2
DATA = {"seq_len": 128, "num_documents": 120, "max_doc_len": 60}
_SIZE: dict[str, Any] = {
    "vocab_size": 256,  # the recipe's built-in byte tokenizer
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_SIZE, sliding_window=6)


def _gemma2() -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(
        **_SIZE,
        head_dim=8,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=2.0,
        query_pre_attn_scalar=8,
    )


CONFIGS = {"mistral": _mistral, "gemma2": _gemma2}


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny model, saved in float32."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("families")
    paths = {}
    for name, make in CONFIGS.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(make(), dtype=torch.float32).save_pretrained(root / name)
        paths[name] = root / name
    return paths


def _config(path: Path, cp: int, layout: str = "contiguous", kv_exchange: str = "halo", **model: Any) -> dict[str, Any]:
    return {
        "model": {"pretrained_path": str(path), **model},
        "data": dict(DATA),
        "cp": {"size": cp, "layout": layout, "kv_exchange": kv_exchange},
        "trainer": {"max_steps": STEPS, "grad_accum": GRAD_ACCUM, "log_every": 1, "ckpt_every": 0, "export_hf": True},
        "optim": {"warmup_steps": 1},
    }


def _first_step_reference_loss(path: Path, drop_variants: bool = False) -> float:
    """Step 1's loss from scratch: its rows' documents one at a time through the eager model (no packing, no CP)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer(TokenizerConfig(), None)
    dataset = prepare_data(DataConfig(**DATA), tokenizer).train
    schedule = RowSchedule(len(dataset), 1, GRAD_ACCUM, DataConfig(**DATA).seed)
    config = AutoConfig.from_pretrained(path)
    if drop_variants:  # a window longer than any row, no soft-cap
        config.sliding_window = 10**6
        if hasattr(config, "attn_logit_softcapping"):
            config.attn_logit_softcapping = None
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float64, attn_implementation="eager")
    rows = (dataset.row(schedule.row_index(0, micro, 0)) for micro in range(GRAD_ACCUM))
    return per_document_loss(model, rows)


@pytest.fixture(scope="module")
def cp1_runs(pools, saved_models, tmp_path_factory) -> dict[str, dict[str, Any]]:
    runs = {}
    for name, path in saved_models.items():
        run_dir = tmp_path_factory.mktemp(f"{name}-cp1")
        (result,) = pools.get(1).run_ok(train_in_pool, _config(path, 1), str(run_dir), timeout=300)
        assert result["code"] == 0
        runs[name] = result
    return runs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cp1_first_loss_equals_unpacked_reference_with_variants(saved_models, cp1_runs, name):
    want = _first_step_reference_loss(saved_models[name])
    got = cp1_runs[name]["losses"][1]
    assert abs(got - want) <= 1e-5 * abs(want), f"{name}: cp=1 step-1 loss {got} vs unpacked eager {want}"
    without = _first_step_reference_loss(saved_models[name], drop_variants=True)
    # a near-uniform tiny model: the variants move the loss by ~1e-3 relative, 100x the tolerance
    assert abs(got - without) > 1e-4 * abs(want), f"{name}: the variants do not change the loss; the check is vacuous"


EXCHANGES = [("contiguous", "halo"), ("balanced", "a2a"), ("auto", "auto")]


@pytest.mark.parametrize(("layout", "kv_exchange"), EXCHANGES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cp2_losses_equal_cp1(pools, saved_models, cp1_runs, tmp_path, name, layout, kv_exchange):
    cfg = _config(saved_models[name], 2, layout, kv_exchange)
    result = pools.get(2).run_ok(train_in_pool, cfg, str(tmp_path), timeout=300)[0]
    assert result["code"] == 0
    reference = cp1_runs[name]["losses"]
    assert sorted(result["losses"]) == sorted(reference) == list(range(1, STEPS + 1))
    for step, want in reference.items():
        got = result["losses"][step]
        assert abs(got - want) <= 1e-5 * abs(want), f"{name} step {step}: cp=2 loss {got} vs cp=1 {want}"
    for param, want in cp1_runs[name]["weights"].items():
        torch.testing.assert_close(result["weights"][param], want, rtol=1e-4, atol=1e-5, msg=f"final weight {param}")


def test_patch_sdpa_refuses_a_windowed_model_naming_sliding_window(saved_models):
    cfg = ModelConfig(pretrained_path=str(saved_models["mistral"]), attention="patch_sdpa")
    with pytest.raises(ValueError, match=r"sliding_window=6 \(layers 0-1\)") as info:
        build_causal_lm(cfg, 256, seed=0, activation_checkpointing=False)
    assert "model.attention=hf_interface" in str(info.value)


def test_patch_sdpa_is_an_input_error_in_the_recipe(pools, saved_models, tmp_path):
    """Through the whole recipe: every rank refuses before training, with the feature in the message."""
    cfg = _config(saved_models["gemma2"], 1, attention="patch_sdpa")
    (result,) = pools.get(1).run(train_in_pool, cfg, str(tmp_path), timeout=120)
    assert not result.ok and result.error_type == InputError.__name__
    assert "softcap=2.0" in result.message and "sliding_window=6" in result.message

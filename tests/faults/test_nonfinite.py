"""NaN/Inf in one rank's attention inputs or loss: reported with the step and the rank, then stop or skip.

A forward hook poisons one module's output on one rank at one step of the real
recipe loop (cp=2 on the pool's process group); ``trainer.on_nonfinite`` decides.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nemo_automodel.components.config.schema import to_finetune_config
from nemo_automodel.components.distributed.parallel import resolve_topology
from nemo_automodel.recipes import finetune
from tests.recipe_helpers import read_losses, tiny_config

POISONED_STEP = 3
GRAD_ACCUM = 2


def _poison_hook(rank: int, value: float) -> Any:
    """Forward hook: one output element becomes ``value`` on ``rank`` in ``POISONED_STEP``'s first micro-batch."""
    calls = [0]

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if not module.training:  # the packing-isolation probe before step 1 runs in eval mode: not a step
            return out
        calls[0] += 1
        if dist.get_rank() != rank or calls[0] != (POISONED_STEP - 1) * GRAD_ACCUM + 1:
            return out
        out = out.clone()
        out[0, 5, 0] = value
        return out

    return hook


def _fingerprint(model: torch.nn.Module) -> float:
    """Sum of this rank's parameter shards (changes with any optimizer update)."""
    return sum(float((p.to_local() if isinstance(p, DTensor) else p).double().sum()) for p in model.parameters())


def _train_poisoned(payload: dict[str, Any], run_dir: str, module: str, rank: int, value: float) -> dict[str, Any]:
    """Pool worker: the recipe loop with ``module``'s output poisoned; the outcome, logs and parameter fingerprints."""
    config = to_finetune_config(payload)
    topology = resolve_topology(dist.get_world_size(), dist.get_rank(), dist.get_rank(), config.cp.size, None)
    real_build, real_step = finetune.build_causal_lm, finetune.train_step
    fingerprints: list[float] = []

    def build(*args: Any) -> torch.nn.Module:
        model = real_build(*args)
        model.get_submodule(module).register_forward_hook(_poison_hook(rank, value))
        return model

    def step(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = real_step(model, *args, **kwargs)
        fingerprints.append(_fingerprint(model))
        return result

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("nemo_automodel.finetune").addHandler(handler)
    finetune.build_causal_lm, finetune.train_step = build, step
    try:
        code = finetune.train(config, Path(run_dir), topology, torch.device("cpu"))
        error = None
    except RuntimeError as exc:
        code, error = None, f"{type(exc).__name__}: {exc}"
    finally:
        finetune.build_causal_lm, finetune.train_step = real_build, real_step
        logging.getLogger("nemo_automodel.finetune").removeHandler(handler)
    return {"code": code, "error": error, "warnings": records, "fingerprints": fingerprints}


def _config(policy: str) -> dict[str, Any]:
    return tiny_config(
        cp={"size": 2, "check_finite": True},  # off by default: it names the attention call that saw NaN/Inf
        trainer={"max_steps": 5, "grad_accum": GRAD_ACCUM, "on_nonfinite": policy, "export_hf": False},
    )


# (poisoned module, rank, value, what the report must say)
POISONS = [
    ("model.layers.0.self_attn.k_proj", 1, math.nan, "CP attention inputs on rank(s) [1] (rank 1: micro-batch 0: "),
    ("lm_head", 0, math.inf, "loss on rank(s) [0]; gradient norm"),
]


@pytest.mark.parametrize(("module", "rank", "value", "needle"), POISONS)
def test_stop_raises_on_every_rank_naming_the_step_and_the_rank(pools, tmp_path, module, rank, value, needle):
    results = pools.get(2).run_ok(_train_poisoned, _config("stop"), str(tmp_path), module, rank, value, timeout=240)
    for result in results:
        assert result["code"] is None, "training went on past the non-finite step"
        assert result["error"].startswith(f"NonFiniteStepError: non-finite values in step {POISONED_STEP}: ")
        assert "trainer.on_nonfinite=stop" in result["error"]
    assert needle in results[rank]["error"]
    assert sorted(read_losses(tmp_path)) == list(range(1, POISONED_STEP)), "steps before the poisoned one logged"


def test_attention_input_details_are_reported_by_the_rank_that_saw_them(pools, tmp_path):
    module, rank, value, _ = POISONS[0]
    results = pools.get(2).run_ok(_train_poisoned, _config("stop"), str(tmp_path), module, rank, value, timeout=240)
    assert "CP attention call 0: key" in results[1]["error"], "the first poisoned call names its tensor"
    assert "(rank 1:" not in results[0]["error"], "a rank reports only its own attention details"


@pytest.mark.parametrize(("module", "rank", "value", "needle"), POISONS)
def test_skip_zeroes_the_step_and_training_continues(pools, tmp_path, module, rank, value, needle):
    results = pools.get(2).run_ok(_train_poisoned, _config("skip"), str(tmp_path), module, rank, value, timeout=240)
    skipped = POISONED_STEP - 1  # 0-based index of the poisoned step
    for result in results:
        assert result["code"] == 0 and result["error"] is None
        prints = result["fingerprints"]
        assert prints[skipped] == prints[skipped - 1], "the poisoned step changed the parameters"
        assert all(prints[i] != prints[i - 1] for i in range(1, len(prints)) if i != skipped)
        assert any(
            f"non-finite values in step {POISONED_STEP}" in w and "optimizer step skipped" in w
            for w in result["warnings"]
        )
    assert any(needle in w for w in results[rank]["warnings"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [r["step"] == POISONED_STEP for r in records]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) for r in records if r["step"] != POISONED_STEP)


def test_without_check_finite_the_report_says_how_to_name_the_attention_call():
    """cp.check_finite is off by default (it costs three reductions per call): a NaN loss still stops the step."""
    from nemo_automodel.components.training.step import _nonfinite_report

    unchecked = _nonfinite_report(3, [[0.0, 1.0]], math.nan, [], 0, attention_checked=False)
    checked = _nonfinite_report(3, [[0.0, 1.0]], math.nan, [], 0, attention_checked=True)
    hint = "set cp.check_finite=true to name the first CP attention call whose q/k/v were not finite"
    assert unchecked == f"{checked}; {hint}"
    assert _nonfinite_report(3, [[0.0, 0.0]], 1.0, [], 0, attention_checked=False) is None

"""LoRA (``peft=lora``) through the real recipe: CP parity, checkpoints, adapter and merged export, bad inputs.

The runs are few and tiny, and each process pool trains all of its configs in one call (``train_runs``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from nemo_automodel.components.adapters.lora import resolve_target_modules
from nemo_automodel.components.checkpoint.adapter import BaseModel, base_fingerprint, base_state, check_resume
from nemo_automodel.components.config.schema import DataConfig, PeftConfig, TokenizerConfig, to_finetune_config
from nemo_automodel.components.datasets.loader import prepare_data
from nemo_automodel.components.datasets.tokenizer import build_tokenizer
from nemo_automodel.components.distributed.parallel import resolve_topology
from nemo_automodel.recipes.finetune import train
from nemo_automodel.recipes.lora import check_quantize
from tests.families import FAMILIES
from tests.recipe_helpers import TINY_DATA, per_document_loss, read_metrics, save_chat_model, tiny_config

STEPS = 8
LORA = {"method": "lora", "r": 4, "alpha": 8.0}
# The same schedule for every run (decay_steps pinned) so a run stopped at step 4 and resumed matches.
OPTIM = {"lr": 2e-2, "warmup_steps": 2, "decay_steps": STEPS}
CP2_VARIANTS = {
    "halo": {"size": 2, "kv_exchange": "halo", "layout": "contiguous"},
    "a2a": {"size": 2, "kv_exchange": "a2a", "layout": "contiguous"},
    "balanced": {"size": 2, "kv_exchange": "a2a", "layout": "balanced"},
    "auto": {"size": 2, "kv_exchange": "auto", "layout": "auto"},
}
DORA = {"use_dora": True, "use_rslora": True}
FAMILY_NAMES = ("gemma2", "gpt_oss", "deepseek_v3")  # soft-cap + window, sinks + MoE, MLA


def _config(trainer: dict[str, Any] | None = None, **sections: dict[str, Any]) -> dict[str, Any]:
    run = {"max_steps": STEPS, "val_every": 4, "ckpt_every": 4, "log_every": 4, **(trainer or {})}
    data = {"validation": "0.1", **sections.pop("data", {})}
    peft = {**LORA, **sections.pop("peft", {})}
    return tiny_config(peft=peft, optim=dict(OPTIM), trainer=run, data=data, **sections)


def train_runs(runs: list[tuple[dict[str, Any], str]]) -> list[dict[str, Any]] | None:
    """Pool worker: train each ``(config, run_dir)`` in turn on the pool's group; rank 0 returns their metrics."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for payload, run_dir in runs:
        config = to_finetune_config(payload)
        topology = resolve_topology(world, rank, rank, config.cp.size, config.dist.dp_size)
        code = train(config, Path(run_dir), topology, torch.device("cpu"))
        results.append({"code": code, "metrics": read_metrics(Path(run_dir)) if rank == 0 else None})
    return results if rank == 0 else None


def _family_model(name: str, root: Path) -> Path:
    """The family's tiny model with the byte tokenizer's vocabulary, saved in float32."""
    from transformers import AutoModelForCausalLM

    config = FAMILIES[name].make_config()
    config.vocab_size, config.max_position_embeddings = 256, 256
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / name)
    return root / name


def _chat(root: Path) -> dict[str, Any]:
    save_chat_model(root / "chat_model")
    lines = [
        {"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]}
        for a in range(12)
        for b in range(10)
    ]
    (root / "chat.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = {"source": "chat", "path": str(root / "chat.jsonl"), "seq_len": 128, "cache_dir": str(root / "cache")}
    return {"model": {"pretrained_path": str(root / "chat_model")}, "tokenizer": {"name_or_path": None}, "data": data}


def _family_config(path: Path, cp: dict[str, Any]) -> dict[str, Any]:
    return _config(
        trainer={"max_steps": 3, "val_every": 0, "ckpt_every": 0, "export_hf": False},
        model={"pretrained_path": str(path)},
        data={"seq_len": 128, "num_documents": 120, "max_doc_len": 60, "validation": None},
        cp=cp,
    )


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Every LoRA run of this module, ``{name: (run_dir, metrics)}``: one call per pool size."""
    root = tmp_path_factory.mktemp("lora")
    chat = _chat(root)
    chat_cfg = lambda cp: _config(  # noqa: E731
        model=chat["model"],
        tokenizer={"name_or_path": chat["model"]["pretrained_path"]},
        data={**chat["data"], "validation": "0.1"},
        trainer={"export_hf": False},
        cp=cp,
    )
    families = {name: _family_model(name, root) for name in FAMILY_NAMES}
    one = {
        "cp1": _config(),
        "chat_cp1": chat_cfg({"size": 1}),
        "dora_cp1": _config(peft=DORA, trainer={"export_hf": False}),
        **{f"{n}_cp1": _family_config(p, {"size": 1}) for n, p in families.items()},
    }
    two = {
        **{f"cp2_{name}": _config(cp=cp) for name, cp in CP2_VARIANTS.items()},
        "cp2_ac": _config(cp=CP2_VARIANTS["halo"], trainer={"activation_checkpointing": True}),
        "cp2_auto_ac": _config(cp=CP2_VARIANTS["auto"], trainer={"activation_checkpointing": True}),
        "dp2": _config(trainer={"grad_accum": 1}, dist={"dp_size": 2}),
        # stopped after step 4, then resumed in the same run dir up to STEPS
        "resumed": _config(cp=CP2_VARIANTS["halo"], trainer={"max_steps": 4}),
        "resumed ": _config(cp=CP2_VARIANTS["halo"]),
        "chat_cp2": chat_cfg(CP2_VARIANTS["auto"]),
        "dora_cp2": _config(peft=DORA, trainer={"export_hf": False}, cp=CP2_VARIANTS["auto"]),
        # the cp=1 run's adapter, trained on
        "continued": _config(
            peft={"adapter_path": str(root / "cp1" / "adapter")},
            trainer={"max_steps": 1, "val_every": 0, "export_hf": False},
            cp=CP2_VARIANTS["halo"],
        ),
        **{f"{n}_cp2": _family_config(p, CP2_VARIANTS["auto"]) for n, p in families.items()},
    }
    out: dict[str, tuple[Path, dict[str, Any]]] = {}
    for world, configs in ((1, one), (2, two)):
        dirs = [str(root / name.strip()) for name in configs]
        (results,) = [
            r for r in pools.get(world).run_ok(train_runs, list(zip(configs.values(), dirs)), timeout=1200) if r
        ]
        for (name, _), run_dir, result in zip(configs.items(), dirs, results):
            assert result["code"] == 0, name
            out[name.strip()] = (Path(run_dir), result["metrics"])
    return out


def _assert_same_losses(
    run: dict[int, dict[str, Any]], reference: dict[int, dict[str, Any]], rel: float = 1e-5
) -> None:
    assert sorted(run) == sorted(reference)
    for step, record in reference.items():
        for key in ("loss", "val_loss"):
            if record.get(key) is not None:
                a, b = run[step][key], record[key]
                assert abs(a - b) <= rel * abs(b), f"step {step}: {key} {a} vs cp=1 {b}"


def test_lora_trains_and_the_loss_falls(runs):
    metrics = runs["cp1"][1]
    assert sorted(metrics) == list(range(1, STEPS + 1))
    assert metrics[STEPS]["loss"] < 0.95 * metrics[1]["loss"], "parity below would be vacuous"
    log = (runs["cp1"][0] / "finetune.log").read_text()
    assert "on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (default" in log
    assert "LoRA: trainable " in log and "MiB saved" in log


@pytest.mark.parametrize("name", [*[f"cp2_{n}" for n in CP2_VARIANTS], "cp2_ac", "cp2_auto_ac", "dp2"])
def test_cp2_and_dp2_equal_cp1_per_step(runs, name):
    """Every exchange and layout, with and without activation checkpointing, and dp=2 (FSDP2, frozen base)."""
    _assert_same_losses(runs[name][1], runs["cp1"][1])
    ours = load_file(str(runs[name][0] / "adapter" / "adapter_model.safetensors"))
    reference = load_file(str(runs["cp1"][0] / "adapter" / "adapter_model.safetensors"))
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        # AdamW turns float-reordering noise in near-zero gradients into lr-sized steps: 5e-5 of weights ~0.2
        torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=5e-5)


def test_chat_answer_only_cp2_equals_cp1(runs):
    _assert_same_losses(runs["chat_cp2"][1], runs["chat_cp1"][1])
    assert "answers only" in (runs["chat_cp1"][0] / "finetune.log").read_text()


def test_dora_with_rslora_cp2_equals_cp1(runs):
    _assert_same_losses(runs["dora_cp2"][1], runs["dora_cp1"][1])
    assert " DoRA rsLoRA on " in (runs["dora_cp1"][0] / "finetune.log").read_text()


def test_training_continues_from_a_saved_adapter(runs):
    """peft.adapter_path loads the cp=1 run's trained adapter: the first step starts from its lower loss."""
    first = runs["continued"][1][1]["loss"]
    assert first < runs["cp1"][1][1]["loss"] - 0.1
    assert "adapter continued from" in (runs["continued"][0] / "finetune.log").read_text()


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_model_families_cp2_equal_cp1(runs, name):
    _assert_same_losses(runs[f"{name}_cp2"][1], runs[f"{name}_cp1"][1])


def test_resume_is_bitwise_and_checkpoints_hold_only_the_adapters(runs):
    resumed, uninterrupted = runs["resumed"][1], runs["cp2_halo"][1]
    assert {s: r["loss"] for s, r in resumed.items()} == {s: r["loss"] for s, r in uninterrupted.items()}
    assert "resumed from" in (runs["resumed"][0] / "finetune.log").read_text()
    import torch.distributed.checkpoint as dcp

    checkpoint = runs["resumed"][0] / "checkpoints" / f"step_{STEPS:08d}"
    keys = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), "the frozen base must not be checkpointed"
    record = json.loads((checkpoint / "base_model.json").read_text())
    assert record["path"] == str(runs["resumed"][0] / "base")


def test_adapter_loads_in_peft_and_reproduces_the_runs_validation_loss(runs):
    """The PEFT-format adapter on the saved base gives the loss the cp=2 run measured with its trained model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, metrics = runs["cp2_halo"]
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(run_dir / "base") and config["r"] == LORA["r"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run_dir / "base"), run_dir / "adapter")
    data = prepare_data(DataConfig(**TINY_DATA, validation="0.1"), build_tokenizer(TokenizerConfig(), None))
    validation = [data.validation.row(index) for index in range(len(data.validation))]
    loss = per_document_loss(model.eval(), validation)
    assert abs(loss - metrics[STEPS]["val_loss"]) <= 1e-5 * loss
    base_only = per_document_loss(AutoModelForCausalLM.from_pretrained(run_dir / "base").eval(), validation)
    assert base_only > loss * 1.05, "the adapter must matter for this check to bite"


def test_merged_export_equals_base_plus_adapter_and_generates(runs):
    """hf/ holds W + (alpha / r) B A for every adapted weight and the base bit for bit elsewhere; no peft needed."""
    from transformers import AutoModelForCausalLM

    run_dir = runs["cp2_halo"][0]
    base = load_file(str(run_dir / "base" / "model.safetensors"))
    merged = load_file(str(run_dir / "hf" / "model.safetensors"))
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    scale = LORA["alpha"] / LORA["r"]
    adapted = 0
    for name, weight in base.items():
        a_key = "base_model.model." + name.replace(".weight", ".lora_A.weight")
        if a_key in adapter:
            b = adapter[a_key.replace("lora_A", "lora_B")]
            torch.testing.assert_close(merged[name], weight + scale * b @ adapter[a_key], rtol=0, atol=1e-6)
            adapted += 1
        else:
            assert torch.equal(merged[name], weight), name
    assert adapted == 2 * 7, "every attention and MLP projection of both layers"
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    out = model.generate(torch.tensor([[72, 105]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 6)


def test_base_weights_are_bit_identical_before_and_after(runs):
    """The saved base is the seeded model, and the run checked its weights unchanged at the end."""
    from nemo_automodel.components.config.schema import ModelConfig
    from nemo_automodel.components.models.causal_lm import build_causal_lm
    from tests.recipe_helpers import TINY_MODEL

    run_dir = runs["cp2_halo"][0]
    fresh = build_causal_lm(ModelConfig(**TINY_MODEL), 256, seed=42, activation_checkpointing=False).state_dict()
    saved = load_file(str(run_dir / "base" / "model.safetensors"))
    assert saved.keys() <= fresh.keys() and all(torch.equal(saved[k], fresh[k]) for k in saved)
    fingerprint = json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "base_model.json").read_text())
    assert fingerprint["fingerprint"] == base_fingerprint(fresh)
    assert "LoRA: base weights bit-identical to the start" in (run_dir / "finetune.log").read_text()


# ---- bad inputs (no process group) ----


def test_default_targets_per_family_and_unknown_targets_name_what_the_model_has():
    from tests.families import build_model

    expected = {
        "llama": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
        "gpt_oss": ["k_proj", "o_proj", "q_proj", "v_proj"],  # experts are fused tensors; the router is no target
        "deepseek_v3": [
            "down_proj",
            "gate_proj",
            "kv_a_proj_with_mqa",
            "kv_b_proj",
            "o_proj",
            "q_a_proj",
            "q_b_proj",
            "up_proj",
        ],
    }
    for name, targets in expected.items():
        assert resolve_target_modules(build_model(name, "eager"), None) == targets, name
    model = build_model("llama", "eager")
    assert resolve_target_modules(model, ["q_proj", "lm_head"]) == ["q_proj", "lm_head"]
    with pytest.raises(ValueError, match=r"peft.target_modules: qproj matches no linear layer .*k_proj, lm_head"):
        resolve_target_modules(model, ["qproj"])
    with pytest.raises(ValueError, match=r"peft\.target_modules: mlp matches no linear layer"):
        resolve_target_modules(model, ["mlp"])  # a module, but not a linear one


def test_bad_peft_settings_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"peft\.adapter_path needs LoRA: add peft=lora"):
        PeftConfig(adapter_path="/x")
    with pytest.raises(ValueError, match=r"peft\.quantize='8bit' is not valid"):
        PeftConfig(method="lora", quantize="8bit")
    with pytest.raises(ValueError, match=r"peft.quantize=4bit \(QLoRA\) needs a CUDA GPU"):
        check_quantize(PeftConfig(method="lora", quantize="4bit"), torch.device("cpu"))
    check_quantize(PeftConfig(method="lora"), torch.device("cpu"))


def test_resume_refuses_the_other_kind_of_checkpoint_and_another_base(tmp_path):
    base = BaseModel("/models/a", "0" * 64)
    (tmp_path / "base_model.json").write_text(json.dumps(base.record()))
    check_resume(tmp_path, base)
    with pytest.raises(ValueError, match="holds LoRA adapters, not a full model: add peft=lora"):
        check_resume(tmp_path, None)
    with pytest.raises(ValueError, match=r"was trained on base model /models/a .* has different weights"):
        check_resume(tmp_path, BaseModel("/models/b", "1" * 64))
    with pytest.raises(ValueError, match="holds a full fine-tuning checkpoint: peft=lora cannot continue it"):
        check_resume(tmp_path / "missing", base)


def test_base_state_unwraps_the_lora_layers():
    state = {
        "model.layers.0.q_proj.base_layer.weight": torch.ones(2),
        "model.layers.0.q_proj.lora_A.default.weight": torch.zeros(2),
        "model.norm.weight": torch.ones(1),
    }
    assert sorted(base_state(state)) == ["model.layers.0.q_proj.weight", "model.norm.weight"]

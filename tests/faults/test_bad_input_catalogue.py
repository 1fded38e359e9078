"""Every row of ``docs/bad_inputs.md`` is a case here, and every case is a row: the table cannot drift.

Each row names an ``id``, the rejected input, the error type and an excerpt of its
message. :data:`TRIGGERS` maps each id to a function that feeds exactly that input;
the test reads the table, runs the trigger (in this process, or on every rank of a
2-rank pool when it needs a process group) and checks the type and the message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from nemo_automodel.components.adapters.lora import setup_lora
from nemo_automodel.components.checkpoint.adapter import BASE_MODEL_FILE, BaseModel, check_resume
from nemo_automodel.components.checkpoint.resume import check_resume_step, compare_fingerprints
from nemo_automodel.components.config.overrides import check_override_keys
from nemo_automodel.components.config.schema import DataConfig, ModelConfig, register_schema, to_finetune_config
from nemo_automodel.components.datasets.loader import prepare_data
from nemo_automodel.components.datasets.packing import pack_documents
from nemo_automodel.components.datasets.tokenizer import ByteTokenizer, HFTokenizer
from nemo_automodel.components.distributed.blockdiag_cp import (
    AttentionVariant,
    CPOptions,
    StepAgreement,
    attach_cp1_packed_varlen_hooks,
    configure_cp_varlen,
    cost,
    cp_blockdiag_sdpa,
    disable_cp1_packed_varlen,
    enable_cp1_packed_varlen,
    make_cp_blockdiag_batch_and_ctx,
    packed_varlen_sdpa,
    plan,
)
from nemo_automodel.components.distributed.blockdiag_cp.layout import doc_runs_from_lengths, make_shard_plan
from nemo_automodel.components.distributed.parallel import check_shared_run_dir, omp_num_threads, resolve_topology
from nemo_automodel.components.launcher.env import first_slurm_host
from nemo_automodel.components.launcher.run_lock import hold_run_dir
from nemo_automodel.components.models.attention_features import attention_features
from nemo_automodel.components.models.causal_lm import build_causal_lm
from nemo_automodel.components.training.step import _check_cp_reached_attention
from nemo_automodel.recipes import plan as recipe_plan
from nemo_automodel.recipes.checks import check_attn_backend, check_paths, check_positions, check_run_dir
from nemo_automodel.recipes.lora import check_quantize
from nemo_automodel.testing.cases import cp_mesh
from nemo_automodel.testing.reference import doc_ids_from_lengths
from tests.recipe_helpers import CHAT_TEMPLATE, REPO, save_chat_tokenizer

CATALOGUE = REPO / "docs" / "bad_inputs.md"
ROW = re.compile(r"^\| `(?P<id>[a-z0-9-]+)` \| (?P<input>.+?) \| `(?P<error>\w+)` \| `(?P<message>[^`]+)` \|$")


# ----------------------------------------------------------------------------- core: batch builder


def _row(total: int = 8, **fields: Any) -> dict[str, Any]:
    """A valid packed row of two documents, with ``fields`` replaced (``None`` removes one)."""
    row = {"input_ids": torch.ones(1, total, dtype=torch.long), "_packed_seq_ids": doc_ids_from_lengths([3, 5], total)}
    row.update(fields)
    return {k: v for k, v in row.items() if v is not None}


def _build(batch: dict[str, Any], **kwargs: Any) -> Any:
    return make_cp_blockdiag_batch_and_ctx(None, None, batch, **kwargs)


def _two_groups_one_agreement() -> None:
    """A row without a process group, then one claiming a group, under one agreement."""
    agreement = StepAgreement()
    _build(_row(), agreement=agreement)
    agreement.add(dataclasses.replace(agreement.rows[0], group=object()))


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor([values])


BATCH: dict[str, Callable[[], Any]] = {
    "batch-both-inputs": lambda: _build(_row(inputs_embeds=torch.ones(1, 8, 4))),
    "batch-no-inputs": lambda: _build(_row(input_ids=None)),
    "batch-inputs-not-tensor": lambda: _build(_row(input_ids=[[1, 2, 3]])),
    "batch-inputs-rank": lambda: _build(_row(input_ids=torch.ones(8, dtype=torch.long))),
    "batch-size": lambda: _build(_row(input_ids=torch.ones(2, 8, dtype=torch.long))),
    "batch-attn-shape": lambda: _build(_row(), layout="auto", attn_shape=(8, 4, 64)),
    "shape-field": lambda: cost.Shape(heads=0),
    "batch-empty-row": lambda: _build(_row(0, _packed_seq_ids=None)),
    "ids-not-tensor": lambda: _build(_row(_packed_seq_ids=[[1, 1, 2, 2, 2, 2, 2, 2]])),
    "ids-shape": lambda: _build(_row(_packed_seq_ids=torch.ones(1, 7, dtype=torch.long))),
    "ids-float": lambda: _build(_row(_packed_seq_ids=torch.ones(1, 8))),
    "ids-negative": lambda: _build(_row(_packed_seq_ids=-torch.ones(1, 8, dtype=torch.long))),
    "ids-padding-not-tail": lambda: _build(_row(_packed_seq_ids=_ids(1, 1, 0, 2, 2, 2, 2, 2))),
    "ids-reappear": lambda: _build(_row(_packed_seq_ids=_ids(1, 1, 2, 2, 1, 1, 3, 3))),
    "mask-not-tensor": lambda: _build(_row(_packed_seq_ids=None, attention_mask=[[1] * 8])),
    "mask-4d-shape": lambda: _build(_row(_packed_seq_ids=None, attention_mask=torch.ones(1, 1, 8, 7))),
    "mask-4d-not-block-causal": lambda: _build(
        _row(_packed_seq_ids=None, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
    ),
    "mask-2d-shape": lambda: _build(_row(_packed_seq_ids=None, attention_mask=torch.ones(1, 9))),
    "mask-2d-padding-not-tail": lambda: _build(_row(_packed_seq_ids=None, attention_mask=_ids(0, 1, 1, 1, 1, 1, 1, 1))),
    "field-not-tensor": lambda: _build(_row(labels=[0] * 8)),
    "field-shape": lambda: _build(_row(labels=torch.ones(1, 9, dtype=torch.long))),
    "field-mrope-shape": lambda: _build(_row(position_ids=torch.ones(2, 1, 8, dtype=torch.long))),
    "loss-mask-shape": lambda: _build(_row(), loss_mask=torch.ones(1, 5)),
    "knob-attn-backend": lambda: _build(_row(), attn_backend="ring"),
    "knob-kv-exchange": lambda: _build(_row(), kv_exchange="ring"),
    "knob-layout": lambda: _build(_row(), layout="spiral"),
    "knob-configure": lambda: configure_cp_varlen(kv_exchange="ring"),
    "options-and-knobs": lambda: _build(_row(), options=CPOptions(), kv_exchange="a2a"),
    "options-type": lambda: _build(_row(), options={"kv_exchange": "a2a"}),
    "agreement-already-agreed": lambda: _build(_row(), agreement=StepAgreement(agreed=True)),
    "agreement-other-group": lambda: _two_groups_one_agreement(),
    "options-overlap": lambda: CPOptions(overlap="yes"),
    "options-consensus": lambda: CPOptions(consensus="often"),
    "options-retired-spelling": lambda: CPOptions(attn_backend="sdpa"),
    "options-head-parallel-exchange": lambda: CPOptions(kv_exchange="halo", head_parallel=2),
    "options-head-parallel-value": lambda: CPOptions(kv_exchange="ulysses+halo", head_parallel=1),
}


# ----------------------------------------------------------------------------- core: q/k/v in a step


def _attend(
    q_shape: tuple,
    k_shape: tuple,
    v_shape: tuple | None = None,
    gqa: bool = True,
    call: dict[str, Any] | None = None,
    **cast: Any,
) -> Any:
    """``cp_blockdiag_sdpa`` (with extra ``call`` arguments) inside a cp=1 step over an 8-token row (local length 8)."""
    q, k = torch.zeros(q_shape), torch.zeros(k_shape)
    v = torch.zeros(v_shape or k_shape)
    q, k, v = (t.to(**cast.get(n, {})) for n, t in (("q", q), ("k", k), ("v", v)))
    ctx, _, _ = _build(_row())
    with ctx():
        return cp_blockdiag_sdpa(q, k, v, enable_gqa=gqa, **(call or {}))


QKV: dict[str, Callable[[], Any]] = {
    "qkv-rank": lambda: _attend((4, 8, 8), (1, 2, 8, 8)),
    "qkv-dtype": lambda: _attend((1, 4, 8, 8), (1, 2, 8, 8), k={"dtype": torch.float64}, v={"dtype": torch.float64}),
    "qkv-device": lambda: _attend((1, 4, 8, 8), (1, 2, 8, 8), k={"device": "meta"}),
    "qkv-head-dim": lambda: _attend((1, 4, 8, 8), (1, 2, 8, 4)),
    "qkv-batch": lambda: _attend((2, 4, 8, 8), (2, 2, 8, 8)),
    "qkv-kv-heads": lambda: _attend((1, 4, 8, 8), (1, 2, 8, 8), (1, 1, 8, 8)),
    "qkv-heads-multiple": lambda: _attend((1, 3, 8, 8), (1, 2, 8, 8)),
    "qkv-gqa": lambda: _attend((1, 4, 8, 8), (1, 2, 8, 8), gqa=False),
    "qkv-length": lambda: _attend((1, 4, 6, 8), (1, 2, 6, 8)),
    "variant-window": lambda: AttentionVariant(window=0, source="MistralForCausalLM layer 0"),
    "variant-softcap": lambda: AttentionVariant(softcap=0.0),
    "variant-sinks-type": lambda: AttentionVariant(sinks=torch.zeros(2, 2)),
    "variant-sinks-heads": lambda: _attend(
        (1, 4, 8, 8), (1, 2, 8, 8), call={"variant": AttentionVariant(sinks=torch.zeros(2))}
    ),
    "variant-kwargs-in-step": lambda: _attend((1, 4, 8, 8), (1, 2, 8, 8), call={"sliding_window": 4}),
    "variant-outside-step": lambda: cp_blockdiag_sdpa(
        torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8), variant=AttentionVariant(window=4)
    ),
}


# ----------------------------------------------------------------------------- core: explicit kernels


def _attend_with(
    backend: str,
    head_dim: int = 8,
    dropout_p: float = 0.0,
    value_head_dim: int | None = None,
    variant: AttentionVariant | None = None,
) -> Any:
    """``cp_blockdiag_sdpa`` with an explicit kernel inside a cp=1 step of the CPU row above."""
    q, k = torch.zeros(1, 4, 8, head_dim), torch.zeros(1, 2, 8, head_dim)
    v = torch.zeros(1, 2, 8, value_head_dim or head_dim)
    ctx, _, _ = _build(_row(), attn_backend=backend)
    with ctx():
        return cp_blockdiag_sdpa(q, k, v, dropout_p=dropout_p, enable_gqa=True, variant=variant or AttentionVariant())


def _with_stand_ins(fa3: str, call: Callable[[], Any]) -> Any:
    """``call()`` with the GPU libraries' stand-ins installed, FlashAttention-3 of build era ``fa3``."""
    from tests.cases import fake_kernels
    from tests.fakes.machine import Machine

    with fake_kernels(machine=Machine(fa3=fa3)):
        return call()


def _packed_with(backend: str = "auto", length: int = 8, **call: Any) -> Any:
    """The cp=1 packed path armed (kernel ``backend``) for an 8-token row, called on ``length`` tokens, on CPU."""
    q, k = torch.zeros(1, 4, length, 8), torch.zeros(1, 2, length, 8)
    enable_cp1_packed_varlen(doc_ids_from_lengths([3, 5], 8), backend=backend)
    try:
        return packed_varlen_sdpa(q, k, k, enable_gqa=True, **call)
    finally:
        disable_cp1_packed_varlen()


def _windowed_model() -> torch.nn.Module:
    """A module with one ``self_attn`` and a Mistral-like transformers config (window 4 on both layers)."""
    model = torch.nn.Module()
    model.self_attn = torch.nn.Identity()
    model.config = SimpleNamespace(model_type="mistral", sliding_window=4, num_hidden_layers=2)
    return model


KERNEL: dict[str, Callable[[], Any]] = {
    "kernel-flash-device": lambda: _attend_with("flash"),
    "kernel-flash-head-dim": lambda: _attend_with("flash", head_dim=264),
    "kernel-flash-sinks-dropout": lambda: _attend_with(
        "flash", dropout_p=0.1, variant=AttentionVariant(sinks=torch.zeros(4))
    ),
    "kernel-fa3-device": lambda: _attend_with("fa3"),
    "kernel-fa3-sinks-unread-pair": lambda: _with_stand_ins(
        "2024-08", lambda: _attend_with("fa3", variant=AttentionVariant(sinks=torch.zeros(4)))
    ),
    "kernel-fa3-dropout": lambda: _attend_with("fa3", dropout_p=0.1),
    "kernel-fa3-head-dim": lambda: _attend_with("fa3", head_dim=12),
    "kernel-torch-varlen-device": lambda: _attend_with("torch_varlen"),
    "kernel-torch-varlen-dropout": lambda: _attend_with("torch_varlen", dropout_p=0.1),
    "kernel-torch-varlen-head-dim": lambda: _attend_with("torch_varlen", head_dim=264),
    "kernel-torch-varlen-head-dim-8": lambda: _attend_with("torch_varlen", head_dim=12),
    "kernel-flash-value-head-dim": lambda: _attend_with("flash", head_dim=16, value_head_dim=8),
    "kernel-torch-varlen-value-head-dim": lambda: _attend_with("torch_varlen", head_dim=16, value_head_dim=8),
    "kernel-fa3-value-head-dim": lambda: _attend_with("fa3", head_dim=128, value_head_dim=64),
    "kernel-cp1-packed": lambda: _packed_with("fa3"),
}


# ----------------------------------------------------------------------------- core: groups, ranks, planner, cp=1


class _MismatchedMesh:
    """A 1-D mesh of size 1 whose process group is the whole 2-rank world."""

    ndim = 1

    def size(self) -> int:
        return 1

    def get_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def get_local_rank(self) -> int:
        return 0


def _two_d_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return make_cp_blockdiag_batch_and_ctx(init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp")), None, _row())


def _disagreeing_rank() -> Any:
    """Rank 1 asks for another exchange; the first CP call of the step must stop every rank."""
    exchange = "a2a" if dist.get_rank() == 1 else "halo"
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, _row(16), kv_exchange=exchange)
    q = torch.zeros(1, 2, shard.local_len, 4)
    with ctx():
        return cp_blockdiag_sdpa(q, q, q)


def _planner(*argv: str) -> None:
    """The planner's command line; its usage error becomes ``SystemExit(<stderr>)``."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            recipe_plan.main(list(argv))
    except SystemExit as exc:
        raise SystemExit(err.getvalue()) from exc


def _core_planner(*argv: str) -> None:
    """The core planner's command line (no recipe data pipeline); its usage error becomes ``SystemExit(<stderr>)``."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            plan.main(list(argv))
    except SystemExit as exc:
        raise SystemExit(err.getvalue()) from exc


def _planner_data(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        path.write_text(text)
        _planner("--cp", "2", "--seq-len", "64", "--data", str(path))


CORE: dict[str, Callable[[], Any]] = {
    "mesh-not-1d": _two_d_mesh,
    "mesh-group-size": lambda: make_cp_blockdiag_batch_and_ctx(_MismatchedMesh(), None, _row()),
    "ranks-disagree": _disagreeing_rank,
    "hybrid-factorization": lambda: make_cp_blockdiag_batch_and_ctx(
        cp_mesh(), None, _row(16), kv_exchange="ulysses+halo"
    ),
    "cp1-no-attention-modules": lambda: attach_cp1_packed_varlen_hooks(torch.nn.Linear(2, 2)),
    "cp1-hooks-windowed-model": lambda: attach_cp1_packed_varlen_hooks(
        _windowed_model(), attention_features=attention_features(_windowed_model().config).names()
    ),
    "cp1-hooks-no-features": lambda: attach_cp1_packed_varlen_hooks(_windowed_model()),
    "cp1-packed-kwargs": lambda: _packed_with(sliding_window=4),
    "cp1-packed-variant-passthrough": lambda: _packed_with(length=6, variant=AttentionVariant(softcap=30.0)),
    "plan-cp": lambda: _planner("--cp", "0", "--seq-len", "64", "--doc-lens", "8"),
    "plan-seq-len": lambda: _planner("--cp", "2", "--seq-len", "x", "--doc-lens", "8"),
    "plan-doc-lens": lambda: _planner("--cp", "2", "--seq-len", "64", "--doc-lens", "8,0"),
    "plan-doc-lens-too-long": lambda: _planner("--cp", "2", "--seq-len", "64", "--doc-lens", "60,8"),
    "plan-data-core": lambda: _core_planner("--cp", "2", "--seq-len", "64", "--data", "data.jsonl"),
    "plan-data-missing": lambda: _planner("--cp", "2", "--seq-len", "64", "--data", "/nonexistent/data.jsonl"),
    "plan-model-missing": lambda: _planner("--cp", "2", "--seq-len", "8", "--doc-lens", "8", "--model", "/nonexistent"),
    "plan-data-line": lambda: _planner_data('{"text": "abc"}\n[1, 2]\n'),
    "plan-lib-lengths": lambda: doc_runs_from_lengths([3, 0]),
    "plan-lib-total": lambda: doc_runs_from_lengths([5], 3),
    "plan-lib-multiple": lambda: make_shard_plan(doc_runs_from_lengths([5]), 2),
    "plan-lib-layout": lambda: make_shard_plan(doc_runs_from_lengths([6]), 2, "spiral"),
}
IN_POOL = {"mesh-not-1d", "mesh-group-size", "ranks-disagree", "hybrid-factorization", "launch-run-dir-not-shared"}


# ----------------------------------------------------------------------------- recipe


def _compose(*overrides: str) -> Any:
    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="finetune", overrides=list(overrides))


def _config(*overrides: str) -> Any:
    return to_finetune_config(_compose(*overrides))


def _values(*overrides: str) -> Callable[[], Any]:
    return lambda: _config(*overrides)


def _chat_tokenizer(template: str | None = CHAT_TEMPLATE, eos: bool = True) -> HFTokenizer:
    """The tests' character-level chat tokenizer, saved and loaded (``eos=False``: without an EOS id)."""
    with tempfile.TemporaryDirectory() as tmp:
        save_chat_tokenizer(Path(tmp), template)
        tokenizer = HFTokenizer.load(tmp)
    return tokenizer if eos else HFTokenizer(tokenizer.name, tokenizer.vocab_size, 0, None, tokenizer._tokenizer)


def _data(text: str, tokenizer: Any = None, **fields: Any) -> None:
    """The recipe's data preparation of one JSONL file holding ``text`` (``fields`` override the data config)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        path.write_text(text)
        cfg = DataConfig(**{"source": "text", "path": str(path), "seq_len": 64, **fields})
        prepare_data(cfg, tokenizer or ByteTokenizer())


def _jsonl(text: str) -> None:
    _data(text)


def _bad_utf8() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        path.write_bytes(b'{"text": "fine"}\n{"text": "\xff"}\n')
        prepare_data(DataConfig(source="text", path=str(path), seq_len=64, cache_dir=tmp), ByteTokenizer())


# A JSON Lines file whose second line (61 bytes) is over data.max_record_bytes=32.
BIG_RECORDS = '{"text": "a"}\n{"text": "%s"}\n' % ("x" * 49)


def _big_parquet_row() -> None:
    """A parquet file whose second row holds 40 bytes of text, over ``data.max_record_bytes=32``."""
    import datasets

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.parquet"
        datasets.Dataset.from_list([{"text": "a"}, {"text": "x" * 40}]).to_parquet(str(path))
        cfg = DataConfig(source="text", path=str(path), seq_len=64, max_record_bytes=32, long_records="error")
        prepare_data(cfg, ByteTokenizer())


def _chat(*conversations: list[tuple[str, str]], tokenizer: Any = None, **fields: Any) -> None:
    """``data=chat`` over ``conversations`` (each ``[(role, content), ...]``) with the chat tokenizer."""
    lines = [json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]}) for conv in conversations]
    _data("\n".join(lines) + "\n", tokenizer or _chat_tokenizer(), **{"source": "chat", **fields})


TOOL_CALL = {"type": "function", "function": {"name": "weather", "arguments": "{}"}}


def _messages(*messages: dict[str, Any]) -> None:
    """``data=chat`` over one conversation of raw ``messages`` with the chat tokenizer (no tool-call rendering)."""
    _data(json.dumps({"messages": list(messages)}) + "\n", _chat_tokenizer(), source="chat")


def _files(*names: str, first: bool = False, **fields: Any) -> None:
    """``check_paths`` on a directory holding ``names`` (one-row text files), or on its ``first`` file."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            (Path(tmp) / name).write_text('{"text": "abc"}\n')
        path = str(Path(tmp) / names[0]) if first else tmp
        check_paths(to_finetune_config({"data": {"source": "text", "path": path, **fields}}))


def _short_position_table() -> None:
    from transformers import LlamaConfig

    with tempfile.TemporaryDirectory() as tmp:
        LlamaConfig(max_position_embeddings=64).save_pretrained(tmp)
        check_positions(tmp, 128)


def _locked_run_dir() -> None:
    with tempfile.TemporaryDirectory() as tmp, hold_run_dir(Path(tmp)):
        hold_run_dir(Path(tmp)).__enter__()


def _used_run_dir() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "metrics.jsonl").write_text("{}\n")
        check_run_dir(to_finetune_config({"trainer": {"resume": "never"}}), Path(tmp))


QA = [("user", "what is 2+2?"), ("assistant", "4")]
# A template that marks the last turn: earlier renderings are not prefixes of later ones.
NOT_INCREMENTAL = (
    "{% for m in messages %}{% if loop.last %}LAST{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
)


def _small_vocabulary_model() -> None:
    """A local HF model with 100 embedding rows, loaded for the 256-token byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        tiny = LlamaConfig(
            vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
        LlamaForCausalLM(tiny).save_pretrained(tmp)
        build_causal_lm(ModelConfig(pretrained_path=tmp), 256, seed=0, activation_checkpointing=False)


def _patch_sdpa_window() -> None:
    """A saved Mistral (window 4 on every layer) loaded for the patch_sdpa route."""
    from transformers import MistralConfig, MistralForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        tiny = MistralConfig(
            vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, sliding_window=4,
        )  # fmt: skip
        MistralForCausalLM(tiny).save_pretrained(tmp)
        build_causal_lm(
            ModelConfig(pretrained_path=tmp, attention="patch_sdpa"), 256, seed=0, activation_checkpointing=False
        )


def _saved_lfm2() -> None:
    """A saved LFM2 (short convolutions along the sequence) loaded by the recipe's model builder."""
    from transformers import AutoModelForCausalLM

    from tests.families import make_config

    with tempfile.TemporaryDirectory() as tmp:
        config = make_config("lfm2")
        config.vocab_size = 256
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        build_causal_lm(ModelConfig(pretrained_path=tmp), 256, seed=0, activation_checkpointing=False, seq_len=64)


def _packable(name: str, seq_len: int | None = None, route: str = "hf_interface") -> None:
    from nemo_automodel.components.models.packing_guard import check_packable_config
    from tests.families import make_config

    check_packable_config(make_config(name), route, seq_len)


def _probe(name: str) -> None:
    """The packing-isolation probe (cp=1, in process) on a tiny model of the table, loaded on our attention."""
    from nemo_automodel.components.models.cp_attention import CP_ATTN_IMPLEMENTATION, register_cp_attention
    from nemo_automodel.components.models.packing_probe import verify_packing_isolation
    from tests.families import build_model

    register_cp_attention()
    verify_packing_isolation(build_model(name, CP_ATTN_IMPLEMENTATION).float())


def _patch_sdpa_config(config: Any) -> None:
    from nemo_automodel.components.models.attention_features import check_attention_route

    check_attention_route(config, "patch_sdpa")


def _gemma2_config() -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(num_hidden_layers=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"])


def _gpt_oss_config() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(num_hidden_layers=2)


class _MistralLayer(torch.nn.Module):
    """A stand-in attention module: layer 3 of a MistralForCausalLM."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_idx = 3
        self.config = SimpleNamespace(architectures=["MistralForCausalLM"])


def _attention_call(**kwargs: Any) -> Any:
    from nemo_automodel.components.models.cp_attention import cp_blockdiag_attention

    q = torch.zeros(1, 2, 4, 8)
    return cp_blockdiag_attention(_MistralLayer(), q, q, q, None, **kwargs)


def _chunk_over_cache() -> Any:
    """A Llama 4 chunked layer outside a CP step: 2 new queries over 4 keys (2 of them cached)."""
    from nemo_automodel.components.models.cp_attention import cp_blockdiag_attention

    layer = _MistralLayer()
    layer.config = SimpleNamespace(
        architectures=["Llama4ForCausalLM"], layer_types=[*["chunked_attention"] * 4], attention_chunk_size=8
    )
    q, kv = torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 4, 8)
    return cp_blockdiag_attention(layer, q, kv, kv, None)


def _attention_never_reached(cp: int = 2, route: str = "patch_sdpa") -> None:
    setup = SimpleNamespace(meshes=SimpleNamespace(cp=SimpleNamespace(size=lambda: cp)), attention=route)
    ctx, _, _ = make_cp_blockdiag_batch_and_ctx(None, None, _row())
    with ctx() as state:  # a forward ran, but the model's attention never called CP attention
        _check_cp_reached_attention(setup, state)


POSITIVE_FIELDS = (
    "model.hidden_size",
    "model.num_layers",
    "model.num_heads",
    "model.num_kv_heads",
    "model.intermediate_size",
    "data.num_documents",
    "data.max_record_bytes",
    "optim.lr",
    "optim.decay_steps",
    "trainer.max_steps",
    "trainer.grad_accum",
    "trainer.log_every",
    "trainer.keep_checkpoints",
    "dist.dp_size",
    "dist.pg_timeout_s",
    "dist.shutdown_timeout_s",
    "dist.threads",
)
NON_NEGATIVE_FIELDS = ("optim.warmup_steps", "optim.grad_clip", "trainer.ckpt_every", "trainer.val_every")


def _run_dir_not_shared() -> None:
    """Each rank looks in its own temporary directory, as nodes without a shared filesystem would."""
    with tempfile.TemporaryDirectory() as tmp:
        check_shared_run_dir(Path(tmp), dist.get_rank(), settle_s=0.2)


RECIPE: dict[str, Callable[[], Any]] = {
    "config-unknown-key": lambda: check_override_keys(["+cp=blockdiag", "trainer.max_stepz=3"]),
    "config-unknown-section": lambda: check_override_keys(["traner.max_steps=3"]),
    "config-compose-unknown-key": lambda: _compose("trainer.max_stepz=3"),
    "config-wrong-type": lambda: _compose("trainer.max_steps=many"),
    "config-payload-unknown-key": lambda: to_finetune_config({"data": {"seq_length": 128}}),
    "config-cp-kv-exchange": _values("+cp=blockdiag", "cp.kv_exchange=ring"),
    "config-cp-attn-backend": _values("+cp=blockdiag", "cp.attn_backend=cudnn"),
    "config-cp-layout": _values("+cp=blockdiag", "cp.layout=spiral"),
    "config-cp-size": _values("+cp=blockdiag", "cp.size=0"),
    "config-cp-consensus": _values("+cp=blockdiag", "cp.consensus=often"),
    "config-cp-retired-spelling": _values("+cp=blockdiag", "cp.kv_exchange=neighbor"),
    "config-cp-check-finite": _values("+cp=blockdiag", "cp.check_finite=maybe"),
    "config-seq-len-cp": _values("+cp=blockdiag", "data.seq_len=3"),
    "config-seq-len-min": _values("data.seq_len=1"),
    "config-seq-len-positions": _values("data.seq_len=8192"),
    "config-eager-with-cp": _values("+cp=blockdiag", "model.attention=eager"),
    "config-attention-route": _values("model.attention=flex"),
    "config-data-source": _values("data.source=csv"),
    "config-packing": _values("data.packing_algorithm=best_fit"),
    "config-long-documents": _values("data.long_documents=drop"),
    "config-heads-multiple": _values("model.num_heads=6"),
    "config-hidden-divisible": _values("model.hidden_size=250"),
    "config-doc-len-range": _values("data.min_doc_len=10", "data.max_doc_len=5"),
    "config-betas": _values("optim.betas=[0.9]"),
    "config-range-dist-cpu-malloc-threshold-kib": _values("dist.cpu_malloc_threshold_kib=0"),
    "config-min-lr-ratio": _values("optim.min_lr_ratio=2"),
    "config-resume": _values("trainer.resume=sometimes"),
    "config-on-nonfinite": _values("trainer.on_nonfinite=ignore"),
    "config-plus-unknown-key": lambda: to_finetune_config(_compose("+trainer.max_step=5")),
    "config-data-loss-on": _values("data=chat", "data.loss_on=prompt"),
    "config-data-loss-on-text": _values("data=jsonl", "data.loss_on=answer"),
    "config-long-conversations": _values("data=chat", "data.long_conversations=wrap"),
    "config-long-records": _values("data=jsonl", "data.long_records=skip"),
    "config-empty-answers": _values("data=chat", "data.empty_answers=ignore"),
    "config-validation-fraction": _values("data.validation=1.5"),
    "config-validation-synthetic-path": _values("data.validation=/data/val.jsonl"),
    "config-val-every-without-validation": _values("trainer.val_every=10"),
    "config-keep-best-without-validation": _values("trainer.keep_best=true"),
    "config-export-dtype": _values("trainer.export_dtype=int8"),
    **{f"config-positive-{f.replace('.', '-').replace('_', '-')}": _values(f"{f}=0") for f in POSITIVE_FIELDS},
    **{f"config-non-negative-{f.replace('.', '-').replace('_', '-')}": _values(f"{f}=-1") for f in NON_NEGATIVE_FIELDS},
    "path-jsonl-required": lambda: check_paths(_config("data=jsonl")),
    "path-jsonl-missing": lambda: check_paths(_config("data=jsonl", "data.path=/nonexistent/train.jsonl")),
    "path-model-missing": lambda: check_paths(_config("model.pretrained_path=/nonexistent/model")),
    "path-tokenizer-missing": lambda: check_paths(_config("tokenizer.name_or_path=/nonexistent/tokenizer")),
    "data-jsonl-bad-json": lambda: _jsonl('{"text": "a"}\n{"text": \n'),
    "data-jsonl-no-text": lambda: _jsonl('{"body": "a"}\n'),
    "data-jsonl-bad-utf8": _bad_utf8,
    "data-jsonl-duplicate-key": lambda: _jsonl('{"text": "a"}\n{"text": "b", "text": "c"}\n'),
    "data-jsonl-empty": lambda: _jsonl("\n\n"),
    "data-record-too-large": lambda: _data(BIG_RECORDS, max_record_bytes=32, long_records="error"),
    "data-record-too-large-row": _big_parquet_row,
    "data-all-records-too-large": lambda: _data('{"text": "%s"}\n' % ("x" * 40), max_record_bytes=32),
    "data-all-empty": lambda: pack_documents([[], []], 8, "first_fit_decreasing", 0, 0),
    "path-data-mixed-formats": lambda: _files("a.jsonl", "b.parquet"),
    "path-data-split-missing": lambda: _files("train.jsonl", "test.jsonl", split="validation"),
    "path-data-split-of-a-file": lambda: _files("train.jsonl", first=True, split="train"),
    "path-validation-missing": lambda: _files("train.jsonl", validation="/nonexistent/v.jsonl"),
    "run-dir-resume-never": _used_run_dir,
    "kernel-explicit-unavailable": lambda: check_attn_backend(
        _config("+cp=blockdiag", "cp.attn_backend=te"), torch.device("cpu")
    ),
    "data-chat-role": lambda: _chat([("user", "hi"), ("robot", "beep")]),
    "data-chat-no-template": lambda: _chat(QA, tokenizer=_chat_tokenizer(template=None)),
    "data-chat-no-assistant": lambda: _chat([("user", "hi")]),
    "data-chat-not-incremental": lambda: _chat(QA, tokenizer=_chat_tokenizer(template=NOT_INCREMENTAL)),
    "data-chat-tool-calls-unsupported": lambda: _messages(
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
    ),
    "data-chat-content-null": lambda: _messages(
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}
    ),
    "data-chat-tool-calls-malformed": lambda: _messages(
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}
    ),
    "data-chat-empty-answer": lambda: _chat([("user", "hi"), ("assistant", "")], empty_answers="error"),
    "data-chat-too-long": lambda: _chat([("user", "x" * 80), ("assistant", "y")], long_conversations="error"),
    "data-chat-all-too-long": lambda: _chat([("user", "x" * 80), ("assistant", "y")]),
    "data-chat-all-too-long-held-out": lambda: _chat([("user", "x" * 80), ("assistant", "y")], validation="0.1"),
    "data-mixed-file": lambda: _data(
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n{"text": "c"}\n',
        _chat_tokenizer(),
        source="chat",
    ),
    "data-instruction-empty-completion": lambda: _data(
        '{"prompt": "2+2=", "completion": "4"}\n{"prompt": "3+3=", "completion": " "}\n', source="instruction"
    ),
    "data-no-eos": lambda: _chat(QA, tokenizer=_chat_tokenizer(eos=False)),
    "data-validation-holds-all": lambda: _data('{"text": "abc"}\n', validation="0.9"),
    "launch-cp-world": lambda: resolve_topology(world=3, rank=0, local_rank=0, cp_size=2, dp_size=None),
    "launch-dp-size": lambda: resolve_topology(world=2, rank=0, local_rank=0, cp_size=2, dp_size=2),
    "launch-run-dir-not-shared": _run_dir_not_shared,
    "launch-slurm-nodelist": lambda: first_slurm_host("[bad"),
    "launch-run-dir-locked": _locked_run_dir,
    "model-seq-len-positions": _short_position_table,
    "resume-max-steps-below": lambda: check_resume_step(3, Path("/run/checkpoints/step_00000010"), 10),
    "resume-changed-data": lambda: compare_fingerprints(
        {"data.seq_len": 256, "optim.lr": 0.1}, {"data.seq_len": 128, "optim.lr": 0.2}, Path("/run/step_3"), 3
    ),
    "launch-omp-num-threads": lambda: omp_num_threads("four"),
    "model-vocabulary": _small_vocabulary_model,
    "model-attention-never-cp": _attention_never_reached,
    "model-attention-never-cp1": lambda: _attention_never_reached(cp=1, route="hf_interface"),
    "model-packing-conv": _saved_lfm2,
    "model-packing-state-space": lambda: _packable("qwen3_next"),
    "model-packing-alibi": lambda: _packable("bloom"),
    "model-packing-bypass": lambda: _packable("falcon"),
    "model-packing-chunked": lambda: _packable("llama4_text", seq_len=5, route="eager"),
    "model-packing-temperature": lambda: _packable("llama4_text", seq_len=4),
    "model-packing-leak": lambda: _probe("lfm2"),
    "model-packing-probe-no-attention": lambda: _probe("bloom"),
    "model-patch-sdpa-window": _patch_sdpa_window,
    "model-patch-sdpa-softcap": lambda: _patch_sdpa_config(_gemma2_config()),
    "model-patch-sdpa-sinks": lambda: _patch_sdpa_config(_gpt_oss_config()),
    "attention-unknown-keyword": lambda: _attention_call(attention_chunk_size=8),
    "attention-not-causal": lambda: _attention_call(is_causal=False),
    "attention-weights": lambda: _attention_call(output_attentions=True),
    "attention-packing-metadata": lambda: _attention_call(cu_seq_lens_q=torch.zeros(2, dtype=torch.int32)),
    "attention-bad-window": lambda: _attention_call(sliding_window=0),
    "attention-chunk-over-cache": _chunk_over_cache,
}

_TINY_LLAMA = ("model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1")


def _lora(*overrides: str) -> Any:
    """``peft=lora`` on a tiny built Llama: the recipe's adapter set-up (no process group)."""
    config = _config("peft=lora", *_TINY_LLAMA, *overrides)
    model = build_causal_lm(config.model, 256, seed=0, activation_checkpointing=False)
    return setup_lora(model, config.peft, "base")


def _saved_adapter_mismatch() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _lora("peft.r=4").save_pretrained(tmp)
        _lora("peft.r=8", f"peft.adapter_path={tmp}")


def _resume(saved: BaseModel | None, ours: BaseModel | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if saved is not None:
            (Path(tmp) / BASE_MODEL_FILE).write_text(json.dumps(saved.record()))
        check_resume(Path(tmp), ours)


_BASE_A, _BASE_B = BaseModel("/models/a", "a" * 64), BaseModel("/models/b", "b" * 64)
LORA: dict[str, Callable[[], Any]] = {
    "lora-target-unknown": lambda: _lora("peft.target_modules=[qproj]"),
    "lora-target-not-linear": lambda: _lora("peft.target_modules=[mlp]"),
    "lora-target-empty": _values("peft=lora", "peft.target_modules=[]"),
    "lora-dropout": _values("peft=lora", "peft.dropout=1.0"),
    "lora-without-peft": _values("peft.adapter_path=/adapters/a"),
    "lora-quantize-value": _values("peft=lora", "peft.quantize=8bit"),
    "lora-quantize-cpu": lambda: check_quantize(_config("peft=lora", "peft.quantize=4bit").peft, torch.device("cpu")),
    "lora-adapter-path-empty": lambda: _lora(f"peft.adapter_path={tempfile.gettempdir()}"),
    "lora-adapter-mismatch": _saved_adapter_mismatch,
    "lora-resume-full-checkpoint": lambda: _resume(None, _BASE_A),
    "lora-resume-without-peft": lambda: _resume(_BASE_A, None),
    "lora-resume-other-base": lambda: _resume(_BASE_A, _BASE_B),
}

TRIGGERS: dict[str, Callable[[], Any]] = {**BATCH, **QKV, **KERNEL, **CORE, **RECIPE, **LORA}


def _outcome(trigger_id: str) -> tuple[str | None, str]:
    """``(error type, message)`` of one trigger (``(None, "")`` when it raised nothing); the cause's message too."""
    try:
        TRIGGERS[trigger_id]()
    except BaseException as exc:
        cause = f" | caused by: {exc.__cause__}" if exc.__cause__ is not None else ""
        return type(exc).__name__, f"{exc}{cause}"
    finally:
        configure_cp_varlen()
    return None, ""


def _rows() -> dict[str, dict[str, str]]:
    rows = {}
    for line in CATALOGUE.read_text().splitlines():
        match = ROW.match(line)
        if match:
            assert match["id"] not in rows, f"duplicate catalogue id {match['id']}"
            rows[match["id"]] = match.groupdict()
    return rows


def test_every_catalogue_row_has_a_case_and_every_case_a_row():
    rows = _rows()
    assert sorted(set(rows) - set(TRIGGERS)) == [], "rows without a case"
    assert sorted(set(TRIGGERS) - set(rows)) == [], "cases without a row"


@pytest.mark.parametrize("row_id", sorted(TRIGGERS))
def test_the_documented_input_is_rejected_with_the_documented_error(pools, row_id):
    row = _rows().get(row_id)
    assert row is not None, f"{row_id} is not in {CATALOGUE.name}"
    if row_id in IN_POOL:
        outcomes = pools.get(2).run_ok(_outcome, row_id, timeout=60)
    else:
        outcomes = [_outcome(row_id)]
    for error, message in outcomes:
        assert error == row["error"], f"{row_id}: raised {error}: {message}"
        assert row["message"] in message, f"{row_id}: message {message!r} lacks {row['message']!r}"

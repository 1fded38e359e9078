"""Tiny recipe configs, pool-worker entry points and run-dir readers for the recipe tests."""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nemo_automodel.components.config.schema import to_finetune_config
from nemo_automodel.components.distributed.blockdiag_cp import make_cp_blockdiag_batch_and_ctx
from nemo_automodel.components.distributed.parallel import resolve_topology
from nemo_automodel.components.models.causal_lm import build_causal_lm
from nemo_automodel.components.training.loss import token_ce_sum
from nemo_automodel.recipes.finetune import train

REPO = Path(__file__).resolve().parents[1]

# hidden 64, 2 layers, 8 q / 4 kv heads, byte vocab, 256-token rows: seconds per run on 2 CPU cores.
TINY_MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 128}
TINY_DATA = {"seq_len": 256, "num_documents": 300, "max_doc_len": 400}

# The same tiny run as Hydra CLI overrides (for the subprocess tests).
TINY_OVERRIDES = [f"model.{k}={v}" for k, v in TINY_MODEL.items()] + [f"data.{k}={v}" for k, v in TINY_DATA.items()]


def tiny_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """A plain config dict for a tiny run; ``sections`` update the named sections."""
    cfg: dict[str, Any] = {
        "model": dict(TINY_MODEL),
        "data": dict(TINY_DATA),
        "trainer": {"max_steps": 20, "grad_accum": 2, "log_every": 5, "ckpt_every": 0, "export_hf": True},
        "optim": {"warmup_steps": 5},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def read_losses(run_dir: Path) -> dict[int, float]:
    """``{step: loss}`` from ``metrics.jsonl`` (a later line for the same step wins, as after a resume)."""
    losses: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            losses[record["step"]] = record["loss"]
    return losses


def read_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """``{step: metrics.jsonl record}`` (a later line for the same step wins)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r for r in records}


def train_in_pool(payload: dict[str, Any], run_dir: str) -> dict[str, Any] | None:
    """Pool worker: train on the pool's process group; rank 0 returns losses, metrics and the exported weights."""
    from safetensors.torch import load_file

    config = to_finetune_config(payload)
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = resolve_topology(world, rank, rank, config.cp.size, config.dist.dp_size)
    code = train(config, Path(run_dir), topology, torch.device("cpu"))
    if rank != 0:
        return None
    return {
        "code": code,
        "losses": read_losses(Path(run_dir)),
        "metrics": read_metrics(Path(run_dir)),
        "weights": load_file(str(Path(run_dir) / "hf" / "model.safetensors")),
    }


def packed_logits(route: str, rows: list[dict[str, torch.Tensor]], kv_exchange: str) -> list[torch.Tensor]:
    """Pool worker: full-row logits ``[S, V]`` of each packed row through the real model, CP over the whole pool."""
    from torch.distributed.device_mesh import init_device_mesh

    from nemo_automodel.components.config.schema import ModelConfig
    from nemo_automodel.components.models.cp_attention import attention_scope

    model = build_causal_lm(ModelConfig(attention=route, **TINY_MODEL), 256, seed=7, activation_checkpointing=False)
    model.eval()
    world = dist.get_world_size()
    cp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out = []
    for row in rows:
        ctx, local, layout = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, row, kv_exchange=kv_exchange)
        with torch.no_grad(), ctx(), attention_scope(route):
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits[0]
        gathered = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(gathered, logits.contiguous())
        out.append(torch.cat(gathered)[: layout.original_seq_len])
    return out


def per_document_loss(model: torch.nn.Module, rows: Iterable[dict[str, torch.Tensor]]) -> float:
    """Mean CE over every label token of ``rows``, each document alone through ``model`` (no packing, no CP).

    Each row holds ``input_ids``/``labels``/``_packed_seq_ids`` of shape ``[1, S]``; document 0 is padding.
    """
    ce, tokens = 0.0, 0
    with torch.no_grad():
        for row in rows:
            for doc in row["_packed_seq_ids"].unique().tolist():
                if doc == 0:
                    continue
                where = row["_packed_seq_ids"][0] == doc
                ids, labels = row["input_ids"][:, where], row["labels"][:, where]
                logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
                ce += token_ce_sum(logits, labels).item()
                tokens += int((labels != -100).sum())
    return ce / tokens


def run_recipe(args: list[str], timeout: float = 240, **popen: Any) -> subprocess.CompletedProcess[str]:
    """``python recipes/finetune.py *args`` with this checkout first on the path; a hang fails by timeout."""
    return subprocess.run(
        [sys.executable, str(REPO / "recipes" / "finetune.py"), *args],
        cwd=REPO,
        env=recipe_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def recipe_env() -> dict[str, str]:
    """The environment for a recipe subprocess: no inherited launcher variables, this checkout importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


# A character-level HF tokenizer with a chat template, and a matching tiny Llama (no hub: built here).
CHAT_CHARS = string.ascii_letters + string.digits + " +-*=?!.,:;'\n"
CHAT_SPECIALS = ("[PAD]", "[UNK]", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# Every turn: role header, content, <|end|> (the EOS), newline; no {% generation %} markers.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_chat_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> Any:
    """Save a character-level tokenizer (``<|end|>`` is its EOS) with ``chat_template`` into ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(CHAT_SPECIALS)} | {c: i + len(CHAT_SPECIALS) for i, c in enumerate(CHAT_CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # characters back to text without separators
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="[PAD]",
        unk_token="[UNK]",
        eos_token="<|end|>",
        additional_special_tokens=list(CHAT_SPECIALS[2:5]),
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return tokenizer


def save_chat_model(path: Path, dtype: str = "float32") -> Path:
    """A chat tokenizer and a tiny Llama of its vocabulary, saved into ``path`` (the model in ``dtype``)."""
    from transformers import AutoModelForCausalLM

    from nemo_automodel.components.config.schema import ModelConfig
    from nemo_automodel.components.models.causal_lm import llama_config

    tokenizer = save_chat_tokenizer(path)
    config = llama_config(ModelConfig(**TINY_MODEL), vocab_size=len(tokenizer))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(path)
    return path

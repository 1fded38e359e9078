"""The fine-tuning recipe's structured config.

Hydra composes ``conf/finetune.yaml`` on top of :class:`FinetuneConfig` (registered
in the ConfigStore as ``finetune_schema``), so a misspelt key or a wrongly typed
value fails at composition with Hydra's own error. Value checks that need more than
a type (choices, ranges, the CP knobs' synonyms) live in ``__post_init__`` and run
when :func:`to_finetune_config` turns the composed ``DictConfig`` into dataclasses.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from nemo_automodel.components.distributed.blockdiag_cp.cost import Shape
from nemo_automodel.components.distributed.blockdiag_cp.options import CPOptions, config_node_fields
from nemo_automodel.components.distributed.cpu_memory import MAX_THRESHOLD_KIB

# How the model's attention reaches block-diagonal CP:
# - ``hf_interface``: a function registered in transformers' ``AttentionInterface``
#   (the model's ``config._attn_implementation`` is set to it);
# - ``patch_sdpa``: the model keeps calling ``F.scaled_dot_product_attention``, which
#   is routed through CP while a step runs;
# - ``eager``: the model's own matmul attention, which never reaches CP (cp=1 only).
ATTENTION_ROUTES = ("hf_interface", "patch_sdpa", "eager")
DATA_SOURCES = ("synthetic", "text", "chat", "instruction")
# Older spellings of a data source, stored canonical.
DATA_SOURCE_ALIASES = {"jsonl": "text"}
LONG_DOCUMENT_MODES = ("split", "truncate")
# How documents are packed into rows (datasets.packing implements each).
PACKING_ALGORITHMS = ("first_fit_decreasing", "first_fit_shuffle")
# A chat / instruction row longer than data.seq_len: keep its leading turns up to the last whole assistant
# turn that fits (else drop it), drop it, or stop with an error naming it.
LONG_CONVERSATION_MODES = ("leading_turns", "drop", "error")
# A record larger than data.max_record_bytes: skip it (counted in the data log line) or stop naming file and line.
LONG_RECORD_MODES = ("drop", "error")
# A chat assistant turn with no answer (empty content, no tool calls): warn with a count, or stop naming it.
EMPTY_ANSWER_MODES = ("warn", "error")
# Which tokens carry loss: answers only (assistant turns, completions), all, or auto (answers for chat and
# instruction data, all tokens for text).
LOSS_ON = ("auto", "answer", "all")
EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")
RESUME_MODES = ("auto", "never")
# What a step with NaN/Inf in attention inputs, loss or gradient norm does (every rank agrees).
NONFINITE_POLICIES = ("stop", "skip")
# Parameter-efficient fine-tuning: none (full fine-tuning) or LoRA adapters (Hugging Face peft).
PEFT_METHODS = ("none", "lora")
# Base weights of a LoRA run: as trained (none) or 4-bit (QLoRA: CUDA and bitsandbytes only).
QUANTIZE_MODES = ("none", "4bit")


def _require_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(
            f"{name}={value!r} is not valid; choose one of {', '.join(choices)} (e.g. {name}={choices[0]})"
        )


def _require_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value} must be {bound}")


@dataclass
class ModelConfig:
    """The causal LM: a local HF checkpoint, or a Llama built from the size fields below.

    Attributes:
        pretrained_path: Local HF model directory (no hub access); ``None`` builds a random Llama.
        attention: How attention reaches CP, one of :data:`ATTENTION_ROUTES`.
        hidden_size / num_layers / num_heads / num_kv_heads / intermediate_size / rope_theta:
            Size of the built Llama (ignored with ``pretrained_path``).
        max_position_embeddings: RoPE table size of the built Llama (positions restart per document).
        verify_packing: Refuse, at load, a model that packed training cannot compute exactly (token mixing
            outside attention, ALiBi, attention that bypasses the interface), and run the packing-isolation
            probe before step 1. ``false`` skips both, with a loud warning.
    """

    pretrained_path: str | None = None
    attention: str = "hf_interface"
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 768
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    verify_packing: bool = True

    def __post_init__(self) -> None:
        _require_choice("model.attention", self.attention, ATTENTION_ROUTES)
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            _require_positive(f"model.{name}", getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} must be divisible by model.num_heads")


@dataclass
class TokenizerConfig:
    """``name_or_path=None``: the built-in byte-level tokenizer (ids 0..255); else a local HF tokenizer dir."""

    name_or_path: str | None = None


@dataclass
class DataConfig:
    """Documents, their packing into rows of ``seq_len`` tokens, and the synthetic corpus' shape.

    Attributes:
        source: ``synthetic`` (built in, seeded), ``text`` (alias ``jsonl``: ``{text_field: ...}`` rows),
            ``chat`` (``{messages_field: [{"role", "content"}, ...]}`` rendered with the tokenizer's chat
            template) or ``instruction`` (``{prompt_field, completion_field}``); see ``datasets/formats.py``.
        path: The data: a json/jsonl/parquet/arrow file, a directory of them or a glob pattern.
        split: For a directory: the split whose files to read (``train``, ``validation``, ``test`` by file
            name); ``None``: the ``train`` files, or all files when none is named after a split.
        validation: Held-out data: a path in the training data's format, or a fraction in (0, 1) of the
            training documents held out (seeded); ``None``: no validation.
        text_field / messages_field / prompt_field / completion_field: Field names of the formats.
        loss_on: ``answer`` (assistant turns / completions only), ``all`` tokens, or ``auto`` (answer for
            chat and instruction data, all for text).
        add_eos: End every document with the tokenizer's EOS (never twice).
        long_conversations: A chat/instruction row longer than ``seq_len``: ``leading_turns`` keeps the
            turns up to the last whole assistant turn that fits (none fits: dropped), ``drop``, or ``error``.
        max_record_bytes: The largest record read, in bytes: a JSON Lines line (without its newline), or a
            parquet/arrow/JSON-array row's data (its strings and numbers). JSON Lines are measured while the
            file is read in chunks, before any parsing, so a huge line never becomes Python objects. Default
            4 MiB (about 1M tokens, more than a row holds): a Hugging Face tokenizer takes ~190 bytes of memory
            per byte of the record it encodes (measured: ``benchmarks/data_prep.py --record-mib``), so one record
            at the limit costs ~0.75 GiB on rank 0 (16 MiB would cost ~3 GiB).
        long_records: A record larger than ``max_record_bytes``: ``drop`` it (counted in the ``data:`` log
            line) or ``error`` (names the file and the 1-based line or row).
        empty_answers: A chat assistant turn with an empty answer (blank content, no ``tool_calls``), which
            would teach the model to end its turn at once: ``warn`` (counted in the ``data:`` log line, with a
            warning) or ``error`` (names the file, the 1-based row and the message).
        cache_dir: Where tokenized, packed data is cached (``None``: ``~/.cache/nemo_automodel/data``);
            must be visible to every rank (rank 0 builds, the others read).
        seq_len: Tokens per packed row (padded to a multiple of ``2 * cp.size`` for CP).
        packing_algorithm: ``first_fit_decreasing`` or ``first_fit_shuffle`` (NeMo's packers).
        long_documents: ``split`` a document longer than ``seq_len`` into ``seq_len`` chunks
            (each trained as its own document), or ``truncate`` it to its first ``seq_len`` tokens.
        num_documents: Synthetic corpus size.
        min_doc_len / max_doc_len: Synthetic document lengths (long-tailed between the two).
        seed: Seed of the corpus, the packer's shuffle and the per-epoch row order.
    """

    source: str = "synthetic"
    path: str | None = None
    split: str | None = None
    validation: str | None = None
    text_field: str = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    loss_on: str = "auto"
    add_eos: bool = True
    long_conversations: str = "leading_turns"
    max_record_bytes: int = 4 * 1024 * 1024
    long_records: str = "drop"
    empty_answers: str = "warn"
    cache_dir: str | None = None
    seq_len: int = 512
    packing_algorithm: str = "first_fit_shuffle"
    long_documents: str = "split"
    num_documents: int = 4000
    min_doc_len: int = 4
    max_doc_len: int = 700
    seed: int = 1234

    def __post_init__(self) -> None:
        self.source = DATA_SOURCE_ALIASES.get(self.source, self.source)
        _require_choice("data.source", self.source, DATA_SOURCES)
        _require_choice("data.packing_algorithm", self.packing_algorithm, PACKING_ALGORITHMS)
        _require_choice("data.long_documents", self.long_documents, LONG_DOCUMENT_MODES)
        _require_choice("data.long_conversations", self.long_conversations, LONG_CONVERSATION_MODES)
        _require_choice("data.loss_on", self.loss_on, LOSS_ON)
        _require_choice("data.long_records", self.long_records, LONG_RECORD_MODES)
        _require_choice("data.empty_answers", self.empty_answers, EMPTY_ANSWER_MODES)
        _require_positive("data.max_record_bytes", self.max_record_bytes)
        if self.loss_on == "answer" and self.source not in ("chat", "instruction"):
            raise ValueError(
                f"data.loss_on=answer needs data=chat or data=instruction (data.source={self.source} has no answers)"
            )
        fraction = self.validation_fraction
        if fraction is not None and not 0.0 < fraction < 1.0:
            raise ValueError(
                f"data.validation={self.validation} must be a fraction in (0, 1) of the training documents "
                "(e.g. data.validation=0.05) or a path"
            )
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len={self.seq_len} cannot hold a single (input, label) pair; use >= 2")
        _require_positive("data.num_documents", self.num_documents)
        if not 1 <= self.min_doc_len <= self.max_doc_len:
            raise ValueError(
                f"data.min_doc_len={self.min_doc_len} / data.max_doc_len={self.max_doc_len}: need 1 <= min <= max"
            )

    @property
    def validation_fraction(self) -> float | None:
        """``data.validation`` as a held-out fraction (``None``: unset or a path)."""
        try:
            return None if self.validation is None else float(self.validation)
        except ValueError:
            return None


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``.

    ``decay_steps=None`` decays over ``trainer.max_steps``; set it to keep the
    schedule fixed when a run is extended or stopped early.
    """

    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 20
    decay_steps: int | None = None
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _require_positive("optim.lr", self.lr)
        _require_positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        _require_positive("optim.grad_clip", self.grad_clip, allow_zero=True)
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas={self.betas} must be two numbers, e.g. optim.betas=[0.9,0.95]")
        if self.decay_steps is not None:
            _require_positive("optim.decay_steps", self.decay_steps)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")


@dataclass
class TrainerConfig:
    """The loop, checkpoints and logging.

    Attributes:
        max_steps: Optimizer steps to train in total (a resumed run continues to it).
        grad_accum: Micro-batches (packed rows per dp rank) per optimizer step; the global
            batch is ``dp * grad_accum`` rows whatever ``cp.size`` is.
        seed: Model init, dropout and every other RNG (same seed -> identical loss trace on CPU).
        activation_checkpointing: Recompute layer activations in backward.
        bf16: bf16 autocast (CUDA only; CPU always trains in fp32).
        log_every: Console log period in steps (``metrics.jsonl`` gets every step).
        ckpt_every: Checkpoint period in steps (``0``: only at the end and on preemption).
        keep_checkpoints: Complete checkpoints to keep (older ones are deleted after a new one lands).
        resume: ``auto`` continues from the latest complete checkpoint in the run dir; ``never`` starts fresh.
        export_hf: Export a HF ``save_pretrained`` (safetensors) directory at the end.
        on_nonfinite: A step with NaN/Inf in CP attention inputs, the loss or the gradient norm on any
            rank: ``stop`` raises on every rank naming the step, the ranks and what was non-finite;
            ``skip`` logs the same, zeroes the gradients and skips the optimizer step (the LR schedule advances).
        val_every: Validation period in steps (``0``: only after the last step); needs ``data.validation``.
        keep_best: Keep the checkpoint with the lowest validation loss in ``best/`` (needs ``data.validation``).
        export_dtype: dtype of the HF export: ``auto`` (the pretrained model's own dtype; float32 for a
            model built from config), ``float32``, ``bfloat16`` or ``float16``.
    """

    max_steps: int = 200
    grad_accum: int = 2
    seed: int = 42
    activation_checkpointing: bool = False
    bf16: bool = True
    log_every: int = 10
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    resume: str = "auto"
    export_hf: bool = True
    on_nonfinite: str = "stop"
    val_every: int = 0
    keep_best: bool = False
    export_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require_positive("trainer.max_steps", self.max_steps)
        _require_positive("trainer.grad_accum", self.grad_accum)
        _require_positive("trainer.log_every", self.log_every)
        _require_positive("trainer.ckpt_every", self.ckpt_every, allow_zero=True)
        _require_positive("trainer.keep_checkpoints", self.keep_checkpoints)
        _require_choice("trainer.resume", self.resume, RESUME_MODES)
        _require_choice("trainer.on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
        _require_positive("trainer.val_every", self.val_every, allow_zero=True)
        _require_choice("trainer.export_dtype", self.export_dtype, EXPORT_DTYPES)


def _cp_post_init(self: Any) -> None:
    """Validate the ``cp`` node through :class:`CPOptions` and store every value canonical."""
    _require_positive("cp.size", self.size)
    try:
        options = self.options()
    except ValueError as exc:
        raise ValueError(f"cp: {exc}") from None
    for name, _, _ in config_node_fields():
        setattr(self, name, getattr(options, name))


def _cp_options(self: Any, attn_shape: Shape | None = None) -> CPOptions:
    """The node as the core's frozen :class:`CPOptions` (``attn_shape``: the model's, for ``layout=auto``)."""
    return CPOptions(**{name: getattr(self, name) for name, _, _ in config_node_fields()}, attn_shape=attn_shape)


# The Hydra ``cp`` node (``+cp=blockdiag`` selects ``conf/cp/blockdiag.yaml``): ``size`` (CP ranks per packed
# row; 1: no CP, attention still block-diagonal) plus every config field of CPOptions, the one definition of
# the CP settings, their types and defaults (generated: OmegaConf cannot read CPOptions' Literal types).
CPConfig = make_dataclass(
    "CPConfig",
    [("size", int, field(default=1)), *config_node_fields()],
    namespace={
        "__post_init__": _cp_post_init,
        "options": _cp_options,
        "__doc__": "Block-diagonal CP: ``size`` plus the fields of :class:`CPOptions` (documented there).",
    },
)


@dataclass
class DistConfig:
    """Process groups and the local launcher.

    Attributes:
        dp_size: Data-parallel ranks. ``None``: 1 for a local launch, ``world / cp.size`` under torchrun/Slurm.
        pg_timeout_s: Collective timeout: a dead or stuck peer raises after it instead of hanging.
        master_port: Rendezvous port for local and Slurm launches (``None``: a free port / 29500).
        shutdown_timeout_s: After SIGTERM/SIGUSR1, how long the local launcher waits for workers to
            finish their step and checkpoint before killing them.
        threads: Intra-op CPU threads per worker (``torch.set_num_threads``). ``None``: ``OMP_NUM_THREADS``
            when set, else on CPU each worker's share of the cores (``cpu_count // local workers``), on CUDA
            torch's default. The choice and its reason are logged.
        cpu_malloc_threshold_kib: CPU workers: glibc's mmap and trim thresholds in KiB, fixed once at start-up
            (blocks of at least this size are mapped and unmapped on free; a free heap top of this size is
            returned). It keeps peak RSS near the live tensors: with glibc's dynamic thresholds freed tensors stay
            resident. Lower: less resident memory, more page faults. ``None``: glibc's dynamic thresholds.
            ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES`` in the environment win.
            What was set is logged (docs/performance.md).
    """

    dp_size: int | None = None
    pg_timeout_s: float = 300.0
    master_port: int | None = None
    shutdown_timeout_s: int = 300
    threads: int | None = None
    cpu_malloc_threshold_kib: int | None = 128

    def __post_init__(self) -> None:
        if self.dp_size is not None:
            _require_positive("dist.dp_size", self.dp_size)
        _require_positive("dist.pg_timeout_s", self.pg_timeout_s)
        _require_positive("dist.shutdown_timeout_s", self.shutdown_timeout_s)
        if self.threads is not None:
            _require_positive("dist.threads", self.threads)
        if self.cpu_malloc_threshold_kib is not None and not 1 <= self.cpu_malloc_threshold_kib <= MAX_THRESHOLD_KIB:
            raise ValueError(
                f"dist.cpu_malloc_threshold_kib={self.cpu_malloc_threshold_kib} must be in [1, {MAX_THRESHOLD_KIB}] "
                "(glibc's largest mmap threshold); use null for glibc's dynamic thresholds"
            )


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (``peft=lora`` selects ``conf/peft/lora.yaml``); see docs/lora.md.

    Attributes:
        method: ``none`` (full fine-tuning) or ``lora`` (frozen base, trained LoRA adapters).
        r: Adapter rank.
        alpha: LoRA scaling numerator: updates are scaled by ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).
        dropout: Dropout on the adapters' input (each CP rank draws masks for its own tokens, so
            ``dropout > 0`` does not reproduce ``cp = 1`` bitwise; ``0`` does).
        target_modules: Leaf names of the linear layers to adapt (e.g. ``[q_proj, v_proj]``); ``None``: every
            linear projection of attention and MLP in the decoder layers, resolved per model and logged.
        use_dora: Weight-decomposed LoRA (DoRA).
        use_rslora: Rank-stabilized scaling ``alpha / sqrt(r)``.
        adapter_path: A saved PEFT adapter directory to continue training (its r, alpha and targets must
            match this config).
        quantize: ``none`` or ``4bit`` (QLoRA: the frozen base in 4 bits; needs CUDA and bitsandbytes).
    """

    method: str = "none"
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | None = None
    use_dora: bool = False
    use_rslora: bool = False
    adapter_path: str | None = None
    quantize: str = "none"

    def __post_init__(self) -> None:
        _require_choice("peft.method", self.method, PEFT_METHODS)
        _require_choice("peft.quantize", self.quantize, QUANTIZE_MODES)
        _require_positive("peft.r", self.r)
        _require_positive("peft.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"peft.dropout={self.dropout} must be in [0, 1)")
        if self.target_modules is not None and not self.target_modules:
            raise ValueError("peft.target_modules=[] adapts nothing; list module names or use null for the default")
        if self.method == "none" and (self.adapter_path is not None or self.quantize != "none"):
            name = "peft.adapter_path" if self.adapter_path is not None else "peft.quantize"
            raise ValueError(f"{name} needs LoRA: add peft=lora to the command line")


@dataclass
class FinetuneConfig:
    """The whole recipe (``conf/finetune.yaml`` picks the groups; ``+cp=blockdiag`` adds ``cp``, ``peft=lora`` LoRA)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cp: CPConfig = field(default_factory=CPConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)

    def __post_init__(self) -> None:
        if self.model.pretrained_path is None and self.data.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_position_embeddings="
                f"{self.model.max_position_embeddings}; raise model.max_position_embeddings or lower data.seq_len"
            )
        if self.model.attention == "eager" and self.cp.size > 1:
            raise ValueError(
                f"model.attention=eager never reaches SDPA, so cp.size={self.cp.size} would silently attend "
                "only to local tokens; use model.attention=hf_interface (or patch_sdpa), or drop +cp"
            )
        if self.data.validation is None and (self.trainer.val_every or self.trainer.keep_best):
            name = "trainer.val_every" if self.trainer.val_every else "trainer.keep_best"
            raise ValueError(
                f"{name} needs validation data: set data.validation=<path> or a held-out fraction like 0.05"
            )
        if (
            self.data.source == "synthetic"
            and self.data.validation is not None
            and self.data.validation_fraction is None
        ):
            raise ValueError("data.validation with data=synthetic must be a fraction (e.g. 0.05), not a path")
        if self.data.seq_len < 2 * self.cp.size:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} is smaller than 2 * cp.size = {2 * self.cp.size}: every CP rank "
                f"needs at least two positions; raise data.seq_len or lower cp.size"
            )


# Files shipped with the package (the chat demo's corpus and tokenizer): `${nemo_asset:chat_demo/chats.jsonl}`.
ASSETS_ROOT = Path(__file__).resolve().parents[2] / "assets"


def bf16_autocast(bf16: bool, device: torch.device) -> bool:
    """Whether ``trainer.bf16`` turns autocast on for ``device`` (CUDA only; CPU trains in fp32)."""
    return bf16 and device.type == "cuda"


def register_schema() -> None:
    """Store :class:`FinetuneConfig` as ``finetune_schema`` (the first entry of ``conf/finetune.yaml``'s defaults).

    Also registers the ``nemo_asset`` resolver: ``${nemo_asset:<name>}`` is the absolute path of a file the
    package ships (``nemo_automodel/assets/<name>``), whatever the working directory.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="finetune_schema", node=FinetuneConfig)
    if not OmegaConf.has_resolver("nemo_asset"):
        OmegaConf.register_new_resolver("nemo_asset", lambda name: str(ASSETS_ROOT / name))


def to_finetune_config(cfg: DictConfig | dict[str, Any]) -> FinetuneConfig:
    """Typed, validated config from a composed ``DictConfig`` or a plain dict (what workers receive).

    Raises:
        ValueError: naming the bad field and the fix (unknown keys, bad choices, bad ranges).
    """
    merged = OmegaConf.merge(OmegaConf.structured(FinetuneConfig), cfg)
    # A key added with Hydra's `+` (e.g. `+trainer.max_step=5`, Hydra's own hint for a typo) passes
    # composition and the merge above, since the section it lands in is typed; refuse it like a typo.
    reject_unknown_keys(OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg)
    return OmegaConf.to_object(merged)


def reject_unknown_keys(values: Any, schema: type = FinetuneConfig, prefix: str = "") -> None:
    """Raise a ``ValueError`` naming the first key of ``values`` that ``schema`` (a dataclass) lacks."""
    if not isinstance(values, dict):
        return
    known = sorted(f.name for f in fields(schema))
    for key, value in values.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            where = f"of {prefix.rstrip('.')}" if prefix else "at the top level"
            raise ValueError(f"{prefix}{key}: unknown key{hint}; valid keys {where}: {', '.join(known)}")
        if not prefix and is_dataclass(_SECTIONS.get(key)):
            reject_unknown_keys(value, _SECTIONS[key], f"{key}.")


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "tokenizer": TokenizerConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "trainer": TrainerConfig,
    "cp": CPConfig,
    "dist": DistConfig,
    "peft": PeftConfig,
}


def to_plain_dict(cfg: FinetuneConfig) -> dict[str, Any]:
    """The config as plain Python containers (for workers, checkpoints and the run dir)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)

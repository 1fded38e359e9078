"""Refuse, at model load and by name, what block-diagonal packing cannot compute exactly.

Packing puts several documents in one row; block-diagonal CP makes *attention* blind to
the other documents. Anything else that mixes tokens along the sequence sees them:

- state-space / linear-recurrence layers (Mamba, Mamba2, gated DeltaNet, RG-LRU,
  lightning attention) carry their state from one document into the next, and under CP
  restart it at every shard edge;
- short convolutions along the sequence (LFM2, the convs inside Mamba blocks) reach
  the last tokens of the previous document (under CP: of the previous rank's shard);
- attention modules that bypass transformers' attention interface (Bloom, MPT, Falcon:
  their own ALiBi code) never reach the CP function, so their documents see each other;
- chunked local attention (Llama 4's ``attention_chunk_size``) is expressed only in the
  mask transformers builds, over the row index: only ``model.attention=hf_interface``
  passes it to CP (per document, exactly); other routes would attend across chunk (or,
  in one row, document) boundaries on rows longer than a chunk;
- Llama 4's attention temperature on NoPE layers is computed from the *row* index
  (``arange`` over the packed row), not the document position.

Detection is structural (module types, parameters, config fields), not a list of model
names, so that new architectures are caught too; the start-up probe
(:mod:`nemo_automodel.components.models.packing_probe`) catches what escapes it.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

BlockerKind = Literal[
    "layer type",
    "state-space",
    "convolution",
    "recurrence",
    "alibi",
    "bypasses attention interface",
    "chunked attention",
    "row-position scaling",
]

# Layer types whose mixing is attention through transformers' interface (what CP computes exactly).
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "global", "local"})
# Config fields older hybrid configs use instead of ``layer_types``.
_LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type", "block_types")
# Parameters that only state-space / linear-recurrence mixers own (Mamba's A and dt, DeltaNet's decay).
_SSM_PARAMETERS = frozenset({"A_log", "dt_bias"})
# What a forward that reaches transformers' attention interface names in its source.
_INTERFACE_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface")
# A fallback for mixers with neither SSM parameters nor a torch conv/RNN module (matched on class names).
_MIXER_NAMES = re.compile(r"Mamba|SSM|DeltaNet|LinearAttention|LightningAttention|RGLRU|Rwkv|xLSTM|ShortConv")
_ATTENTION_CLASS = re.compile(r"(Attention|Attn)$")

_WHY = {
    "layer type": "its layers of this type mix tokens outside attention",
    "state-space": "its recurrent state runs from one packed document into the next, and under CP restarts at "
    "each rank's shard edge",
    "convolution": "its kernel along the sequence reaches the last tokens of the previous packed document (under "
    "CP: of the previous rank's shard)",
    "recurrence": "its hidden state runs from one packed document into the next",
    "alibi": "the model adds ALiBi biases and its own mask in its own attention code, which never calls the CP "
    "attention: packed documents attend each other",
    "bypasses attention interface": "it computes attention itself instead of calling transformers' attention "
    "interface, so block-diagonal CP never sees it and packed documents attend each other",
    "chunked attention": "transformers expresses the chunks only in a mask over the row index, which this "
    "attention route does not turn into per-document chunks: a row longer than a chunk would attend across "
    "chunk boundaries",
    "row-position scaling": "the query scale is computed from the row index (arange over the packed row), not "
    "each document's position",
}


@dataclass(frozen=True)
class PackingBlocker:
    """One thing in a model that packing cannot compute exactly.

    Attributes:
        kind: What sort of mixing it is.
        where: The layer type / module class and where it sits, e.g. ``"Qwen3NextGatedDeltaNet (model.layers.0
            .linear_attn, 1 module)"``.
        fix: A way to make it exact, if there is one short of another model (``""``: none).
    """

    kind: BlockerKind
    where: str
    fix: str = ""

    def describe(self) -> str:
        """``"<where>: <why>"`` plus the fix, for the refusal message."""
        fix = f" ({self.fix})" if self.fix else ""
        return f"{self.kind} {self.where}: {_WHY[self.kind]}{fix}"


class PackingUnsupportedError(ValueError):
    """The model mixes tokens in a way packed (block-diagonal) training cannot compute exactly."""


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _layers(indices: list[int]) -> str:
    return ", ".join(map(str, indices)) if len(indices) <= 8 else f"{indices[0]}..{indices[-1]} ({len(indices)})"


def _layer_type_blockers(config: Any) -> list[PackingBlocker]:
    """Layer types that are not attention (``"mamba"``, ``"linear_attention"``, ``"conv"``, ``"hybrid"``...)."""
    for field in _LAYER_TYPE_FIELDS:
        types = getattr(config, field, None)
        if isinstance(types, (list, tuple)) and types and all(isinstance(t, str) for t in types):
            found: dict[str, list[int]] = {}
            for i, kind in enumerate(types):
                if kind not in _ATTENTION_LAYER_TYPES and kind != "chunked_attention":
                    found.setdefault(kind, []).append(i)
            return [PackingBlocker("layer type", f"{field}={t!r} (layers {_layers(ls)})") for t, ls in found.items()]
    return []


def _alibi_flags(config: Any) -> dict[str, bool]:
    """The ALiBi switches a config has (Falcon ``alibi``, MPT ``attn_config.alibi``, ``use_alibi``), by name."""
    attn_config = getattr(config, "attn_config", None)
    nested = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", None)
    flags = {
        "alibi": getattr(config, "alibi", None),
        "attn_config.alibi": nested,
        "use_alibi": getattr(config, "use_alibi", None),
    }
    if getattr(config, "position_embedding_type", None) is not None:
        flags["position_embedding_type"] = config.position_embedding_type == "alibi"
    return {name: on for name, on in flags.items() if isinstance(on, bool)}


def _alibi_blockers(config: Any) -> list[PackingBlocker]:
    """ALiBi switched on in the config."""
    return [PackingBlocker("alibi", f"(config {name}=True)") for name, on in _alibi_flags(config).items() if on]


def _chunk_blockers(config: Any, route: str, seq_len: int | None) -> list[PackingBlocker]:
    """Chunked attention off ``hf_interface`` and Llama 4's NoPE temperature: exact only on rows they do not bite.

    ``hf_interface`` hands chunked layers to CP as per-document chunks (``cp_attention.attention_chunk``).
    """
    out = []
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None and route != "hf_interface" and (seq_len is None or seq_len > chunk):
        types = getattr(config, "layer_types", None) or []
        chunked = [i for i, t in enumerate(types) if t == "chunked_attention"] if types else None
        where = f"(attention_chunk_size={chunk}, layers {_layers(chunked)})" if chunked else f"({chunk}, every layer)"
        if chunked != []:
            fix = f"exact with model.attention=hf_interface, or with data.seq_len <= {chunk}"
            out.append(PackingBlocker("chunked attention", where, fix))
    no_rope = getattr(config, "no_rope_layers", None)
    floor_scale = getattr(config, "floor_scale", None)
    if getattr(config, "attn_temperature_tuning", False) and no_rope and floor_scale:
        nope = [i for i, use_rope in enumerate(no_rope) if not use_rope]
        # the scale is log1p(floor((row_index + 1) / floor_scale)) * attn_scale + 1: exactly 1 below floor_scale - 1
        if nope and (seq_len is None or seq_len >= floor_scale):
            out.append(
                PackingBlocker(
                    "row-position scaling",
                    f"(attn_temperature_tuning on NoPE layers {_layers(nope)}, floor_scale={floor_scale})",
                    f"exact with data.seq_len < {floor_scale}",
                )
            )
    return out


def _bypasses_interface(module: torch.nn.Module) -> bool:
    """An attention-named module whose forward never reaches transformers' attention interface.

    Wrappers whose child is itself an attention module (the child does the work) are not flagged.
    """
    if not _ATTENTION_CLASS.search(type(module).__name__):
        return False
    if any(_ATTENTION_CLASS.search(type(child).__name__) for child in module.children()):
        return False
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):  # no source (compiled, dynamic): say nothing, the probe decides
        return False
    return not any(marker in source for marker in _INTERFACE_MARKERS)


def _module_kind(module: torch.nn.Module, route: str, alibi_off: bool) -> BlockerKind | None:
    """What sort of sequence mixing ``module`` itself does outside the attention interface, if any."""
    if isinstance(module, torch.nn.Conv1d):  # along the sequence (a vision tower's Conv2d mixes pixels, not tokens)
        return "convolution"
    if isinstance(module, torch.nn.RNNBase):
        return "recurrence"
    own = {name for name, _ in module.named_parameters(recurse=False)}
    # the name fallback only for modules owning parameters (not the decoder layers around them)
    if own & _SSM_PARAMETERS or (own and _MIXER_NAMES.search(type(module).__name__)):
        return "state-space"
    if route != "eager" and _bypasses_interface(module):
        forward = inspect.signature(type(module).forward).parameters
        takes_alibi = "alibi" in forward or "position_bias" in forward
        return "alibi" if takes_alibi and not alibi_off else "bypasses attention interface"
    return None


def _text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder (``get_decoder()``) of a multimodal model; the whole model when it has none."""
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        decoder = None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def _module_blockers(model: torch.nn.Module, config: Any, route: str) -> list[PackingBlocker]:
    """Modules that mix along the sequence outside attention, grouped by class (first place and count)."""
    flags = _alibi_flags(config)
    alibi_off = bool(flags) and not any(flags.values())  # Falcon with alibi=False: its own attention, no ALiBi
    found: dict[tuple[BlockerKind, str], list[str]] = {}
    text = {id(m) for m in _text_decoder(model).modules()}
    for name, module in model.named_modules():
        if id(module) not in text:  # a vision/audio tower mixes its own inputs, not the packed text row
            continue
        kind = _module_kind(module, route, alibi_off)
        if kind is not None:
            found.setdefault((kind, type(module).__name__), []).append(name)
    return [
        PackingBlocker(kind, f"{cls} ({names[0]}, {len(names)} module{'s' * (len(names) > 1)})")
        for (kind, cls), names in found.items()
    ]


def packing_blockers(
    model: torch.nn.Module, route: str = "hf_interface", seq_len: int | None = None
) -> list[PackingBlocker]:
    """Everything in ``model`` that packed block-diagonal training would compute wrong (empty: none found).

    Args:
        model: A transformers causal LM (any ``nn.Module`` with a ``config``).
        route: How attention reaches CP (``model.attention``); ``eager`` skips the interface-bypass check.
        seq_len: The packed row length; chunked attention (off ``hf_interface``) and Llama 4's temperature are
            exact on rows no longer than they bite (``None``: assume they bite).
    """
    config = _text_config(getattr(model, "config", None))
    blockers = _layer_type_blockers(config) + _alibi_blockers(config) + _chunk_blockers(config, route, seq_len)
    return blockers + _module_blockers(model, config, route)


def model_name(model: torch.nn.Module) -> str:
    """The model's class as a user knows it (``config.architectures[0]``, else the Python class)."""
    architectures = getattr(getattr(model, "config", None), "architectures", None)
    return architectures[0] if architectures else type(model).__name__


def skeleton(config: Any) -> torch.nn.Module:
    """The causal LM of ``config`` on the meta device (no memory, no weights), with its own eager attention.

    What :func:`check_packable_config` inspects before a checkpoint is loaded: some models (Falcon) crash inside
    transformers when asked for an attention implementation they do not dispatch through the interface.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def check_packable_config(config: Any, route: str = "hf_interface", seq_len: int | None = None) -> None:
    """:func:`check_packable` on the model ``config`` describes, before any weight is loaded.

    Raises:
        PackingUnsupportedError: as :func:`check_packable`.
    """
    check_packable(skeleton(config), route, seq_len)


def check_packable(model: torch.nn.Module, route: str = "hf_interface", seq_len: int | None = None) -> None:
    """Refuse a model whose token mixing packed block-diagonal training cannot compute exactly.

    Raises:
        PackingUnsupportedError: naming the model class, every layer type / module class found and why
            packing breaks it, and the options.
    """
    blockers = packing_blockers(model, route, seq_len)
    if not blockers:
        return
    lines = "\n".join(f"  - {b.describe()}" for b in blockers)
    raise PackingUnsupportedError(
        f"{model_name(model)} cannot be trained exactly on packed rows (block-diagonal attention, any cp):\n"
        f"{lines}\n"
        "Options: a model whose only token mixing is attention through transformers' attention interface; "
        "the fix named above where there is one; or model.verify_packing=false to train anyway, knowing that "
        "packed documents will leak into each other"
    )

"""The one definition of the block-diagonal CP settings: :class:`CPOptions`.

Every form of the settings derives from this class: the recipe's Hydra ``cp`` node
(:func:`config_node_fields`), the batch builder's ``options=`` and the seed API's
keyword knobs (parsed by the ``normalize_*`` functions below). Each value has its
canonical name and at most one older spelling from upstream (the seed API); any
other former synonym raises an error naming the canonical value.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from nemo_automodel.components.distributed.blockdiag_cp.cost import Shape

AttnBackend = Literal["auto", "fa3", "flash", "te", "torch_varlen", "sdpa_varlen", "dense"]
KVExchange = Literal["auto", "allgather", "halo", "a2a", "ulysses", "ulysses+halo", "ulysses+a2a", "ulysses+allgather"]
# The heads x sequence hybrids (:mod:`.hybrid`) and the exchange of their sequence part.
# Each heads x sequence hybrid and its sequence part (read-only: the core reads it on the step path).
SEQUENCE_PART: Mapping[str, str] = MappingProxyType(
    {"ulysses+halo": "halo", "ulysses+a2a": "a2a", "ulysses+allgather": "allgather"}
)
Layout = Literal["auto", "contiguous", "balanced"]
Consensus = Literal["step", "call"]

# Canonical value <- upstream's (the seed API's) spelling, the only other spelling accepted.
UPSTREAM_SPELLINGS: dict[str, dict[str, str]] = {
    "attn_backend": {
        "flash_attn_3": "fa3",
        "flash_attn": "flash",
        "transformer_engine": "te",
        "varlen_attn": "torch_varlen",
    },
    "kv_exchange": {"all_gather": "allgather", "needed_only": "halo", "all_to_all": "a2a"},
    "layout": {"zigzag": "balanced"},
    "consensus": {},
}
# Spellings accepted before the settings had one definition; now an error naming the canonical value.
RETIRED_SPELLINGS: dict[str, dict[str, str]] = {
    "attn_backend": {
        **dict.fromkeys(("flash_attention_3", "flash3", "flashattention3", "flash_attn3", "fa_3"), "fa3"),
        **dict.fromkeys(("flash_attention", "flash_attention_2", "fa", "fa2", "flash_varlen"), "flash"),
        **dict.fromkeys(("transformerengine", "te_thd"), "te"),
        **dict.fromkeys(("torch_varlen_attn", "native_varlen", "nn_varlen"), "torch_varlen"),
        **dict.fromkeys(("varlen", "cpu_varlen", "per_doc", "sdpa_per_doc"), "sdpa_varlen"),
        **dict.fromkeys(("sdpa", "torch_sdpa", "masked_sdpa"), "dense"),
    },
    "kv_exchange": {
        "cost_model": "auto",
        "ag": "allgather",
        **dict.fromkeys(("neighbor", "neighbour", "needed", "p2p"), "halo"),
        **dict.fromkeys(("a2av", "alltoall", "all_to_all_v", "needed_a2a"), "a2a"),
    },
    "layout": {
        "cost_model": "auto",
        **dict.fromkeys(("contig", "sequential", "chunked"), "contiguous"),
        **dict.fromkeys(("zig_zag", "load_balanced"), "balanced"),
    },
    "consensus": {"per_step": "step", "deferred": "step", "per_call": "call", "debug": "call"},
}
_DEFAULT_SPELLINGS = ("", "default", "none")


def _allow_cross_node_from_env() -> bool:
    """``NEMO_CP_ALLOW_XNODE=1``: read once, when a :class:`CPOptions` is built (never on the step path)."""
    return os.environ.get("NEMO_CP_ALLOW_XNODE") == "1"


@dataclass(frozen=True)
class CPOptions:
    """Every block-diagonal CP setting of a packed row, validated and canonical.

    The only definition of the settings: the recipe's ``cp`` config node is generated
    from its fields (:func:`config_node_fields`), and the batch builder snapshots one into
    each row's state, which is all the runtime reads. Frozen, so a row's settings cannot
    change under it. Values are parsed once, here.

    Attributes:
        attn_backend: The kernel: ``auto`` (the first of fa3 > flash > te > torch_varlen >
            sdpa_varlen that can run the call) or a kernel name; an explicit kernel that cannot
            run raises, it is never replaced.
        kv_exchange: How keys reach other ranks: ``halo`` (needed-only from the left neighbour,
            upgraded to ``a2a`` when some rank needs keys from further left), ``a2a``
            (needed-only all-to-all-v), ``allgather``, ``ulysses`` (head-parallel: an all-to-all
            gives each rank the whole row for a subset of heads, a second one returns the output;
            TransformerEngine calls this ``a2a``), ``ulysses+halo`` / ``ulysses+a2a`` / ``ulysses+allgather``
            (the heads x sequence hybrid: ``ulysses`` inside groups of ``head_parallel`` consecutive ranks,
            that exchange between the groups; TransformerEngine's ``a2a+p2p``) or ``auto`` (the cost model
            picks per row).
        layout: How tokens are placed on ranks: ``contiguous`` (rank ``r`` holds rows
            ``[r L, (r+1) L)``), ``balanced`` (documents reordered, a few cut zig-zag, so every
            rank does the same attention work) or ``auto`` (the cost model picks per row).
        overlap: Attend local-key documents while the K/V exchange is in flight.
        check_finite: Record, without a host sync, whether each call's q/k/v are finite (read once
            per step with ``nonfinite_attention_inputs``). Off by default: it reads q, k and v once
            more per call (three fp32 reductions). A non-finite loss is reported either way; turn it on
            to name the first CP attention call whose inputs were not finite.
        consensus: ``step`` (kernel failures settled once per step) or ``call`` (after every call and
            direction: names the failing call at once; for debugging).
        allow_cross_node: Keep needed-only exchanges when the CP group spans nodes (default: read from
            ``NEMO_CP_ALLOW_XNODE=1`` when the options are built); otherwise such a group uses all-gather.
        head_parallel: Head-parallel degree ``h`` of the ``ulysses+*`` hybrids: the CP group factors into
            groups of ``h`` consecutive ranks that swap heads, times ``cp / h`` ranks that exchange sequence.
            ``1 < h < cp`` and ``cp % h == 0``, checked when the row is built. ``None``: the ranks of one node
            when the CP group spans nodes, else the largest proper divisor of ``cp``. Set only with a hybrid.
        attn_shape: The model's attention shape for ``layout=auto``'s cost model (``None``: a generic
            8 x 128 bf16 shape). Set by the caller from its model, not a config value.
    """

    attn_backend: AttnBackend = "auto"
    kv_exchange: KVExchange = "halo"
    layout: Layout = "contiguous"
    overlap: bool = True
    check_finite: bool = False
    consensus: Consensus = "step"
    allow_cross_node: bool = field(default_factory=_allow_cross_node_from_env)
    head_parallel: int | None = None
    attn_shape: Shape | None = field(default=None, metadata={"config": False})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in UPSTREAM_SPELLINGS:
                object.__setattr__(self, f.name, normalize(f.name, value))
            elif f.type in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"{f.name}: expected True or False, got {value!r}")
        self._check_head_parallel()
        if self.attn_shape is not None and not isinstance(self.attn_shape, Shape):
            raise ValueError(
                f"attn_shape: expected blockdiag_cp.cost.Shape(heads, kv_heads, head_dim, elem_bytes) or None, "
                f"got {type(self.attn_shape).__name__}"
            )

    def _check_head_parallel(self) -> None:
        """``head_parallel``: an int of at least 2, and only with a hybrid ``kv_exchange`` (never silently ignored)."""
        value = self.head_parallel
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(f"head_parallel: expected an integer >= 2 (or None), got {value!r}")
        if self.kv_exchange not in SEQUENCE_PART:
            raise ValueError(
                f"head_parallel={value} applies to the heads x sequence hybrids only, but kv_exchange="
                f"{self.kv_exchange!r}: set kv_exchange to one of {', '.join(SEQUENCE_PART)}, or drop head_parallel"
            )

    def replace(self, **changes: Any) -> CPOptions:
        """A copy with ``changes`` applied (validated like a new object)."""
        return dataclasses.replace(self, **changes)


def choices(name: str) -> tuple[str, ...]:
    """The canonical values of the string setting ``name`` (from its ``Literal`` type)."""
    return typing.get_args(typing.get_type_hints(CPOptions)[name])


def default(name: str) -> Any:
    """The default of setting ``name`` (the class's single set of defaults)."""
    f = next(f for f in dataclasses.fields(CPOptions) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def normalize(name: str, value: Any) -> str:
    """Map a value of the string setting ``name`` onto its canonical spelling (``None``: the default).

    Raises:
        ValueError: naming the setting, the value and the canonical value to use (or every valid value).
    """
    if value is None:
        return default(name)
    cleaned = str(value).strip().lower().replace("-", "_")
    valid = choices(name)
    if cleaned in valid:
        return cleaned
    if cleaned in UPSTREAM_SPELLINGS[name]:
        return UPSTREAM_SPELLINGS[name][cleaned]
    if cleaned in RETIRED_SPELLINGS[name] or cleaned in _DEFAULT_SPELLINGS:
        canonical = RETIRED_SPELLINGS[name].get(cleaned, default(name))
        raise ValueError(f"{name}={value!r} is no longer accepted: write {name}={canonical!r}")
    upstream = ", ".join(f"{old} -> {new}" for old, new in UPSTREAM_SPELLINGS[name].items())
    raise ValueError(
        f"Unknown {name} {value!r}. Valid values: {', '.join(valid)}"
        + (f" (upstream spellings: {upstream})" if upstream else "")
    )


def normalize_attn_backend(value: Any) -> str:
    """Canonicalize an ``attn_backend`` value (see :func:`normalize`)."""
    return normalize("attn_backend", value)


def normalize_kv_exchange(value: Any) -> str:
    """Canonicalize a ``kv_exchange`` value (see :func:`normalize`)."""
    return normalize("kv_exchange", value)


def normalize_layout(value: Any) -> str:
    """Canonicalize a ``layout`` value (see :func:`normalize`)."""
    return normalize("layout", value)


def normalize_consensus(value: Any) -> str:
    """Canonicalize a ``consensus`` value (see :func:`normalize`)."""
    return normalize("consensus", value)


def config_node_fields() -> list[tuple[str, type, Any]]:
    """The config-settable fields of :class:`CPOptions` for an OmegaConf structured config node.

    ``(name, type, dataclasses.field)`` per field, for :func:`dataclasses.make_dataclass`.
    OmegaConf 2.3 rejects ``Literal`` annotations, so those fields are typed ``str`` in the
    node and validated when the node is turned into :class:`CPOptions`.
    """
    hints = typing.get_type_hints(CPOptions)
    out = []
    for f in dataclasses.fields(CPOptions):
        if not f.metadata.get("config", True):
            continue
        kind = str if typing.get_origin(hints[f.name]) is Literal else hints[f.name]
        spec = (
            field(default_factory=f.default_factory)
            if f.default_factory is not dataclasses.MISSING
            else field(default=f.default)
        )
        out.append((f.name, kind, spec))
    return out

"""GPU varlen kernels and what each library needs to run them correctly.

Four libraries attend one rank's packed segments in a single (or, for the
boundary guard, a few) varlen call(s). Each kernel takes local queries
``q [1, Hq, L, D]`` and packed keys/values ``k, v [1, Hkv, K, D]`` described by
a :class:`~.kernels.VarlenMeta`, and returns ``[1, Hq, L, D]`` with zero
padding rows. Every fact used here comes from the library's own source;
docs/design.md's *Kernels* section lists them with file and line.

``flash``         flash-attn 2 ``flash_attn_varlen_func`` (>= 2.1: ``causal=True`` is aligned
                  bottom-right; 2.0.x aligns top-left, silently wrong for a segment with earlier keys).
``fa3``           FlashAttention-3 (``flash_attn_interface``, built from flash-attention/hopper): Hopper only,
                  no dropout.
``te``            TransformerEngine ``DotProductAttention`` in THD format with
                  ``padding_causal_bottom_right`` and ``attention_type="cross"`` (see :func:`te`).
``torch_varlen``  ``torch.nn.attention.varlen.varlen_attn`` (torch's bundled flash-attn 2): no extra
                  package, no dropout.

Availability is decided without launching anything: the package is really
imported (once per process), then its version, the GPU's compute capability,
the head dimension and dropout are checked against the library's limits.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from nemo_automodel.components.distributed.blockdiag_cp.logs import log_once
from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant

if TYPE_CHECKING:
    from nemo_automodel.components.distributed.blockdiag_cp.kernels import VarlenMeta

logger = logging.getLogger(__name__)

FLASH_MIN = (2, 1)  # flash-attn 2.1 made causal=True bottom-right (README "Changes in v2.1")
FLASH_MIN_BLACKWELL = (2, 7, 3)  # TE's FlashAttentionUtils.version_required_blackwell
TE_MIN = (1, 9)  # the first TE with padding_causal_bottom_right (pytorch/constants.py)
TE_UNFUSED_THD = (2, 11)  # TE's unfused backend accepts THD from 2.11 (2.10: "Disabling ... qkv_format = thd")
CUDNN_TE_THD_BOTTOM_RIGHT = (9, 7, 0)  # nvte_get_fused_attn_backend: THD + bottom-right for any length
CUDNN_TE_BROKEN = frozenset({(9, 10, 0), (9, 10, 1)})  # "known bugs with SDPA F16"
MAX_HEAD_DIM = 256  # flash-attn 2, FA3 and torch's flash kernels

INSTALL_FLASH = "pip install 'flash-attn>=2.1' (the project's [flash] extra)"
INSTALL_FA3 = "build FlashAttention-3 from flash-attention/hopper (distribution flash_attn_3)"
INSTALL_TE = "pip install 'transformer-engine[pytorch]' (the project's [te] extra)"


# ---------------------------------------------------------------------------
# Facts about the installation and the device (cached: they cannot change in a process)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportProbe:
    """Outcome of really importing a module: the module, or why it cannot be used."""

    module: ModuleType | None
    problem: str | None


@functools.cache
def probe_import(name: str) -> ImportProbe:
    """Import ``name`` once per process.

    ``importlib.util.find_spec`` is not enough: a broken build (ABI mismatch, a
    missing CUDA library) is found and then fails at its first import, and an
    ``__init__`` may raise ``OSError`` or ``RuntimeError`` (TransformerEngine
    loading its shared objects). All of them mean "cannot run here".
    """
    try:
        return ImportProbe(importlib.import_module(name), None)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(f"{exc.name}.")):
            return ImportProbe(None, f"`{name}` is not installed")
        return ImportProbe(None, f"importing `{name}` failed: {type(exc).__name__}: {exc}")
    except (ImportError, OSError, RuntimeError) as exc:
        return ImportProbe(None, f"importing `{name}` failed: {type(exc).__name__}: {exc}")


def reset_caches() -> None:
    """Forget every cached import, device fact and TE module (tests that swap packages in and out)."""
    probe_import.cache_clear()
    _cuda_capability.cache_clear()
    _te_runtime_facts.cache_clear()
    _TE_MODULES.clear()


def release(version: str | None) -> tuple[int, ...]:
    """The numeric release of a version string (``"2.8.3.post1"`` -> ``(2, 8, 3)``; unparsable -> ``()``)."""
    match = re.match(r"\d+(\.\d+)*", str(version or ""))
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device; ``None`` for other devices (the stand-ins run on CPU)."""
    if device.type != "cuda":
        return None
    return _cuda_capability(torch.cuda.current_device() if device.index is None else device.index)


# ---------------------------------------------------------------------------
# What each library needs (pure functions of the facts, unit-tested without a GPU)
# ---------------------------------------------------------------------------


def flash_limits(head_dim: int | None, dropout_p: float) -> str | None:
    """flash-attn 2 pads the head dim to a multiple of 8 in Python, then checks ``<= 256`` (flash_api.cpp)."""
    del dropout_p  # dropout's one hardware limit is checked with the capability (flash_hardware_problem)
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        return f"flash supports head dims up to {MAX_HEAD_DIM}, got {head_dim}; use attn_backend='te' or 'sdpa_varlen'"
    return None


def flash_module_problem(module: ModuleType) -> str | None:
    """Why an importable ``flash_attn`` cannot serve (FA4-only namespace package, version < 2.1)."""
    if not hasattr(module, "flash_attn_varlen_func"):
        # pip install flash-attn-4 ships only the flash_attn.cute package: `flash_attn`
        # then imports as a namespace package without the FA2 functions.
        return (
            "the installed `flash_attn` has no flash_attn_varlen_func (FlashAttention-4 alone installs "
            f"flash_attn.cute as a namespace package); {INSTALL_FLASH}"
        )
    version = getattr(module, "__version__", None)
    if release(version) < FLASH_MIN:
        return (
            f"flash-attn {version} aligns causal masks top-left (bottom-right since 2.1), which is wrong "
            f"for a segment with earlier keys; {INSTALL_FLASH}"
        )
    return None


def flash_hardware_problem(
    version: tuple[int, ...], capability: tuple[int, int], head_dim: int | None, dropout_p: float
) -> str | None:
    """Device limits of flash-attn 2 (flash_api.cpp, flash_bwd_launch_template.h, TE's FlashAttentionUtils)."""
    if capability < (8, 0):
        return f"flash-attn 2 needs an Ampere or newer GPU (sm80+), this one is sm{capability[0]}{capability[1]}"
    if capability >= (10, 0) and version < FLASH_MIN_BLACKWELL:
        return f"flash-attn {_dotted(version)} predates Blackwell support (2.7.3); upgrade flash-attn"
    if head_dim is not None and head_dim > 192 and dropout_p > 0 and capability in ((8, 6), (8, 9)):
        # run_mha_bwd_hdim256: with < 144 KB shared memory (sm86/sm89) the dropout
        # variant launches no kernel at all, leaving the gradients unwritten.
        return (
            f"flash-attn's backward for head dims > 192 with dropout has no kernel on sm{capability[0]}"
            f"{capability[1]} (it needs sm80/sm90 shared memory); use dropout_p=0 or attn_backend='sdpa_varlen'"
        )
    return None


def fa3_limits(head_dim: int | None, dropout_p: float) -> str | None:
    """FA3's interface has no dropout; its C++ checks ``head_size % 8 == 0`` and ``<= 256`` without padding."""
    if dropout_p > 0:
        return "fa3 has no dropout (FlashAttention-3 has no dropout_p); use dropout_p=0 or attn_backend='flash'/'te'"
    if head_dim is not None and (head_dim % 8 or head_dim > MAX_HEAD_DIM):
        return f"fa3 needs a head dim that is a multiple of 8 and at most {MAX_HEAD_DIM}, got {head_dim}"
    return None


def fa3_hardware_problem(capability: tuple[int, int]) -> str | None:
    """FlashAttention-3 is built for Hopper (sm90a); other GPUs are served by flash or te."""
    if capability[0] != 9:
        return f"fa3 runs on Hopper GPUs (sm90: H100/H200), this one is sm{capability[0]}{capability[1]}"
    return None


def torch_varlen_limits(head_dim: int | None, dropout_p: float) -> str | None:
    """``varlen_attn`` hard-codes ``dropout_p=0.0``; its flash kernel takes head dims up to 256."""
    if dropout_p > 0:
        return "torch_varlen has no dropout (varlen_attn passes dropout_p=0.0); use dropout_p=0 or 'sdpa_varlen'"
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        return f"torch_varlen supports head dims up to {MAX_HEAD_DIM}, got {head_dim}; use attn_backend='sdpa_varlen'"
    return None


def te_backends(
    *,
    te_version: tuple[int, ...],
    te_uses_flash: bool,
    capability: tuple[int, int],
    cudnn: tuple[int, ...],
    env: Mapping[str, str],
) -> tuple[str, ...]:
    """TransformerEngine backends that accept our call: THD, ``padding_causal_bottom_right``, ``sq <= skv``.

    From TE's ``get_attention_backend`` (utils.py) and ``nvte_get_fused_attn_backend``
    (common/fused_attn/fused_attn.cpp). Dropout changes none of these: FlashAttention-2
    and the unfused backend implement it, and cuDNN >= 9.7 accepts bottom-right masks
    with dropout whenever ``sq <= skv`` (TE only disables FA3/FA4 for dropout).

    Returns:
        ``"flash"`` (flash-attn, as TE finds it), ``"fused"`` (cuDNN: THD needs sm90+,
        bottom-right at any length needs cuDNN 9.7, 9.10.0/9.10.1 are excluded),
        ``"unfused"`` (TE >= 2.11; it pads every segment to ``max_seqlen`` and
        materializes the scores), in that order; empty when TE has none.
    """
    backends = []
    if env.get("NVTE_FLASH_ATTN", "1") != "0" and te_uses_flash and capability >= (8, 0):
        backends.append("flash")
    if (
        env.get("NVTE_FUSED_ATTN", "1") != "0"
        and capability >= (9, 0)
        and cudnn >= CUDNN_TE_THD_BOTTOM_RIGHT
        and cudnn[:3] not in CUDNN_TE_BROKEN
    ):
        backends.append("fused")
    if env.get("NVTE_UNFUSED_ATTN", "1") != "0" and te_version >= TE_UNFUSED_THD:
        backends.append("unfused")
    return tuple(backends)


# ---------------------------------------------------------------------------
# Attention variants each kernel can express (window, soft-cap, sinks)
# ---------------------------------------------------------------------------
# Each ``*_variant_gaps`` function returns, per feature kind (``window``,
# ``softcap``, ``sinks``), why the kernel cannot compute it; a kind absent from
# the result is passed to the library. Everything else is refused by name: a
# varlen library that is not told about a feature silently computes plain
# causal attention. The facts (docs/design.md, *Kernels*):
# - every library's window is flash-attn's ``window_size=(left, right)``: row ``i``
#   of a segment with ``sq`` queries and ``sk`` keys sees keys
#   ``[i + sk - sq - left, i + sk - sq + right]``, so ``(W - 1, 0)`` is our window
#   aligned bottom-right, also for a straddling segment (``sk > sq``);
# - soft-capping is ``softcap * tanh(scale * s / softcap)`` in flash-attn 2 (>= 2.6) and FA3;
# - no library here takes the model's sinks as an input (TE's are its own parameter).

FLASH_WINDOW_MIN = (2, 3)  # flash_attn_varlen_func/flash_attn_func gained window_size in v2.3.0
FLASH_SOFTCAP_MIN = (2, 6)  # ... and softcap (forward and backward) in v2.6.0
TE_WINDOW_MIN = (2, 0)  # get_full_mask's per-sequence bottom-right window (TE #1281) and cuDNN SWA + THD (#1378)

_NO_SINKS = "{library} takes no attention-sink logits (no s_aux input)"


def variant_feature_kinds(variant: AttentionVariant) -> list[tuple[str, str]]:
    """``(kind, user-facing name)`` of each feature of ``variant``; kinds are ``window``, ``softcap``, ``sinks``."""
    kinds = [
        kind
        for kind, present in (
            ("window", variant.window is not None),
            ("softcap", variant.softcap is not None),
            ("sinks", variant.sinks is not None),
        )
        if present
    ]
    names = variant.features()  # same order: window, softcap, sinks
    assert len(names) == len(kinds), (names, kinds)
    return list(zip(kinds, names))


def variant_problem(kernel: str, variant: AttentionVariant, gaps: Mapping[str, str | None]) -> str | None:
    """Why ``kernel`` cannot compute ``variant``: its first feature with a gap, named with its source.

    Args:
        kernel: The kernel's ``attn_backend`` name.
        variant: The call's attention variant.
        gaps: Per feature kind, why the kernel cannot compute it (``None`` or absent: it can).
    """
    for kind, name in variant_feature_kinds(variant):
        why = gaps.get(kind)
        if why is not None:
            return (
                f"{variant.describe(name)} is not supported by attn_backend={kernel}: {why}; use attn_backend='auto' "
                "(it picks a kernel that computes it) or 'sdpa_varlen'"
            )
    return None


def flash_variant_gaps(version: tuple[int, ...]) -> dict[str, str]:
    """What flash-attn 2 ``version`` cannot compute: windows before 2.3, soft-caps before 2.6, sinks never."""
    gaps = {"sinks": _NO_SINKS.format(library="flash-attn 2")}
    if version < FLASH_WINDOW_MIN:
        gaps["window"] = f"flash-attn {_dotted(version)} has no window_size (>= {_dotted(FLASH_WINDOW_MIN)})"
    if version < FLASH_SOFTCAP_MIN:
        gaps["softcap"] = f"flash-attn {_dotted(version)} has no softcap (>= {_dotted(FLASH_SOFTCAP_MIN)})"
    return gaps


def fa3_variant_gaps(parameters: frozenset[str]) -> dict[str, str]:
    """What FA3 cannot compute, from the parameters its varlen and fixed functions both take.

    FA3 has no version number; its interface gained ``window_size`` on 2024-08-29
    and ``softcap`` on 2025-01-07 (hopper/flash_attn_interface.py), so an older
    build is recognized by the missing parameter.
    """
    gaps = {"sinks": _NO_SINKS.format(library="FlashAttention-3's flash_attn_interface")}
    for kind, parameter in (("window", "window_size"), ("softcap", "softcap")):
        if parameter not in parameters:
            gaps[kind] = f"this FlashAttention-3 build has no {parameter} parameter (rebuild from a newer hopper/)"
    return gaps


def te_variant_gaps(version: tuple[int, ...]) -> dict[str, str]:
    """What TransformerEngine ``version`` cannot compute: no soft-cap, no sinks of ours, windows from 2.0."""
    gaps = {
        "softcap": "TransformerEngine's DotProductAttention has no logit soft-capping",
        # softmax_type="learnable" keeps the sinks in the module's own softmax_offset
        # parameter; the model's s_aux (and its gradient) would have to be routed
        # through it, and only some TE backends/cuDNN versions implement it.
        "sinks": "TransformerEngine keeps learnable sinks as its module's own softmax_offset parameter, "
        "which this kernel does not route the model's s_aux through",
    }
    if version < TE_WINDOW_MIN:
        gaps["window"] = (
            f"TransformerEngine {_dotted(version)} predates per-sequence bottom-right sliding windows for THD "
            f"(>= {_dotted(TE_WINDOW_MIN)})"
        )
    return gaps


def torch_varlen_variant_gaps(parameters: frozenset[str]) -> dict[str, str]:
    """What torch's ``varlen_attn`` cannot compute: it has ``window_size`` only (no soft-cap, no sinks)."""
    gaps = {
        "softcap": "torch's varlen_attn has no soft-cap parameter",
        "sinks": _NO_SINKS.format(library="torch's varlen_attn"),
    }
    if "window_size" not in parameters:
        gaps["window"] = f"torch {torch.__version__}'s varlen_attn has no window_size parameter"
    return gaps


def _parameters(*functions: Callable[..., Any]) -> frozenset[str]:
    """Parameter names every one of ``functions`` takes (empty when one has no inspectable signature)."""
    names: set[str] | None = None
    for fn in functions:
        try:
            own = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):  # a compiled function without a signature: assume nothing
            return frozenset()
        names = own if names is None else names & own
    return frozenset(names or ())


def variant_gaps(kernel: str) -> dict[str, str]:
    """Per feature kind, why GPU ``kernel`` cannot compute it with the installed library.

    A library that cannot be imported has no gaps here: its environment check
    refuses the kernel anyway, with the reason that matters.
    """
    if kernel == "flash":
        probe = probe_import("flash_attn")
        if probe.module is None:
            return {"sinks": _NO_SINKS.format(library="flash-attn 2")}
        return flash_variant_gaps(release(getattr(probe.module, "__version__", None)))
    if kernel == "fa3":
        probe = probe_import("flash_attn_interface")
        functions = [getattr(probe.module, name, None) for name in ("flash_attn_func", "flash_attn_varlen_func")]
        if probe.module is None or None in functions:
            return {"sinks": _NO_SINKS.format(library="FlashAttention-3's flash_attn_interface")}
        return fa3_variant_gaps(_parameters(*functions))
    if kernel == "te":
        probe = probe_import("transformer_engine")
        version = release(getattr(probe.module, "__version__", None)) if probe.module is not None else TE_WINDOW_MIN
        return te_variant_gaps(version)
    if kernel == "torch_varlen":
        probe = probe_import("torch.nn.attention.varlen")
        varlen_attn = getattr(probe.module, "varlen_attn", None)
        return torch_varlen_variant_gaps(_parameters(varlen_attn) if varlen_attn is not None else frozenset())
    raise KeyError(f"{kernel!r} is not a GPU kernel")


def flash_variant_problem(variant: AttentionVariant, dropout_p: float = 0.0) -> str | None:
    """Which feature of ``variant`` the installed flash-attn 2 cannot compute (:func:`flash_variant_gaps`).

    Soft-capping has no dropout (``flash_api.cpp``: "Softcapping does not support
    dropout for now"): said at selection, so ``auto`` passes flash over.
    """
    if variant.plain:
        return None
    if variant.softcap is not None and dropout_p > 0:
        return (
            f"{variant.describe(f'softcap={variant.softcap}')} with dropout_p={dropout_p} is not supported by "
            "attn_backend=flash: flash-attn's soft-capping has no dropout; use dropout_p=0, attn_backend='auto' "
            "or 'sdpa_varlen'"
        )
    return variant_problem("flash", variant, variant_gaps("flash"))


def fa3_variant_problem(variant: AttentionVariant, dropout_p: float = 0.0) -> str | None:
    """Which feature of ``variant`` the installed FlashAttention-3 cannot compute (:func:`fa3_variant_gaps`)."""
    del dropout_p  # no dropout-dependent variant limit
    return None if variant.plain else variant_problem("fa3", variant, variant_gaps("fa3"))


def te_variant_problem(variant: AttentionVariant, dropout_p: float = 0.0) -> str | None:
    """Which feature of ``variant`` the installed TransformerEngine cannot compute (:func:`te_variant_gaps`)."""
    del dropout_p  # no dropout-dependent variant limit
    return None if variant.plain else variant_problem("te", variant, variant_gaps("te"))


def torch_varlen_variant_problem(variant: AttentionVariant, dropout_p: float = 0.0) -> str | None:
    """Which feature of ``variant`` torch's ``varlen_attn`` cannot compute (:func:`torch_varlen_variant_gaps`)."""
    del dropout_p  # no dropout-dependent variant limit
    return None if variant.plain else variant_problem("torch_varlen", variant, variant_gaps("torch_varlen"))


def _require_variant(problem: str | None) -> None:
    """Selection already refused what a kernel cannot compute; a direct call still never drops a feature."""
    if problem is not None:
        raise ValueError(problem)


def flash_window(window: int | None) -> tuple[int, int]:
    """Our window ``W`` (``W`` keys, the query's own included) as flash-attn's ``(left, right)``; ``None``: causal."""
    return (-1, 0) if window is None else (window - 1, 0)


def _variant_options(meta: VarlenMeta, variant: AttentionVariant) -> dict[str, Any]:
    """Keyword arguments of flash-attn 2/FA3 calls for the variant; none for plain (older releases lack them)."""
    options: dict[str, Any] = {}
    if meta.window is not None:
        options["window_size"] = flash_window(meta.window)
    if variant.softcap is not None:
        options["softcap"] = float(variant.softcap)
    return options


# ---------------------------------------------------------------------------
# Environment checks per kernel (import, version, device)
# ---------------------------------------------------------------------------


def flash_environment(device: torch.device, head_dim: int | None, dropout_p: float) -> str | None:
    """flash-attn 2 importable, >= 2.1 and usable on this GPU."""
    probe = probe_import("flash_attn")
    if probe.problem is not None:
        return f"flash needs flash-attn >= 2.1: {probe.problem}; {INSTALL_FLASH}"
    problem = flash_module_problem(probe.module)
    if problem is not None:
        return problem
    capability = device_capability(device)
    if capability is None:
        return None
    return flash_hardware_problem(release(probe.module.__version__), capability, head_dim, dropout_p)


def fa3_environment(device: torch.device, head_dim: int | None, dropout_p: float) -> str | None:
    """``flash_attn_interface`` importable with a varlen function, on a Hopper GPU."""
    del head_dim, dropout_p  # checked by fa3_limits
    probe = probe_import("flash_attn_interface")
    if probe.problem is not None:
        return f"fa3 needs FlashAttention-3: {probe.problem}; {INSTALL_FA3}"
    if not hasattr(probe.module, "flash_attn_varlen_func"):
        return f"the installed `flash_attn_interface` has no flash_attn_varlen_func; {INSTALL_FA3}"
    capability = device_capability(device)
    return None if capability is None else fa3_hardware_problem(capability)


def torch_varlen_environment(device: torch.device, head_dim: int | None, dropout_p: float) -> str | None:
    """torch's ``varlen_attn`` present and its flash kernel built, on an Ampere or newer GPU."""
    del head_dim, dropout_p  # checked by torch_varlen_limits
    probe = probe_import("torch.nn.attention.varlen")
    if probe.problem is not None or not hasattr(probe.module, "varlen_attn"):
        return f"torch_varlen needs torch.nn.attention.varlen.varlen_attn (torch {torch.__version__} lacks it)"
    capability = device_capability(device)
    if capability is None:
        return None
    if not torch.backends.cuda.is_flash_attention_available():
        return "torch_varlen needs a torch build with flash attention (this one has none)"
    if capability < (8, 0):
        return f"torch_varlen needs an Ampere or newer GPU (sm80+), this one is sm{capability[0]}{capability[1]}"
    return None


@dataclass(frozen=True)
class TERuntime:
    """What TE itself sees: its version, whether it found a usable flash-attn, the cuDNN it loaded."""

    version: tuple[int, ...]
    uses_flash: bool
    cudnn: tuple[int, ...]


@functools.cache
def _te_runtime_facts() -> TERuntime:
    te = importlib.import_module("transformer_engine")
    version = release(getattr(te, "__version__", None))
    try:  # TE's own judgement of flash-attn (installed, within its supported version range)
        utils = importlib.import_module("transformer_engine.pytorch.attention.dot_product_attention.utils")
        uses_flash = bool(utils.FlashAttentionUtils.is_installed)
    except (ImportError, AttributeError):
        uses_flash = flash_environment(torch.device("cpu"), None, 0.0) is None
    try:
        cudnn = tuple(importlib.import_module("transformer_engine.pytorch.utils").get_cudnn_version())
    except (ImportError, AttributeError, RuntimeError):
        encoded = torch.backends.cudnn.version() or 0  # e.g. 90701
        cudnn = (encoded // 10000, encoded // 100 % 100, encoded % 100)
    return TERuntime(version, uses_flash, cudnn)


def te_environment(device: torch.device, head_dim: int | None, dropout_p: float) -> str | None:
    """TransformerEngine importable, new enough, and with a backend for our THD call on this GPU."""
    del head_dim, dropout_p  # TE's backends all take our head dims and dropout (te_backends)
    probe = probe_import("transformer_engine.pytorch")
    if probe.problem is not None:
        return f"te needs TransformerEngine: {probe.problem}; {INSTALL_TE}"
    te_version = release(getattr(importlib.import_module("transformer_engine"), "__version__", None))
    if te_version < TE_MIN:
        return f"te needs TransformerEngine >= {_dotted(TE_MIN)} (padding_causal_bottom_right); {INSTALL_TE}"
    capability = device_capability(device)
    if capability is None or _te_backends_on(capability):
        return None
    facts = _te_runtime_facts()
    return (
        f"TransformerEngine {_dotted(facts.version)} has no backend for THD bottom-right attention on "
        f"sm{capability[0]}{capability[1]} with cuDNN {_dotted(facts.cudnn)} (it needs flash-attn, or sm90+ with "
        f"cuDNN >= 9.7, or TE >= 2.11 for its unfused backend; NVTE_*_ATTN may disable them); {INSTALL_FLASH}"
    )


def _te_backends_on(capability: tuple[int, int]) -> tuple[str, ...]:
    facts = _te_runtime_facts()
    return te_backends(
        te_version=facts.version,
        te_uses_flash=facts.uses_flash,
        capability=capability,
        cudnn=facts.cudnn,
        env=os.environ,
    )


def te_auto_problem(device: torch.device) -> str | None:
    """Why ``auto`` skips ``te`` although it could run: only TE's unfused backend would serve.

    The unfused backend is correct with ``attention_type="cross"`` but pads every
    segment to the longest and materializes ``[segments, heads, max_q, max_k]``
    scores: gigabytes at long context, where sdpa_varlen or torch_varlen stay linear.
    """
    capability = device_capability(device)
    if capability is not None and _te_backends_on(capability) == ("unfused",):
        return "TransformerEngine would use its unfused backend here (scores materialized per padded segment)"
    return None


def warn_if_te_unfused(device: torch.device) -> None:
    """An explicit ``te`` runs even when only TE's unfused backend serves it; say so once."""
    problem = te_auto_problem(device)
    if problem is not None:
        log_once(
            logger,
            f"te-unfused:{device}",
            logging.WARNING,
            "attn_backend=te: %s; correct, but memory grows with heads x max_q x max_k per segment. Install "
            "flash-attn (or use an sm90 GPU with cuDNN >= 9.7) for a fused path.",
            problem,
        )


# ---------------------------------------------------------------------------
# Layout helpers
# ---------------------------------------------------------------------------


def _to_thd(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, D]`` -> contiguous ``[T, H, D]`` (the varlen kernels' token-major layout)."""
    return x[0].transpose(0, 1).contiguous()


def _from_thd(out: torch.Tensor, num_heads: int, local_len: int) -> torch.Tensor:
    """``[n_real, Hq, D]`` or ``[n_real, Hq * D]`` -> ``[1, Hq, L, D]``, zero rows past ``n_real``."""
    out = out.reshape(out.shape[0], num_heads, -1).transpose(0, 1).unsqueeze(0)
    return F.pad(out, (0, 0, 0, local_len - out.shape[2]))


def _first(result: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The output of a call that returns either ``out`` or ``(out, softmax_lse, ...)``."""
    return result[0] if isinstance(result, tuple | list) else result


@dataclass(frozen=True)
class Piece:
    """A run of consecutive segments attended by one call.

    Attributes:
        first: Index of the first segment; ``stop``: one past the last.
        straddles: True for a single segment with earlier keys (``k_len > q_len``).
        q: Query token range ``(start, stop)``; ``k``: key token range.
        max_len: Longest segment of a run of square segments.
    """

    first: int
    stop: int
    straddles: bool
    q: tuple[int, int]
    k: tuple[int, int]
    max_len: int


def boundary_pieces(meta: VarlenMeta) -> list[Piece]:
    """Split a group into its straddling segments (one piece each) and runs of square segments.

    Host-only: built from ``meta.q_lens``/``k_lens``, no device access.
    """
    pieces: list[Piece] = []
    for i, (q0, q_len, k0, k_len) in enumerate(meta.segments()):
        straddles = k_len > q_len
        last = pieces[-1] if pieces else None
        if last is not None and not straddles and not last.straddles:
            merged = Piece(last.first, i + 1, False, (last.q[0], q0 + q_len), (last.k[0], k0 + k_len), last.max_len)
            pieces[-1] = replace(merged, max_len=max(last.max_len, q_len))
        else:
            pieces.append(Piece(i, i + 1, straddles, (q0, q0 + q_len), (k0, k0 + k_len), k_len))
    return pieces


FixedCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> out
VarlenCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]


def _boundary_guarded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMeta, fixed: FixedCall, varlen: VarlenCall
) -> torch.Tensor:
    """Attend ``q [n_real, Hq, D]`` over ``k/v [K, Hkv, D]`` with no varlen launch over a segment with k > q.

    Upstream (NVIDIA-NeMo/Automodel ``_flash_varlen_with_long_prefix_guard``) saw
    some FlashAttention builds raise an asynchronous illegal memory access on
    varlen launches whose first segment has more keys than queries, which
    poisons the CUDA context. Like upstream, every such segment goes through the
    fixed-length function (same bottom-right causal layout, no ``cu_seqlens``);
    the square segments between them stay in varlen calls whose offsets are
    device-side slices of ``cu_q`` (no host sync). A group without a straddling
    segment is one varlen call, as before.
    """
    pieces = boundary_pieces(meta)
    if not any(p.straddles for p in pieces):
        return varlen(q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k)
    outs = []
    for p in pieces:
        qs, ks, vs = q[p.q[0] : p.q[1]], k[p.k[0] : p.k[1]], v[p.k[0] : p.k[1]]
        if p.straddles:
            outs.append(fixed(qs, ks, vs))
        else:  # square segments: one offset tensor indexes queries and keys
            cu = meta.cu_q[p.first : p.stop + 1] - meta.cu_q[p.first]
            outs.append(varlen(qs, ks, vs, cu, cu, p.max_len, p.max_len))
    return torch.cat(outs)


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


def flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:
    """flash-attn 2: ``flash_attn_varlen_func`` with ``causal=True`` (bottom-right), boundary-guarded.

    A window goes in as ``window_size=(W - 1, 0)`` and a soft-cap as ``softcap=c``
    (see :func:`flash_window`); plain calls pass neither, as flash-attn 2.1/2.2 have no such parameters.
    """
    _require_variant(flash_variant_problem(variant, dropout_p))
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    options = _variant_options(meta, variant)

    def fixed(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        out = flash_attn_func(
            qs[None], ks[None], vs[None], dropout_p=dropout_p, softmax_scale=scale, causal=True, **options
        )
        return out[0]

    def varlen(
        qs: torch.Tensor,
        ks: torch.Tensor,
        vs: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
    ) -> torch.Tensor:
        return flash_attn_varlen_func(
            qs,
            ks,
            vs,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            dropout_p=dropout_p,
            softmax_scale=scale,
            causal=True,
            **options,
        )

    out = _boundary_guarded(_to_thd(q[:, :, : meta.n_real]), _to_thd(k), _to_thd(v), meta, fixed, varlen)
    return _from_thd(out, q.shape[1], meta.local_len)


def fa3(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:
    """FlashAttention-3 varlen with ``causal=True`` (bottom-right), boundary-guarded like ``flash``.

    Only keyword arguments after ``cu_seqlens``: FA3's positional order changed
    between releases (``seqused_q/k`` moved behind ``max_seqlen``). Releases up to
    2025-07 return ``(out, softmax_lse)``, 2.8.x return ``out``: both are accepted.
    Windows and soft-caps are passed as for ``flash`` (FA3's mask.h uses the same bounds).
    """
    _require_variant(fa3_variant_problem(variant))
    if dropout_p > 0:
        raise ValueError("fa3 has no dropout; attn_backend='fa3' needs dropout_p=0")
    from flash_attn_interface import flash_attn_func, flash_attn_varlen_func

    options = _variant_options(meta, variant)

    def fixed(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        return _first(flash_attn_func(qs[None], ks[None], vs[None], softmax_scale=scale, causal=True, **options))[0]

    def varlen(
        qs: torch.Tensor,
        ks: torch.Tensor,
        vs: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
    ) -> torch.Tensor:
        result = flash_attn_varlen_func(
            qs,
            ks,
            vs,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            softmax_scale=scale,
            causal=True,
            **options,
        )
        return _first(result)

    out = _boundary_guarded(_to_thd(q[:, :, : meta.n_real]), _to_thd(k), _to_thd(v), meta, fixed, varlen)
    return _from_thd(out, q.shape[1], meta.local_len)


def torch_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:
    """torch's ``varlen_attn``; causal is ``window_size=(-1, 0)`` (it sets ``is_causal = window_size == (-1, 0)``).

    The flash kernel behind it aligns causal masks bottom-right, as flash-attn 2 does. A
    window ``W`` is ``window_size=(W - 1, 0)``: ``is_causal`` is then false, and the bundled
    flash-attn's local mask (right bound 0) is the same bottom-right causal window.
    """
    _require_variant(torch_varlen_variant_problem(variant))
    if dropout_p > 0:
        raise ValueError("torch_varlen has no dropout; attn_backend='torch_varlen' needs dropout_p=0")
    from torch.nn.attention.varlen import varlen_attn

    out = varlen_attn(
        _to_thd(q[:, :, : meta.n_real]),
        _to_thd(k),
        _to_thd(v),
        meta.cu_q,
        meta.cu_k,
        meta.max_q,
        meta.max_k,
        scale=scale,
        window_size=flash_window(meta.window),  # a tuple: varlen_attn compares it with (-1, 0)
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return _from_thd(out, q.shape[1], meta.local_len)


_TE_MODULES: dict[tuple[Any, ...], torch.nn.Module] = {}


def te_module(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float | None,
    dropout_p: float,
    device: torch.device,
    window: int | None = None,
) -> torch.nn.Module:
    """A cached TransformerEngine ``DotProductAttention`` for our THD calls (``window``: sliding window ``W``)."""
    key = (num_heads, num_kv_heads, head_dim, scale, dropout_p, str(device), window)
    module = _TE_MODULES.get(key)
    if module is None:
        from transformer_engine.pytorch import DotProductAttention

        module = DotProductAttention(
            num_attention_heads=num_heads,
            kv_channels=head_dim,
            num_gqa_groups=num_kv_heads,
            attention_dropout=dropout_p,
            qkv_format="thd",
            # a rank's rows are the suffix of their document's keys
            attn_mask_type="padding_causal_bottom_right",
            # "self" (the default) makes TE's unfused backend build the key padding mask
            # from cu_seqlens_q: top-left over the first q keys when max_k == max_q, a
            # broadcast error when max_k > max_q. "cross" masks keys with cu_seqlens_kv.
            attention_type="cross",
            softmax_scale=scale,
            # only for a window: TE then aligns it bottom-right per sequence (get_full_mask,
            # padding_causal_bottom_right: [i + skv - sq - left, i + skv - sq]); None is plain causal
            **({} if window is None else {"window_size": flash_window(window)}),
        ).to(device)
        _TE_MODULES[key] = module
    return module


def te(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:
    """TransformerEngine THD attention, ``padding_causal_bottom_right``, ``attention_type="cross"``.

    A window ``W`` is the module's ``window_size=(W - 1, 0)``; TE has no soft-cap and takes no sinks of ours.
    """
    _require_variant(te_variant_problem(variant))
    module = te_module(q.shape[1], k.shape[1], q.shape[3], scale, dropout_p, q.device, meta.window)
    out = module(
        _to_thd(q[:, :, : meta.n_real]),
        _to_thd(k),
        _to_thd(v),
        cu_seqlens_q=meta.cu_q,
        cu_seqlens_kv=meta.cu_k,
        max_seqlen_q=meta.max_q,
        max_seqlen_kv=meta.max_k,
    )
    return _from_thd(out, q.shape[1], meta.local_len)

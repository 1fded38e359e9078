"""What the installed GPU attention libraries and the device can run: probed once, judged by pure rules.

:func:`probe_gpu_libraries` imports flash-attn 2, FlashAttention-3, TransformerEngine
and torch's ``varlen_attn`` once per process and reads the device once: versions,
function signatures, FA3's build flags, TE's own view of flash-attn, the cuDNN
version, the compute capability and the opt-in shared memory per block. The
result, :class:`GpuLibraries`, is immutable; setup code resolves kernels from it,
and the kernels take their library functions from it (nothing is imported inside
an attention call).

The ``*_problem`` functions below are pure functions of those facts and of one
:class:`KernelCall` (dtypes, head dims, dropout, attention variant): each returns
why a library cannot run the call, worded with its fix, or ``None``. Every fact
comes from the library's source at the tags named in docs/design.md's *Kernels*
table (library, version, file, the line that decides).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant

# flash-attn 2: 2.1 made causal bottom-right; 2.6.2 ships the soft-cap backward
# ("backwards for softcapping", #1033: 2.6.0/2.6.1 rebuild probabilities without
# the tanh) and keeps the split-KV accumulators of the fixed-length forward alive
# until the kernel ran ("Fix ima for split-kv kernel", #1085; 2.2.0-2.6.1 free them
# first). Our boundary guard runs every segment with earlier keys through that
# fixed-length forward, so 2.6.2 is the floor for every call.
FLASH_MIN = (2, 6, 2)
FLASH_BLACKWELL_MIN = (2, 7, 3)  # TE's FlashAttentionUtils.version_required_blackwell
# flash_bwd_launch_template.h run_mha_bwd_hdim256: below 144 KB of opt-in shared memory the
# dropout variant launches no kernel; 2.6.2-2.7.2 refuse it in mha_bwd unless sm80/sm90.
FLASH_HDIM256_DROPOUT_SMEM = 144 * 1024
FLASH_HDIM256_DROPOUT_UNCHECKED = (2, 7, 3)  # the TORCH_CHECK(is_sm80 || is_sm90) is gone from 2.7.3
MAX_HEAD_DIM = 256  # flash-attn 2, FA3 and torch's bundled flash-attn

TE_MIN = (1, 9)  # the first TE with padding_causal_bottom_right (pytorch/constants.py)
TE_KV_CHANNELS_PAIR = (1, 10)  # DotProductAttention(kv_channels=(D, Dv)) for a value head dim of its own
TE_FUSED_BOTTOM_RIGHT = (2, 0)  # fused_attn.cpp: padding_causal_bottom_right from 2.0 (cuDNN 9.6, %64, no dropout)
TE_FUSED_ANY_LENGTH = (2, 2)  # ... and the cuDNN 9.7 clause (any length, dropout) from 2.2
TE_FUSED_HEAD_DIMS_BY_ARCH = (2, 5)  # per-architecture head-dim clauses of nvte_get_fused_attn_backend
TE_FLASH_MLA_PADDED = (2, 18)  # TE pads a value head dim of its own for flash-attn 2 (fa2_padded_head_dim)
TE_FLASH_WIDE_HEADS_ON = {(2, 2): ((8, 0), (9, 0), (10, 0), (12, 0)), (0,): ((8, 0), (9, 0))}
TE_UNFUSED_THD = (2, 11)  # TE's unfused backend accepts THD from 2.11 (2.10: "Disabling ... qkv_format = thd")
TE_WINDOW_MIN = (2, 0)  # get_full_mask's per-sequence bottom-right window (TE #1281) and cuDNN SWA + THD (#1378)
CUDNN_THD_BOTTOM_RIGHT = (9, 6, 0)  # padding_causal_bottom_right with max_seqlen % 64 == 0 and no dropout
CUDNN_ANY_LENGTH = (9, 7, 0)  # ... any length, dropout allowed, from 9.7
CUDNN_BROKEN = frozenset({(9, 10, 0), (9, 10, 1)})  # fused_attn.cpp: "known bugs with SDPA F16"
CUDNN_SM120_THD = (9, 18, 1)  # sm120: "cudnn_runtime_version < 91801 is not supported"
TE_SEQLEN_MULTIPLE = 64  # our max_seqlen is rounded up to this, as TE itself does when none is given

# torch's varlen_attn: 2.10 has (..., is_causal, return_aux) only; 2.11 adds keyword-only
# scale and window_size; 2.12 adds enable_gqa (and raises for Hq != Hkv without it).
TORCH_VARLEN_NEEDS = ("scale", "window_size")

INSTALL_FLASH = "pip install 'flash-attn>=2.6.2' (the project's [flash] extra)"
INSTALL_FA3 = "build FlashAttention-3 from flash-attention/hopper (distribution flash_attn_3)"
INSTALL_TE = "pip install 'transformer-engine[pytorch]' (the project's [te] extra)"


def release(version: object) -> tuple[int, ...]:
    """The numeric release of a version (``"2.8.3.post1"`` -> ``(2, 8, 3)``; unparsable -> ``()``)."""
    match = re.match(r"\d+(\.\d+)*", str(version or ""))
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def dotted(version: tuple[int, ...]) -> str:
    """``(2, 6, 2)`` -> ``"2.6.2"``."""
    return ".".join(map(str, version))


def _sm(capability: tuple[int, int]) -> str:
    return f"sm{capability[0]}{capability[1]}"


# ---------------------------------------------------------------------------
# The facts (immutable; functions are carried along but never compared)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceFacts:
    """One CUDA device as the libraries' launch code sees it.

    Attributes:
        capability: Compute capability ``(major, minor)``.
        smem_optin: ``cudaDevAttrMaxSharedMemoryPerBlockOptin`` in bytes (``None``: torch does not report it).
        name: Device name, for messages.
    """

    capability: tuple[int, int]
    smem_optin: int | None
    name: str = ""


@dataclass(frozen=True)
class FlashLse:
    """flash-attn 2's private forward/backward pair (``flash_attn.flash_attn_interface``): the forwards return
    ``softmax_lse``, the backwards take ``out`` and ``softmax_lse`` and write ``dq``/``dk``/``dv`` in place.

    Attributes:
        split_window: 2.7.0 on: ``window_size_left``/``window_size_right`` ints, forwards return
            ``(out, softmax_lse, S_dmask, rng_state)``; 2.6.x: a ``window_size`` tuple, forwards return
            ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)``.
    """

    split_window: bool
    varlen_forward: Callable[..., Any] = field(compare=False, repr=False)
    varlen_backward: Callable[..., Any] = field(compare=False, repr=False)
    fixed_forward: Callable[..., Any] = field(compare=False, repr=False)
    fixed_backward: Callable[..., Any] = field(compare=False, repr=False)

    def _window(self, window: tuple[int, int]) -> tuple[Any, ...]:
        return window if self.split_window else (window,)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqlens: tuple[torch.Tensor, torch.Tensor, int, int] | None,
        scale: float,
        window: tuple[int, int],
        softcap: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal ``(out, softmax_lse)``: varlen ``q [Tq, Hq, D]`` with ``seqlens`` (cu_q, cu_k, max_q, max_k) ->
        ``lse [Hq, Tq]``; fixed-length ``q [B, Sq, Hq, D]`` with ``seqlens=None`` -> ``lse [B, Hq, Sq]``."""
        tail = (0.0, scale, True, *self._window(window), softcap, None, False)
        if seqlens is None:
            result = self.fixed_forward(q, k, v, *tail)
        else:
            result = self.varlen_forward(q, k, v, *seqlens, *tail)
        return result[0], result[1 if self.split_window else 5]

    def backward(
        self,
        grads: tuple[torch.Tensor, ...],
        seqlens: tuple[torch.Tensor, torch.Tensor, int, int] | None,
        scale: float,
        window: tuple[int, int],
        softcap: float,
    ) -> None:
        """Write ``dq, dk, dv`` (the last three of ``grads = (dout, q, k, v, out, lse, dq, dk, dv)``) in place."""
        tail = (0.0, scale, True, *self._window(window), softcap, None, False, None)
        if seqlens is None:
            self.fixed_backward(*grads, *tail)
        else:
            self.varlen_backward(*grads, *seqlens, *tail)


@dataclass(frozen=True)
class FlashFacts:
    """flash-attn 2 as installed: ``problem`` says why it cannot be used at all.

    ``lse`` is the private forward/backward pair sinks need, or ``None`` with ``lse_problem`` saying why.
    """

    problem: str | None
    version: tuple[int, ...] = ()
    varlen: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    fixed: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    lse: FlashLse | None = None
    lse_problem: str | None = "flash-attn 2 is not probed"


@dataclass(frozen=True)
class Fa3Binding:
    """How to call one function of FA3's private pair by keyword (hopper/flash_attn_interface.py, 2025-01-07 on).

    Attributes:
        causal: The name of the causal flag (the backward's is ``is_causal`` from the custom ops of 2025-07-16).
        split_window: ``window_size_left``/``window_size_right`` ints (custom ops) instead of a ``window_size`` tuple.
        unused: Optional inputs without a default in this build (before 2025-08-06), passed as ``None``.
    """

    causal: str
    split_window: bool
    unused: tuple[str, ...]
    function: Callable[..., Any] = field(compare=False, repr=False)

    def __call__(self, window: tuple[int, int], **arguments: Any) -> Any:
        """Call with ``arguments`` by keyword, ``causal`` true and the window in this build's spelling."""
        if self.split_window:
            spelled: dict[str, Any] = {"window_size_left": window[0], "window_size_right": window[1]}
        else:
            spelled = {"window_size": window}
        return self.function(**dict.fromkeys(self.unused), **arguments, **{self.causal: True}, **spelled)


@dataclass(frozen=True)
class Fa3Lse:
    """FA3's private pair: one ``_flash_attn_forward`` returning ``(out, softmax_lse, ...)`` and one
    ``_flash_attn_backward`` writing ``dq``/``dk``/``dv`` in place, each for fixed-length and varlen calls
    (``cu_seqlens_*`` ``None`` or given). Same interface as :class:`FlashLse`."""

    forward_call: Fa3Binding
    backward_call: Fa3Binding

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqlens: tuple[torch.Tensor, torch.Tensor, int, int] | None,
        scale: float,
        window: tuple[int, int],
        softcap: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal ``(out, softmax_lse)``: varlen ``q [Tq, Hq, D]`` -> ``lse [Hq, Tq]``; fixed-length
        ``q [B, Sq, Hq, D]`` (``seqlens=None``) -> ``lse [B, Hq, Sq]`` (hopper/flash_api.cpp ``mha_fwd``)."""
        result = self.forward_call(window, q=q, k=k, v=v, **_fa3_seqlens(seqlens), softmax_scale=scale, softcap=softcap)
        want = (q.shape[1], q.shape[0]) if seqlens is not None else (q.shape[0], q.shape[2], q.shape[1])
        if not isinstance(result, tuple | list) or len(result) < 2 or tuple(result[1].shape) != want:
            # every known build returns (out, softmax_lse, *rest); anything else is a contract we do not know
            raise RuntimeError(
                f"FlashAttention-3's private _flash_attn_forward did not return (out, softmax_lse [{want}]); "
                f"attention sinks cannot use this build; {INSTALL_FA3} from a known hopper/ revision"
            )
        return result[0], result[1]

    def backward(
        self,
        grads: tuple[torch.Tensor, ...],
        seqlens: tuple[torch.Tensor, torch.Tensor, int, int] | None,
        scale: float,
        window: tuple[int, int],
        softcap: float,
    ) -> None:
        """Write ``dq, dk, dv`` (the last three of ``grads = (dout, q, k, v, out, lse, dq, dk, dv)``) in place."""
        names = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv")
        tensors = dict(zip(names, grads))
        self.backward_call(window, **tensors, **_fa3_seqlens(seqlens), softmax_scale=scale, softcap=softcap)


def _fa3_seqlens(seqlens: tuple[torch.Tensor, torch.Tensor, int, int] | None) -> dict[str, Any]:
    names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    return dict.fromkeys(names) if seqlens is None else dict(zip(names, seqlens))


@dataclass(frozen=True)
class Fa3Facts:
    """FlashAttention-3 (``flash_attn_interface``) as built.

    Attributes:
        problem: Why it cannot be used at all.
        parameters: Parameter names both ``flash_attn_varlen_func`` and ``flash_attn_func`` take.
        unpassed_required: Required parameters our keyword calls would not pass (a signature we cannot call).
        disabled: Features switched off at build time (``flash_attn_config.CONFIG["build_flags"]``, e.g.
            ``"BACKWARD"``, ``"LOCAL"``, ``"HDIM256"``); ``None``: the build has no config (before 2025-07-16).
        lse: The private forward/backward pair sinks need, or ``None`` with ``lse_problem`` saying why.
    """

    problem: str | None
    parameters: frozenset[str] = frozenset()
    unpassed_required: tuple[str, ...] = ()
    disabled: frozenset[str] | None = None
    varlen: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    fixed: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    lse: Fa3Lse | None = None
    lse_problem: str | None = "FlashAttention-3 is not probed"


@dataclass(frozen=True)
class TEFacts:
    """TransformerEngine and what it sees.

    Attributes:
        problem: Why it cannot be used at all.
        version: TE's release.
        flash_version: The flash-attn 2 TE would call (``None``: none it supports is installed).
        fa3: TE found FlashAttention-3 (it uses it on sm90 without dropout).
        cudnn: cuDNN version TE runs with.
        construction_problem: Why building ``DotProductAttention`` fails (TE < 1.12 asserts flash-attn's range).
        flash_enabled, fused_enabled, unfused_enabled: ``NVTE_FLASH_ATTN``/``NVTE_FUSED_ATTN``/``NVTE_UNFUSED_ATTN``.
        deterministic: ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``.
    """

    problem: str | None
    version: tuple[int, ...] = ()
    flash_version: tuple[int, ...] | None = None
    fa3: bool = False
    cudnn: tuple[int, ...] = ()
    construction_problem: str | None = None
    flash_enabled: bool = True
    fused_enabled: bool = True
    unfused_enabled: bool = True
    deterministic: bool = False
    dot_product_attention: type | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TorchVarlenFacts:
    """torch's ``varlen_attn``: its parameters and whether torch was built with flash attention."""

    problem: str | None
    parameters: frozenset[str] = frozenset()
    flash_built: bool = False
    function: Callable[..., Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class GpuLibraries:
    """Everything the GPU kernels' availability depends on, probed once (see :func:`probe_gpu_libraries`).

    ``device`` is ``None`` off CUDA (the stand-ins run on CPU; device rules are then not applied).
    """

    device: DeviceFacts | None
    flash: FlashFacts
    fa3: Fa3Facts
    te: TEFacts
    torch_varlen: TorchVarlenFacts


@dataclass(frozen=True)
class KernelCall:
    """The properties of an attention call that decide whether a kernel can run it.

    Attributes:
        dtype: Query dtype.
        head_dim: Query/key head dim ``D`` (``None``: not checked).
        value_head_dim: Value head dim ``Dv`` (``None``: equal to ``D``; MLA models differ).
        dropout_p: Attention dropout.
        variant: Window, soft-cap and sinks of the call.
    """

    dtype: torch.dtype
    head_dim: int | None = None
    value_head_dim: int | None = None
    dropout_p: float = 0.0
    variant: AttentionVariant = PLAIN

    @property
    def dv(self) -> int | None:
        """The value head dim (``head_dim`` when not given)."""
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def mla(self) -> bool:
        """True when the value head dim differs from the query/key head dim."""
        return self.head_dim is not None and self.dv is not None and self.dv != self.head_dim


# ---------------------------------------------------------------------------
# The probe
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
    except (ImportError, OSError, RuntimeError, AssertionError) as exc:
        return ImportProbe(None, f"importing `{name}` failed: {type(exc).__name__}: {exc}")


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a compiled function without a signature
        return None


def parameters_of(*functions: Callable[..., Any]) -> frozenset[str]:
    """Parameter names every one of ``functions`` takes (empty when one has no inspectable signature)."""
    names: set[str] | None = None
    for fn in functions:
        signature = _signature(fn)
        if signature is None:
            return frozenset()
        names = set(signature.parameters) if names is None else names & set(signature.parameters)
    return frozenset(names or ())


def required_parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Parameters of ``fn`` without a default (positional-or-keyword or keyword-only)."""
    signature = _signature(fn)
    if signature is None:
        return ()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(
        p.name for p in signature.parameters.values() if p.kind in kinds and p.default is inspect.Parameter.empty
    )


def _probe_flash() -> FlashFacts:
    probe = probe_import("flash_attn")
    if probe.problem is not None:
        return FlashFacts(f"flash needs flash-attn >= {dotted(FLASH_MIN)}: {probe.problem}; {INSTALL_FLASH}")
    module = probe.module
    varlen, fixed = getattr(module, "flash_attn_varlen_func", None), getattr(module, "flash_attn_func", None)
    if varlen is None or fixed is None:
        # pip install flash-attn-4 ships only the flash_attn.cute package: `flash_attn`
        # then imports as a namespace package without the FA2 functions.
        return FlashFacts(
            "the installed `flash_attn` has no flash_attn_varlen_func (FlashAttention-4 alone installs "
            f"flash_attn.cute as a namespace package); {INSTALL_FLASH}"
        )
    version = release(getattr(module, "__version__", None))
    lse, lse_problem = _probe_flash_lse(version)
    return FlashFacts(None, version, varlen, fixed, lse, lse_problem)


# flash-attn 2's private pair, by era (flash_attn/flash_attn_interface.py, v2.6.2 and v2.7.0..v2.8.3): the leading
# parameters we pass positionally. 2.7.0 split window_size into two ints and made the four custom ops.
FLASH_LSE_SPLIT_WINDOW = (2, 7, 0)
_FLASH_WINDOW = {True: ("window_size_left", "window_size_right"), False: ("window_size",)}


def _flash_lse_parameters(split: bool) -> dict[str, tuple[str, ...]]:
    window = _FLASH_WINDOW[split]
    forward = ("dropout_p", "softmax_scale", "causal", *window, "softcap", "alibi_slopes")
    backward_head = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv")
    backward = ("dropout_p", "softmax_scale", "causal", *window, "softcap", "alibi_slopes", "deterministic")
    seqlens = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    return {
        "_flash_attn_varlen_forward": ("q", "k", "v", *seqlens, *forward, "return_softmax"),
        "_flash_attn_forward": ("q", "k", "v", *forward, "return_softmax"),
        "_flash_attn_varlen_backward": (*backward_head, *seqlens, *backward, "rng_state"),
        "_flash_attn_backward": (*backward_head, *backward, "rng_state"),
    }


def _probe_flash_lse(version: tuple[int, ...]) -> tuple[FlashLse | None, str | None]:
    """The private pair of this flash-attn release, checked parameter for parameter, or why it cannot be used."""
    probe = probe_import("flash_attn.flash_attn_interface")
    if probe.problem is not None:
        return None, f"flash-attn's private forward/backward cannot be imported: {probe.problem}"
    split = version >= FLASH_LSE_SPLIT_WINDOW
    functions = {}
    for name, expected in _flash_lse_parameters(split).items():
        fn = getattr(probe.module, name, None)
        # a torch.library custom op (2.7.0 on) keeps the decorated function as _init_fn
        signature = None if fn is None else _signature(getattr(fn, "_init_fn", fn))
        names = () if signature is None else tuple(signature.parameters)[: len(expected)]
        if names != expected:
            return None, (
                f"flash-attn {dotted(version)}'s private {name} does not take ({', '.join(expected)}) as the "
                f"{'2.7.0+' if split else '2.6.x'} releases do; install a flash-attn release this kernel knows "
                f"({INSTALL_FLASH})"
            )
        functions[name] = fn
    return FlashLse(
        split,
        functions["_flash_attn_varlen_forward"],
        functions["_flash_attn_varlen_backward"],
        functions["_flash_attn_forward"],
        functions["_flash_attn_backward"],
    ), None


# The arguments our FA3 calls pass by keyword (q, k, v go by position).
FA3_VARLEN_PASSED = frozenset(
    {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal"}
)
FA3_FIXED_PASSED = frozenset({"q", "k", "v", "softmax_scale", "causal"})


def _fa3_build_flags() -> frozenset[str] | None:
    """Disabled features of the FA3 build, from the ``flash_attn_config`` module it installs (2025-07-16 on)."""
    probe = probe_import("flash_attn_config")
    flags = getattr(probe.module, "CONFIG", {}).get("build_flags") if probe.module is not None else None
    if not isinstance(flags, Mapping):
        return None
    # setup.py spells most keys FLASHATTENTION_DISABLE_X and the two HDIMDIFF ones FLASH_ATTENTION_DISABLE_X
    prefix = re.compile(r"^FLASH_?ATTENTION_DISABLE_")
    return frozenset(prefix.sub("", name).upper() for name, on in flags.items() if on and prefix.match(name))


# FA3's private pair, every parameter of every hopper/flash_attn_interface.py revision from 2025-01-07 (7a802796)
# to 2025-11-21 (3fcde4b3, still so in 2026): a parameter outside these sets is a contract we have not read.
FA3_LSE_FORWARD_USED = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
FA3_LSE_BACKWARD_USED = ("dout", "q", "k", "v", "out", "softmax_lse", *FA3_LSE_FORWARD_USED[3:], "dq", "dk", "dv")
# optional inputs we do not use (no default before 2025-08-06: passed as None); `out` became `out_` on 2025-11-21,
# `sequed_q`/`sequed_k` are the backward's spelling of seqused
FA3_LSE_UNUSED = frozenset(
    {
        "k_new", "v_new", "qv", "out", "out_", "cu_seqlens_k_new", "seqused_q", "seqused_k", "sequed_q", "sequed_k",
        "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale",
        "k_descale", "v_descale",
    }
)  # fmt: skip
# left at their defaults, which are the public functions' (no sink tokens, no chunking, one split, no margin)
FA3_LSE_DEFAULTED = frozenset(
    {"sink_token_length", "attention_chunk", "rotary_interleaved", "scheduler_metadata", "num_splits", "pack_gqa"}
    | {"sm_margin", "deterministic"}
)
FA3_CAUSAL = ("causal", "is_causal")  # the backward's flag is is_causal in the custom ops (2025-07-16 on)
FA3_WINDOW = {False: ("window_size",), True: ("window_size_left", "window_size_right")}


def _fa3_binding(module: ModuleType, name: str, used: tuple[str, ...]) -> Fa3Binding | str:
    """How to call ``name`` of FA3's private pair by keyword, or why this build's signature is not one we know."""
    fn = getattr(module, name, None)
    # a torch.library custom op (2025-07-16 on) keeps the decorated function as _init_fn
    signature = None if fn is None else _signature(getattr(fn, "_init_fn", fn))
    if signature is None:
        return f"it has no inspectable {name}"
    parameters = signature.parameters
    causal = next((c for c in FA3_CAUSAL if c in parameters), FA3_CAUSAL[0])
    split = "window_size_left" in parameters
    needed = (*used, "softmax_scale", "softcap", causal, *FA3_WINDOW[split])
    missing = [p for p in needed if p not in parameters]
    unknown = [p for p in parameters if p not in needed and p not in FA3_LSE_UNUSED | FA3_LSE_DEFAULTED]
    undefaulted = [p for p in parameters if p in FA3_LSE_DEFAULTED and parameters[p].default is inspect.Parameter.empty]
    for what, names in (("lacks", missing), ("takes", unknown), ("requires", undefaulted)):
        if names:
            return f"its {name} {what} {', '.join(names)}"
    unused = tuple(p for p in parameters if p in FA3_LSE_UNUSED and p not in used)
    return Fa3Binding(causal, split, tuple(p for p in unused if parameters[p].default is inspect.Parameter.empty), fn)


def _probe_fa3_lse(module: ModuleType) -> tuple[Fa3Lse | None, str | None]:
    """FA3's private pair checked parameter by parameter against every revision read, or why it cannot be used."""
    calls = [
        _fa3_binding(module, "_flash_attn_forward", FA3_LSE_FORWARD_USED),
        _fa3_binding(module, "_flash_attn_backward", FA3_LSE_BACKWARD_USED),
    ]
    problems = [c for c in calls if isinstance(c, str)]
    if problems:
        return None, (
            f"this FlashAttention-3 build's private pair is not one this kernel has read ({'; '.join(problems)}; "
            f"known: the hopper/ interfaces of 2025-01-07 to 2025-11-21); {INSTALL_FA3} from such a revision"
        )
    forward, backward = calls
    assert isinstance(forward, Fa3Binding) and isinstance(backward, Fa3Binding)
    return Fa3Lse(forward, backward), None


def _probe_fa3() -> Fa3Facts:
    probe = probe_import("flash_attn_interface")
    if probe.problem is not None:
        return Fa3Facts(f"fa3 needs FlashAttention-3: {probe.problem}; {INSTALL_FA3}")
    varlen = getattr(probe.module, "flash_attn_varlen_func", None)
    fixed = getattr(probe.module, "flash_attn_func", None)
    if varlen is None or fixed is None:
        return Fa3Facts(
            f"the installed `flash_attn_interface` has no flash_attn_varlen_func/flash_attn_func; {INSTALL_FA3}"
        )
    unpassed = tuple(p for p in required_parameters(varlen) if p not in FA3_VARLEN_PASSED) + tuple(
        p for p in required_parameters(fixed) if p not in FA3_FIXED_PASSED
    )
    lse, lse_problem = _probe_fa3_lse(probe.module)
    return Fa3Facts(None, parameters_of(varlen, fixed), unpassed, _fa3_build_flags(), varlen, fixed, lse, lse_problem)


# Where TE keeps its view of flash-attn: a FlashAttentionUtils class from 2.2 (2.3 moved the module),
# module globals of pytorch/attention.py before.
_TE_FLASH_UTILS = (
    "transformer_engine.pytorch.attention.dot_product_attention.utils",  # TE >= 2.3
    "transformer_engine.pytorch.dot_product_attention.utils",  # TE 2.2
)


def _te_flash_view(te_version: tuple[int, ...]) -> tuple[tuple[int, ...] | None, bool, str | None]:
    """``(flash-attn version TE uses or None, TE found FA3, construction problem)``, read from TE itself.

    These are TE internals (no public API says which flash-attn TE accepts), read
    defensively: anything missing means "TE uses none".
    """
    for name in _TE_FLASH_UTILS:
        utils = probe_import(name).module
        fau = getattr(utils, "FlashAttentionUtils", None)
        if fau is not None:
            installed = bool(getattr(fau, "is_installed", False))
            return (release(fau.version) if installed else None), bool(getattr(fau, "v3_is_installed", False)), None
    attention = probe_import("transformer_engine.pytorch.attention").module
    if attention is None or not hasattr(attention, "_flash_attn_version"):
        return None, False, None
    version = release(attention._flash_attn_version)
    fa3 = bool(getattr(attention, "_flash_attn_3_is_installed", getattr(attention, "_flash_attn_3_plus", False)))
    if hasattr(attention, "_flash_attn_is_installed"):  # TE >= 1.12: out-of-range flash-attn is just not used
        return (version if attention._flash_attn_is_installed else None), fa3, None
    low, high = release(attention._flash_attn_version_required), release(attention._flash_attn_max_version)
    if low <= version <= high:
        return version, fa3, None
    return (
        None,
        fa3,
        (
            f"TransformerEngine {dotted(te_version)} asserts flash-attn {dotted(low)}..{dotted(high)} when building "
            f"DotProductAttention (installed: {dotted(version)}); install a flash-attn in that range or TE >= 1.12"
        ),
    )


def _te_cudnn() -> tuple[int, ...]:
    try:
        return tuple(importlib.import_module("transformer_engine.pytorch.utils").get_cudnn_version())
    except (ImportError, AttributeError, RuntimeError, TypeError):
        encoded = torch.backends.cudnn.version() or 0  # e.g. 90701
        return (encoded // 10000, encoded // 100 % 100, encoded % 100)


def _probe_te(env: Mapping[str, str]) -> TEFacts:
    probe = probe_import("transformer_engine.pytorch")
    if probe.problem is not None:
        return TEFacts(f"te needs TransformerEngine: {probe.problem}; {INSTALL_TE}")
    version = release(getattr(probe_import("transformer_engine").module, "__version__", None))
    if version < TE_MIN:
        return TEFacts(
            f"te needs TransformerEngine >= {dotted(TE_MIN)} (padding_causal_bottom_right); {INSTALL_TE}", version
        )
    flash_version, fa3, construction = _te_flash_view(version)
    return TEFacts(
        None,
        version,
        flash_version,
        fa3,
        _te_cudnn(),
        construction,
        flash_enabled=env.get("NVTE_FLASH_ATTN", "1") != "0",
        fused_enabled=env.get("NVTE_FUSED_ATTN", "1") != "0",
        unfused_enabled=env.get("NVTE_UNFUSED_ATTN", "1") != "0",
        deterministic=env.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") == "0",
        dot_product_attention=getattr(probe.module, "DotProductAttention", None),
    )


def _probe_torch_varlen() -> TorchVarlenFacts:
    probe = probe_import("torch.nn.attention.varlen")
    function = getattr(probe.module, "varlen_attn", None)
    if function is None:
        return TorchVarlenFacts(
            f"torch_varlen needs torch.nn.attention.varlen.varlen_attn (torch {torch.__version__} lacks it; "
            "torch >= 2.11)"
        )
    flash_built = bool(getattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)())
    return TorchVarlenFacts(None, parameters_of(function), flash_built, function)


@functools.cache
def _packages() -> tuple[FlashFacts, Fa3Facts, TEFacts, TorchVarlenFacts]:
    return _probe_flash(), _probe_fa3(), _probe_te(dict(os.environ)), _probe_torch_varlen()


@functools.cache
def _cuda_device(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    return DeviceFacts((props.major, props.minor), int(smem) if smem else None, props.name)


def device_facts(device: torch.device) -> DeviceFacts | None:
    """The CUDA device's facts; ``None`` for other devices and without CUDA (the stand-ins run on CPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _cuda_device(torch.cuda.current_device() if device.index is None else device.index)


def probe_gpu_libraries(device: torch.device | str) -> GpuLibraries:
    """Probe the GPU libraries (once per process) and ``device`` (once per device).

    Setup code calls this once and resolves kernels from the result; the kernels
    read their library functions from it, so no attention call imports anything.
    """
    flash, fa3, te, torch_varlen = _packages()
    return GpuLibraries(device_facts(torch.device(device)), flash, fa3, te, torch_varlen)


def reset_probes() -> None:
    """Forget every probe (tests that swap packages in and out)."""
    probe_import.cache_clear()
    _packages.cache_clear()
    _cuda_device.cache_clear()


# ---------------------------------------------------------------------------
# flash-attn 2
# ---------------------------------------------------------------------------


def _rounded8(head_dim: int) -> int:
    return -(-head_dim // 8) * 8


def flash_limits(call: KernelCall) -> str | None:
    """flash-attn 2 pads the head dim to a multiple of 8, then checks ``<= 256``; v must match q/k (flash_api.cpp)."""
    if call.head_dim is not None and call.head_dim > MAX_HEAD_DIM:
        return (
            f"flash supports head dims up to {MAX_HEAD_DIM}, got {call.head_dim}; use attn_backend='te' or "
            "'sdpa_varlen'"
        )
    if call.mla:
        return (
            f"flash needs the value head dim to equal the query/key head dim (flash-attn 2 checks v's shape "
            f"against head_size), got {call.head_dim} and {call.dv}; use attn_backend='auto' (fa3 on Hopper takes "
            "some pairs, te from 1.10) or 'sdpa_varlen'"
        )
    return None


def flash_problem(flash: FlashFacts, device: DeviceFacts | None, call: KernelCall) -> str | None:
    """Why the installed flash-attn 2 cannot run ``call`` on ``device`` (version, GPU, dropout backward)."""
    if flash.problem is not None:
        return flash.problem
    version = flash.version
    if version < FLASH_MIN:
        return (
            f"flash-attn {dotted(version)} is too old for attn_backend=flash (needs >= {dotted(FLASH_MIN)}: "
            "2.0.x aligns causal masks top-left, 2.6.0/2.6.1 compute the soft-cap backward without the tanh, and "
            "2.2.0-2.6.1 free the split-KV accumulators of the fixed-length forward before the kernel writes them, "
            f"the forward our segments with earlier keys go through); {INSTALL_FLASH}"
        )
    if device is None:
        return None
    capability = device.capability
    if capability < (8, 0):
        return f"flash-attn 2 needs an Ampere or newer GPU (sm80+), this one is {_sm(capability)}"
    if capability >= (10, 0) and version < FLASH_BLACKWELL_MIN:
        return (
            f"flash-attn {dotted(version)} predates Blackwell support ({dotted(FLASH_BLACKWELL_MIN)}); "
            "upgrade flash-attn"
        )
    return flash_dropout_backward_problem(version, device, call)


def flash_dropout_backward_problem(version: tuple[int, ...], device: DeviceFacts, call: KernelCall) -> str | None:
    """flash-attn 2's backward for head dims > 192 with dropout (the hdim256 kernel) needs 144 KB of shared memory.

    flash_bwd_launch_template.h ``run_mha_bwd_hdim256`` picks its kernel by
    ``cudaDevAttrMaxSharedMemoryPerBlockOptin``; below 144 KB the dropout variant
    launches nothing and dq/dk/dv are never written. 2.6.2-2.7.2 refuse the call
    unless the GPU is sm80/sm90 (``mha_bwd``); from 2.7.3 nothing raises.
    """
    if call.head_dim is None or _rounded8(call.head_dim) <= 192 or call.dropout_p <= 0:
        return None
    fix = "use dropout_p=0 or attn_backend='sdpa_varlen'"
    if version < FLASH_HDIM256_DROPOUT_UNCHECKED and device.capability not in ((8, 0), (9, 0)):
        return (
            f"flash-attn {dotted(version)} refuses the backward for head dims > 192 with dropout off sm80/sm90 "
            f"(this GPU is {_sm(device.capability)}); {fix}"
        )
    if device.smem_optin is None or device.smem_optin < FLASH_HDIM256_DROPOUT_SMEM:
        smem = "unknown" if device.smem_optin is None else f"{device.smem_optin // 1024} KB"
        return (
            f"flash-attn's backward for head dims > 192 with dropout has no kernel below 144 KB of shared memory "
            f"per block ({device.name or _sm(device.capability)}: {smem}); the gradients would never be written; {fix}"
        )
    return None


# ---------------------------------------------------------------------------
# FlashAttention-3
# ---------------------------------------------------------------------------

FA3_HEAD_DIMS_BEFORE_2025 = (64, 128, 256)  # builds without softcap (< 2025-01-07): hdim 64/128/256 only
FA3_BUCKETS = (64, 96, 128, 192, 256)  # round_up_headdim; a disabled HDIM<n> bucket is skipped


def fa3_limits(call: KernelCall) -> str | None:
    """FA3 has no dropout; its C++ checks ``head_size % 8 == 0`` (and ``head_size_v``) and ``<= 256``, no padding."""
    if call.dropout_p > 0:
        return "fa3 has no dropout (FlashAttention-3 has no dropout_p); use dropout_p=0 or attn_backend='flash'/'te'"
    for dim in (call.head_dim, call.dv):
        if dim is not None and (dim % 8 or dim > MAX_HEAD_DIM):
            return f"fa3 needs a head dim that is a multiple of 8 and at most {MAX_HEAD_DIM}, got {dim}"
    if call.mla:
        d, dv = call.head_dim, call.dv
        if not ((128 < d <= 192 and 96 < dv <= 128) or d <= 64):
            return (
                f"fa3 takes a value head dim {dv} != query/key head dim {d} only for D in (128, 192] with Dv in "
                "(96, 128], or D <= 64 (hopper/flash_api.cpp); use attn_backend='auto' or 'sdpa_varlen'"
            )
    return None


def fa3_problem(fa3: Fa3Facts, device: DeviceFacts | None, call: KernelCall) -> str | None:
    """Why the installed FA3 build cannot run ``call``: its signature, build flags, head dims, the GPU."""
    if fa3.problem is not None:
        return fa3.problem
    if fa3.unpassed_required:
        return (
            f"this FlashAttention-3 build requires {', '.join(fa3.unpassed_required)} (builds of 2025-01-07 to "
            f"2025-02-16 take seqused_q/seqused_k positionally); {INSTALL_FA3} from a newer hopper/"
        )
    disabled = fa3.disabled or frozenset()
    for flag, why in (("BACKWARD", "backward"), ("VARLEN", "varlen")):
        if flag in disabled:
            return (
                f"this FlashAttention-3 build was compiled with FLASH_ATTENTION_DISABLE_{flag} (no {why}); rebuild it"
            )
    if call.dtype == torch.float16 and "FP16" in disabled:
        return "this FlashAttention-3 build was compiled with FLASH_ATTENTION_DISABLE_FP16; use bf16 or rebuild it"
    problem = _fa3_head_dim_problem(fa3, call)
    if problem is not None or device is None:
        return problem
    if device.capability[0] != 9:
        # FA3 builds since 2025-02-16 also run on sm80+; there flash-attn 2 serves, which the
        # project validates, so fa3 stays a Hopper kernel here (a conservative choice).
        return (
            f"fa3 runs on Hopper GPUs (sm90: H100/H200) in this project, this one is {_sm(device.capability)} "
            "(FlashAttention-3's sm8x path is not used here); use attn_backend='flash'"
        )
    return None


def _fa3_head_dim_problem(fa3: Fa3Facts, call: KernelCall) -> str | None:
    if call.head_dim is None:
        return None
    d, dv = call.head_dim, call.dv
    if "softcap" not in fa3.parameters:  # builds before 2025-01-07
        if d not in FA3_HEAD_DIMS_BEFORE_2025 or call.mla:
            return (
                f"this FlashAttention-3 build (before 2025-01-07, no softcap parameter) runs head dims "
                f"{'/'.join(map(str, FA3_HEAD_DIMS_BEFORE_2025))} with equal value head dim only, got {d}/{dv}; "
                f"{INSTALL_FA3} from a newer hopper/"
            )
        return None
    disabled = fa3.disabled or frozenset()
    enabled = [b for b in FA3_BUCKETS if f"HDIM{b}" not in disabled]
    if not any(b >= max(d, dv) for b in enabled):  # the backward rounds max(D, Dv) up to an enabled bucket
        return (
            f"this FlashAttention-3 build has no kernel for head dim {max(d, dv)} (built with "
            f"{', '.join(sorted(f'DISABLE_HDIM{b}' for b in FA3_BUCKETS if f'HDIM{b}' in disabled))}); rebuild it"
        )
    if call.mla:
        if fa3.disabled is None:
            return (
                "a value head dim of its own needs a FlashAttention-3 build with the Dv != D backward (2025-04-24) "
                "and a flash_attn_config to prove it (2025-07-16); this build has none; "
                f"{INSTALL_FA3} from a newer hopper/"
            )
        flag = "HDIMDIFF64" if d <= 64 else "HDIMDIFF192"
        if flag in disabled or f"HDIM{64 if d <= 64 else 192}" in disabled:
            return f"this FlashAttention-3 build was compiled without the D={d}, Dv={dv} kernels ({flag}); rebuild it"
    return None


def fa3_gaps(fa3: Fa3Facts) -> dict[str, str]:
    """Per variant feature (``window``, ``softcap``, ``sinks``), why this FA3 build cannot compute it.

    FA3 has no version number: ``window_size`` came on 2024-08-29 and ``softcap``
    on 2025-01-07 (hopper/flash_attn_interface.py); the build flags
    ``DISABLE_LOCAL``/``DISABLE_SOFTCAP`` turn either into a runtime error.
    """
    gaps: dict[str, str] = {}
    if fa3.problem is None and fa3.lse is None:  # hopper/ has no sink input: sinks rescale the private pair's out
        gaps["sinks"] = f"attention sinks need FlashAttention-3's private forward/backward pair: {fa3.lse_problem}"
    disabled = fa3.disabled or frozenset()
    for kind, parameter, flag in (("window", "window_size", "LOCAL"), ("softcap", "softcap", "SOFTCAP")):
        if fa3.problem is None and parameter not in fa3.parameters:
            gaps[kind] = f"this FlashAttention-3 build has no {parameter} parameter (rebuild from a newer hopper/)"
        elif flag in disabled:
            gaps[kind] = f"this FlashAttention-3 build was compiled with FLASH_ATTENTION_DISABLE_{flag}"
    return gaps


# ---------------------------------------------------------------------------
# torch's varlen_attn (its bundled flash-attn 2)
# ---------------------------------------------------------------------------


def torch_varlen_limits(call: KernelCall) -> str | None:
    """``varlen_attn`` passes ``dropout_p=0.0``; its kernel checks ``head_size_og % 8``, ``<= 256`` and v's shape."""
    if call.dropout_p > 0:
        return "torch_varlen has no dropout (varlen_attn passes dropout_p=0.0); use dropout_p=0 or 'sdpa_varlen'"
    if call.head_dim is not None and call.head_dim > MAX_HEAD_DIM:
        return (
            f"torch_varlen supports head dims up to {MAX_HEAD_DIM}, got {call.head_dim}; use attn_backend='sdpa_varlen'"
        )
    if call.head_dim is not None and call.head_dim % 8:
        return (
            f"torch_varlen needs a head dim that is a multiple of 8 (torch's flash kernel does not pad), got "
            f"{call.head_dim}; use attn_backend='flash' or 'sdpa_varlen'"
        )
    if call.mla:
        return (
            f"torch_varlen needs the value head dim to equal the query/key head dim, got {call.head_dim} and "
            f"{call.dv}; use attn_backend='auto' or 'sdpa_varlen'"
        )
    return None


def torch_varlen_problem(facts: TorchVarlenFacts, device: DeviceFacts | None) -> str | None:
    """``varlen_attn`` with ``scale``/``window_size`` (torch >= 2.11), built with flash, on sm8x or sm90."""
    if facts.problem is not None:
        return facts.problem
    missing = [p for p in TORCH_VARLEN_NEEDS if p not in facts.parameters]
    if missing:
        return (
            f"torch {torch.__version__}'s varlen_attn has no {'/'.join(missing)} parameter (torch >= 2.11); "
            "upgrade torch or use attn_backend='sdpa_varlen'"
        )
    if device is None:
        return None
    if not facts.flash_built:
        return "torch_varlen needs a torch build with flash attention (this one has none)"
    capability = device.capability
    if not (capability[0] == 8 or capability == (9, 0)):
        # flash_api.cpp (torch's copy): TORCH_CHECK(is_sm90 || is_sm8x) with is_sm8x = major == 8
        return (
            f"torch's bundled flash-attn runs on sm8x and sm90 only, this GPU is {_sm(capability)}; "
            "use attn_backend='auto'"
        )
    return None


def torch_varlen_gaps(facts: TorchVarlenFacts) -> dict[str, str]:
    """What ``varlen_attn`` cannot compute: it has ``window_size`` only (no soft-cap, no sinks)."""
    gaps = {
        "softcap": "torch's varlen_attn has no soft-cap parameter",
        "sinks": "torch's varlen_attn takes no attention-sink logits (no s_aux input)",
    }
    if facts.problem is None and "window_size" not in facts.parameters:
        gaps["window"] = f"torch {torch.__version__}'s varlen_attn has no window_size parameter"
    return gaps


# ---------------------------------------------------------------------------
# TransformerEngine: which backend would serve our THD call
# ---------------------------------------------------------------------------
# Our call: THD q/k/v (separate tensors), padding_causal_bottom_right,
# attention_type="cross", vanilla softmax, no bias, training, max_seqlen_q <=
# max_seqlen_kv, max_seqlen rounded up to a multiple of 64. TE picks flash-attn
# first, except on sm90+ where cuDNN (fused) wins when both serve
# (get_attention_backend: "Select FusedAttention for performance").


@dataclass(frozen=True)
class TEPlan:
    """The backend TE would pick for a call, and why each other one does not serve.

    Attributes:
        backend: ``"flash"`` (flash-attn 2), ``"fa3"``, ``"fused"`` (cuDNN), ``"unfused"`` or ``None``.
        reasons: Per backend that does not serve, why.
    """

    backend: str | None
    reasons: tuple[tuple[str, str], ...]

    def why_not(self) -> str:
        """The reasons, one per backend."""
        return "; ".join(f"{name}: {why}" for name, why in self.reasons)


def _te_flash_wide_heads(te_version: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return next(caps for since, caps in TE_FLASH_WIDE_HEADS_ON.items() if te_version >= since)


def te_flash_problem(te: TEFacts, device: DeviceFacts, call: KernelCall) -> str | None:
    """Why TE would not use flash-attn 2 for the call (TE's own filters in get_attention_backend)."""
    if not te.flash_enabled:
        return "NVTE_FLASH_ATTN=0"
    if te.flash_version is None:
        return "TE found no flash-attn it supports"
    if te.flash_version < (2, 1):
        return "TE needs flash-attn >= 2.1 for bottom-right causal masks"
    capability = device.capability
    if capability < (8, 0):
        return "needs sm80+"
    if capability >= (10, 0) and te.flash_version < FLASH_BLACKWELL_MIN:
        return f"TE needs flash-attn >= {dotted(FLASH_BLACKWELL_MIN)} on Blackwell"
    if call.head_dim is None:
        return None
    if call.mla and te.version < TE_FLASH_MLA_PADDED:
        return "TE disables flash-attn 2 for a value head dim of its own (MLA)"
    width = max(call.head_dim, call.dv)
    if width % 8 or width > MAX_HEAD_DIM:
        return f"TE needs a head dim that is a multiple of 8 and at most 256 for flash-attn 2, got {width}"
    if width > 192 and capability not in _te_flash_wide_heads(te.version):
        return (
            f"TE runs flash-attn 2 with head dims > 192 only on {', '.join(map(_sm, _te_flash_wide_heads(te.version)))}"
        )
    return None


def te_fa3_problem(te: TEFacts, device: DeviceFacts, call: KernelCall) -> str | None:
    """Why TE would not use FlashAttention-3 (sm90, no dropout, FA3's head dims)."""
    if not te.flash_enabled:
        return "NVTE_FLASH_ATTN=0"
    if not te.fa3:
        return "TE found no FlashAttention-3"
    if device.capability != (9, 0):
        return "TE runs FA3 on sm90 only"
    if call.dropout_p > 0:
        return "TE disables FA3 for dropout"
    if call.head_dim is not None and (call.mla or call.head_dim % 8 or call.head_dim > 128):
        return "TE runs FA3 for equal head dims up to 128 (conservatively; later TE versions take more)"
    return None


def te_fused_problem(te: TEFacts, device: DeviceFacts, call: KernelCall) -> str | None:
    """Why cuDNN fused attention (``nvte_get_fused_attn_backend``) would not serve the call.

    The clauses of common/fused_attn/fused_attn.cpp for our call, by TE release:
    THD needs sm90+; ``padding_causal_bottom_right`` exists from TE 2.0 (cuDNN
    9.6, ``max_seqlen % 64 == 0``, no dropout), from TE 2.2 also any length and
    dropout with cuDNN 9.7; head dims per architecture (below); cuDNN
    9.10.0/9.10.1 excluded; sm120 needs cuDNN 9.18.1.
    """
    if not te.fused_enabled:
        return "NVTE_FUSED_ATTN=0"
    capability, cudnn = device.capability, te.cudnn
    if capability < (9, 0):
        return "cuDNN runs THD on sm90+ only"
    if te.version < TE_FUSED_BOTTOM_RIGHT:
        return f"TE {dotted(te.version)} has no cuDNN padding_causal_bottom_right (from 2.0)"
    dropout = call.dropout_p > 0
    any_length = te.version >= TE_FUSED_ANY_LENGTH and cudnn >= CUDNN_ANY_LENGTH
    if not any_length and cudnn < CUDNN_THD_BOTTOM_RIGHT:
        return f"bottom-right THD needs cuDNN >= 9.6, got {dotted(cudnn)}"
    if not any_length and dropout:  # the 9.6 clause has no dropout; the 9.7 one is TE >= 2.2's
        return f"bottom-right THD with dropout needs TE >= {dotted(TE_FUSED_ANY_LENGTH)} and cuDNN >= 9.7"
    if call.variant.window is not None and (dropout or (capability >= (10, 0) and cudnn <= CUDNN_ANY_LENGTH)):
        return "cuDNN's sliding window needs no dropout (and cuDNN > 9.7 on sm100+)"
    if call.variant.window is not None and cudnn[:3] == (9, 14, 0) and te.version >= (2, 10):
        # fused_attn.cpp (2.10+): no backend for a window with a non-causal-only mask above 1024 keys; the
        # key count is the step's, so the window is refused at any length (conservative)
        return "TE excludes cuDNN 9.14.0 for sliding windows above 1024 keys"
    if cudnn[:3] in CUDNN_BROKEN:
        return f"cuDNN {dotted(cudnn)} has known SDPA bugs (TE >= 2.6 excludes 9.10.0/9.10.1)"
    if capability == (12, 0) and cudnn < CUDNN_SM120_THD:
        return f"cuDNN < {dotted(CUDNN_SM120_THD)} does not run sm120"
    if capability >= (10, 0) and te.deterministic and te.version >= (2, 12) and (cudnn < CUDNN_SM120_THD or dropout):
        return "deterministic backward on Blackwell needs cuDNN 9.18.1 and no dropout"
    return _te_fused_head_dim_problem(te, capability, call)


def _te_fused_head_dim_problem(te: TEFacts, capability: tuple[int, int], call: KernelCall) -> str | None:
    if call.head_dim is None:
        return None
    d, dv, cudnn = call.head_dim, call.dv, te.cudnn
    if d % 8 or dv % 8:
        return "cuDNN needs head dims that are multiples of 8"
    small = d <= 128 and dv <= 128
    if te.version < TE_FUSED_HEAD_DIMS_BY_ARCH:
        if capability >= (10, 0) and not small:
            return "cuDNN on sm100+ takes head dims up to 128 in this TE"
        ok = small or (d <= 256 and dv <= 256 and cudnn >= (9, 0, 0))
    else:
        ok = (
            small
            or (d <= 256 and dv <= 256 and capability == (9, 0) and cudnn >= (9, 5, 0))
            or ((d, dv) == (192, 128) and capability >= (10, 0) and cudnn >= (9, 11, 0))
            or (
                te.version >= (2, 18)
                and d == dv == 256
                and (10, 0) <= capability < (11, 0)
                and cudnn >= (9, 25, 0)
                and call.dropout_p == 0
            )
        )
        if ok and capability == (9, 0) and _te_hopper_mla_bug(te, d, dv):
            return f"TE excludes cuDNN {dotted(cudnn)} for this MLA backward on sm90 (known bug)"
    if not ok:
        return f"cuDNN has no training kernel for head dims {d}/{dv} on {_sm(capability)} with {dotted(cudnn)}"
    return None


def _te_hopper_mla_bug(te: TEFacts, d: int, dv: int) -> bool:
    """TE's exclusion of a cuDNN bug (128 <= D, Dv, D != Dv, not 192/128) in the sm90 backward."""
    if not (d >= 128 and dv >= 128 and d != dv and (d, dv) != (192, 128)):
        return False
    buggy = {(2, 6): ((9, 11), (9, 12)), (2, 7): ((9, 11), (9, 12), (9, 13))}
    versions = buggy.get(te.version[:2])
    if te.version >= (2, 8):
        return te.cudnn[:2] >= (9, 11)
    return versions is not None and te.cudnn[:2] in versions


def te_plan(te: TEFacts, device: DeviceFacts, call: KernelCall) -> TEPlan:
    """The backend TE would pick for ``call`` on ``device`` (and why the others do not serve)."""
    checks = {
        "flash": te_flash_problem(te, device, call),
        "fa3": te_fa3_problem(te, device, call),
        "fused": te_fused_problem(te, device, call),
        "unfused": None
        if te.unfused_enabled and te.version >= TE_UNFUSED_THD
        else ("NVTE_UNFUSED_ATTN=0" if not te.unfused_enabled else f"THD needs TE >= {dotted(TE_UNFUSED_THD)}"),
    }
    order = ("fused", "fa3", "flash") if device.capability >= (9, 0) else ("fa3", "flash", "fused")
    backend = next((name for name in (*order, "unfused") if checks[name] is None), None)
    return TEPlan(backend, tuple((name, why) for name, why in checks.items() if why is not None))


def te_problem(te: TEFacts, device: DeviceFacts | None, call: KernelCall) -> str | None:
    """Why TE cannot run ``call``: import/version, module construction, no backend, or a backend that is wrong."""
    if te.problem is not None:
        return te.problem
    if call.mla and te.version < TE_KV_CHANNELS_PAIR:
        return (
            f"TransformerEngine {dotted(te.version)} takes one kv_channels for keys and values (a value head dim of "
            f"its own needs kv_channels=(D, Dv), TE >= {dotted(TE_KV_CHANNELS_PAIR)}); {INSTALL_TE}"
        )
    if te.construction_problem is not None:
        return te.construction_problem
    if device is None:
        return None
    plan = te_plan(te, device, call)
    if plan.backend is None:
        return (
            f"TransformerEngine {dotted(te.version)} has no backend for THD bottom-right attention here "
            f"({device.name or _sm(device.capability)}, cuDNN {dotted(te.cudnn)}, head dims {call.head_dim}/{call.dv}, "
            f"dropout_p={call.dropout_p}): {plan.why_not()}"
        )
    if plan.backend == "flash":
        hazard = flash_dropout_backward_problem(te.flash_version or (), device, call)
        if hazard is not None:
            return f"TransformerEngine would call flash-attn 2 here, and {hazard}"
    return None


def te_auto_problem(te: TEFacts, device: DeviceFacts | None, call: KernelCall) -> str | None:
    """Why ``auto`` passes over ``te`` although it can run (an explicit ``te`` runs, with a warning).

    - only TE's unfused backend serves: correct with ``attention_type="cross"``, but it pads every
      segment to the longest and materializes ``[segments, heads, max_q, max_k]`` scores;
    - TE would call a flash-attn 2 older than 2.6.2, whose fixed-length forward our boundary guard
      cannot use (split-KV accumulators freed early), so segments with earlier keys stay in
      TE's varlen launch, the one upstream saw raise illegal memory accesses.
    """
    if te.problem is not None or device is None:
        return None
    plan = te_plan(te, device, call)
    if plan.backend == "unfused":
        return "TransformerEngine would use its unfused backend here (scores materialized per padded segment)"
    if plan.backend == "flash" and (te.flash_version or ()) < FLASH_MIN:
        return (
            f"TransformerEngine would call flash-attn {dotted(te.flash_version or ())} (< {dotted(FLASH_MIN)}), "
            "where segments with earlier keys cannot be moved out of its varlen launch"
        )
    return None


def te_guards_boundaries(te: TEFacts, device: DeviceFacts | None, call: KernelCall) -> bool:
    """True when TE would run a flash-attn kernel whose fixed-length forward takes our segments with earlier keys."""
    if device is None:
        return False
    backend = te_plan(te, device, call).backend
    return backend == "fa3" or (backend == "flash" and (te.flash_version or ()) >= FLASH_MIN)


def te_gaps(te: TEFacts) -> dict[str, str]:
    """What TransformerEngine cannot compute: no soft-cap, no sinks of ours, windows from 2.0."""
    gaps = {
        "softcap": "TransformerEngine's DotProductAttention has no logit soft-capping",
        # softmax_type="learnable" keeps the sinks in the module's own softmax_offset
        # parameter; the model's s_aux (and its gradient) would have to be routed
        # through it, and only some TE backends/cuDNN versions implement it.
        "sinks": "TransformerEngine keeps learnable sinks as its module's own softmax_offset parameter, "
        "which this kernel does not route the model's s_aux through",
    }
    if te.problem is None and te.version < TE_WINDOW_MIN:
        gaps["window"] = (
            f"TransformerEngine {dotted(te.version)} predates per-sequence bottom-right sliding windows for THD "
            f"(>= {dotted(TE_WINDOW_MIN)})"
        )
    return gaps


def flash_gaps(flash: FlashFacts) -> dict[str, str]:
    """What flash-attn 2 (>= 2.6.2) cannot compute (windows came in 2.3, soft-caps in 2.6).

    Sinks rescale the output of its private forward/backward pair (``FlashLse``); without that pair
    (``flash.lse_problem``) they are a gap.
    """
    if flash.problem is None and flash.lse is None:
        return {"sinks": f"attention sinks need flash-attn's private forward/backward pair: {flash.lse_problem}"}
    return {}


def te_round_seqlen(n: int) -> int:
    """``max_seqlen`` as we pass it to TE: rounded up to a multiple of 64, as TE does when given none.

    cuDNN's bottom-right THD clause of TE 2.0-2.1 (and of cuDNN 9.6) needs
    ``max_seqlen % 64 == 0``; an upper bound is valid for every backend.
    """
    return -(-n // TE_SEQLEN_MULTIPLE) * TE_SEQLEN_MULTIPLE

"""The kernel registry: which block-diagonal kernels exist, whether one can run a call, and dispatch.

Every kernel has the contract of :mod:`.metadata` (local queries against packed keys and
values described by a :class:`~.metadata.VarlenMeta`), in its own format
(:attr:`KernelSpec.layout`): the CPU kernels take ``q [1, Hq, L, D]``, ``k [1, Hkv, K, D]``,
``v [1, Hkv, K, Dv]`` and return ``[1, Hq, L, Dv]`` with zero padding rows; the GPU kernels
take the libraries' token-major ``q [n_real, Hq, D]``, ``k [K, Hkv, D]``, ``v [K, Hkv, Dv]``
and return ``[n_real, Hq, Dv]``. :func:`blockdiag_attention` takes and returns the first
format for every kernel; the CP runtime packs straight into each kernel's own
(:mod:`.kernel_io`).

Kernels (CPU-capable ones in :mod:`.cpu_kernels`, GPU ones in :mod:`.gpu_kernels`):
    ``fa3``          FlashAttention-3 varlen (Hopper, fp16/bf16, no dropout).
    ``flash``        flash-attn 2 ``flash_attn_varlen_func`` (CUDA sm80+, fp16/bf16).
    ``te``           TransformerEngine ``DotProductAttention`` in THD format (CUDA, fp16/bf16).
    ``torch_varlen`` torch's ``varlen_attn`` (CUDA sm80+, fp16/bf16, no dropout).
    ``sdpa_varlen``  Any device/dtype: per-document PyTorch SDPA calls, equal-length
                     documents batched together; never builds an ``[L, S]`` mask.
    ``dense``        One PyTorch SDPA call with an explicit additive ``[n_real, K]`` mask.

``auto`` takes the first of :data:`AUTO_PREFERENCE` that can run; an explicit
kernel that cannot run raises :class:`KernelUnavailableError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nemo_automodel.components.distributed.blockdiag_cp import cpu_kernels, gpu_kernels, gpu_libraries, kernel_io
from nemo_automodel.components.distributed.blockdiag_cp.cpu_kernels import TORCH_SDPA, explicit_attention
from nemo_automodel.components.distributed.blockdiag_cp.gpu_libraries import GpuLibraries, KernelCall
from nemo_automodel.components.distributed.blockdiag_cp.kernel_io import KernelLayout
from nemo_automodel.components.distributed.blockdiag_cp.logs import log_once
from nemo_automodel.components.distributed.blockdiag_cp.metadata import (
    AttentionGroup,
    VarlenMeta,
    build_varlen_meta,
    build_window_plan,
    precompute_blockdiag_varlen_meta,
)
from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant

# Names importers of the former single-module kernels.py use (the seed's import paths).
__all__ = [
    "AUTO_PREFERENCE",
    "KERNELS",
    "TORCH_SDPA",
    "AttentionGroup",
    "KernelSpec",
    "KernelUnavailableError",
    "VarlenMeta",
    "attend_packed",
    "blockdiag_attention",
    "build_varlen_meta",
    "build_window_plan",
    "explicit_attention",
    "kernel_unavailable_reason",
    "precompute_blockdiag_varlen_meta",
    "select_kernel",
    "validate_qkv",
    "zeros_attached",
]

logger = logging.getLogger(__name__)


KernelFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, VarlenMeta, "float | None", float, AttentionVariant], torch.Tensor
]
# call -> why the kernel cannot take this call on any machine (head dims, dropout), or None
LimitsCheck = Callable[[KernelCall], "str | None"]
# (call, probed libraries and device) -> why this installation/GPU cannot run it, or None
EnvironmentCheck = Callable[[KernelCall, GpuLibraries], "str | None"]

_HALF = frozenset({torch.float16, torch.bfloat16})
_CUDA = frozenset({"cuda"})


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel needs to run.

    Attributes:
        name: Canonical ``attn_backend`` value.
        fn: The kernel (see the module docstring for the contract of each ``layout``).
        device_types: Devices it runs on (``None``: any).
        dtypes: Dtypes it accepts (``None``: any floating dtype).
        limits: Head-dim and dropout limits, true on every machine (checked first).
        environment: Package, version, build and GPU checks against the probed libraries.
        auto_skip: Why ``auto`` passes over the kernel although it could run.
        variant_problem: Why the kernel cannot express the call's :class:`AttentionVariant` (window,
            soft-cap, sinks), naming the feature; ``None``: it expresses every variant.
        layout: The format ``fn`` takes and returns: ``bhsd`` (``[1, H, n, D]``) or ``thd``
            (token-major ``[n, H, D]``, real rows only).
    """

    name: str
    fn: KernelFn
    device_types: frozenset[str] | None = None
    dtypes: frozenset[torch.dtype] | None = None
    limits: LimitsCheck | None = None
    environment: EnvironmentCheck | None = None
    auto_skip: EnvironmentCheck | None = None
    variant_problem: EnvironmentCheck | None = None
    layout: KernelLayout = "bhsd"


KERNELS: dict[str, KernelSpec] = {
    "fa3": KernelSpec(
        "fa3",
        gpu_kernels.fa3,
        _CUDA,
        _HALF,
        gpu_libraries.fa3_limits,
        gpu_kernels.fa3_environment,
        variant_problem=gpu_kernels.fa3_variant_problem,
        layout="thd",
    ),
    "flash": KernelSpec(
        "flash",
        gpu_kernels.flash,
        _CUDA,
        _HALF,
        gpu_libraries.flash_limits,
        gpu_kernels.flash_environment,
        variant_problem=gpu_kernels.flash_variant_problem,
        layout="thd",
    ),
    "te": KernelSpec(
        "te",
        gpu_kernels.te,
        _CUDA,
        _HALF,
        None,
        gpu_kernels.te_environment,
        gpu_kernels.te_auto_skip,
        variant_problem=gpu_kernels.te_variant_problem,
        layout="thd",
    ),
    "torch_varlen": KernelSpec(
        "torch_varlen",
        gpu_kernels.torch_varlen,
        _CUDA,
        _HALF,
        gpu_libraries.torch_varlen_limits,
        gpu_kernels.torch_varlen_environment,
        variant_problem=gpu_kernels.torch_varlen_variant_problem,
        layout="thd",
    ),
    "sdpa_varlen": KernelSpec("sdpa_varlen", cpu_kernels.sdpa_varlen),
    "dense": KernelSpec("dense", cpu_kernels.dense),
}

# `auto` takes the first kernel of this list that can run. Why this order (the
# docs/kernels.md; benchmarks/gpu_check.py measures it on a GPU):
# - fa3: FlashAttention-3 is the fastest varlen kernel on Hopper; it has no dropout
#   and runs only on sm90 here, so elsewhere (or with dropout) it is skipped.
# - flash: flash-attn 2, with dropout, on every GPU from Ampere on; it is also what
#   TE itself would call on sm8x.
# - te: cuDNN's fused attention on sm90+ (cuDNN >= 9.7); skipped when only TE's
#   unfused backend would serve, which materializes the padded scores.
# - torch_varlen: torch's bundled flash-attn 2 kernel, no extra package, no dropout.
# - sdpa_varlen: runs everywhere (per-document SDPA calls).
# `dense` is never picked: it scores every (query, needed key) pair with a mask.
AUTO_PREFERENCE: tuple[str, ...] = ("fa3", "flash", "te", "torch_varlen", "sdpa_varlen")


class KernelUnavailableError(ValueError):
    """An explicitly requested ``attn_backend`` cannot run here; never silently replaced."""

    def __init__(self, kernel: str, reason: str) -> None:
        super().__init__(
            f"attn_backend={kernel!r} cannot run here: {reason}. An explicit attn_backend is never replaced by "
            f"another kernel; fix the cause, or set attn_backend='auto' (first that runs of: "
            f"{', '.join(AUTO_PREFERENCE)})"
        )
        self.kernel = kernel
        self.reason = reason


def kernel_unavailable_reason(
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    head_dim: int | None = None,
    value_head_dim: int | None = None,
    dropout_p: float = 0.0,
    variant: AttentionVariant = PLAIN,
    libraries: GpuLibraries | None = None,
) -> str | None:
    """Why kernel ``name`` cannot run this call, or ``None``; launches nothing.

    Checks, in order: the attention variant (window, soft-cap, sinks) and the
    kernel's head-dim and dropout limits (true on any machine), the device type
    and dtype, then the installation and the GPU (libraries probed once: version,
    signature, build flags, compute capability, shared memory, cuDNN). Each
    reason says what to do about it.

    Args:
        name: Canonical kernel name.
        dtype: Query dtype.
        device: Query device.
        head_dim: Query/key head dimension ``D`` (``None``: not checked).
        value_head_dim: Value head dimension ``Dv`` (``None``: equal to ``D``).
        dropout_p: Attention dropout of the call.
        variant: The call's attention variant.
        libraries: The probed GPU libraries (``None``: :func:`.gpu_libraries.probe_gpu_libraries` of ``device``).
    """
    spec = KERNELS.get(name)
    if spec is None:
        return f"unknown attention kernel {name!r} (known: {', '.join(KERNELS)})"
    device = torch.device(device)
    call = KernelCall(dtype, head_dim, value_head_dim, dropout_p, variant)
    libs = lambda: libraries or gpu_libraries.probe_gpu_libraries(device)  # noqa: E731 (probed only when needed)
    if not variant.plain and spec.variant_problem is not None and (reason := spec.variant_problem(call, libs())):
        return reason
    if spec.limits is not None and (reason := spec.limits(call)) is not None:
        return reason
    if spec.device_types is not None and device.type not in spec.device_types:
        return (
            f"{name} needs device {'/'.join(sorted(spec.device_types))}, got {device}; "
            "use attn_backend='auto' or 'sdpa_varlen' on this device"
        )
    if spec.dtypes is not None and dtype not in spec.dtypes:
        return f"{name} needs dtype {'/'.join(sorted(str(d) for d in spec.dtypes))}, got {dtype}; cast q/k/v"
    if spec.environment is not None:
        return spec.environment(call, libs())
    return None


def select_kernel(
    requested: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    head_dim: int | None = None,
    value_head_dim: int | None = None,
    dropout_p: float = 0.0,
    variant: AttentionVariant = PLAIN,
    libraries: GpuLibraries | None = None,
) -> str:
    """The concrete kernel for a call.

    ``auto`` resolves to the first kernel of :data:`AUTO_PREFERENCE` that can
    run; the decision and why each earlier kernel was skipped are logged once.

    Args:
        requested: Canonical ``attn_backend`` (``auto`` or a kernel name).
        dtype: Query dtype.
        device: Query device.
        head_dim: Query/key head dimension ``D``.
        value_head_dim: Value head dimension ``Dv`` (``None``: equal to ``D``).
        dropout_p: Attention dropout of the call.
        variant: The call's attention variant (a kernel that cannot express it is skipped by ``auto``).
        libraries: The probed GPU libraries (``None``: probed for ``device``, once per process).

    Raises:
        KernelUnavailableError: when an explicitly requested kernel cannot run
            (it is never replaced by another one).
    """
    device = torch.device(device)
    call = {"head_dim": head_dim, "value_head_dim": value_head_dim, "dropout_p": dropout_p, "variant": variant}
    if requested != "auto":
        reason = kernel_unavailable_reason(requested, dtype, device, **call, libraries=libraries)
        if reason is not None:
            raise KernelUnavailableError(requested, reason)
        if requested == "te":
            gpu_kernels.warn_if_te_auto_skipped(
                KernelCall(dtype, head_dim, value_head_dim, dropout_p, variant),
                libraries or gpu_libraries.probe_gpu_libraries(device),
            )
        return requested
    skipped = []
    for name in AUTO_PREFERENCE:
        spec = KERNELS[name]
        reason = kernel_unavailable_reason(name, dtype, device, **call, libraries=libraries)
        if reason is None and spec.auto_skip is not None:
            libs = libraries or gpu_libraries.probe_gpu_libraries(device)
            reason = spec.auto_skip(KernelCall(dtype, head_dim, value_head_dim, dropout_p, variant), libs)
        if reason is None:
            features = ", ".join(variant.features()) or "plain causal"
            dims = f"head_dim={head_dim}" + (f"/{value_head_dim}" if value_head_dim not in (None, head_dim) else "")
            decision = f"attn_backend=auto -> {name} ({dtype} on {device}, {dims}, dropout_p={dropout_p}, {features})"
            if skipped:
                decision += "; skipped " + "; ".join(skipped)
            log_once(logger, f"kernel-auto:{decision}", logging.INFO, "%s", decision)
            return name
        skipped.append(f"{name}: {reason}")
    raise AssertionError("sdpa_varlen runs everywhere")  # pragma: no cover


def validate_qkv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    enable_gqa: bool,
    local_len: int,
    variant: AttentionVariant = PLAIN,
) -> None:
    """Reject q/k/v (and sinks) that the CP path cannot attend correctly, naming the field and the fix.

    The value head dim may differ from the query/key head dim (MLA models such as DeepSeek-V3).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"block-diagonal attention: {name} must be [B, H, L, D], got shape {tuple(t.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"block-diagonal attention: query/key/value dtypes differ ({query.dtype}, {key.dtype}, "
            f"{value.dtype}); cast them to one dtype"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"block-diagonal attention: query/key/value are on different devices ({query.device}, "
            f"{key.device}, {value.device})"
        )
    if query.shape[3] != key.shape[3]:
        raise ValueError(
            f"block-diagonal attention: query head dim {query.shape[3]} differs from key head dim {key.shape[3]}; "
            "scores need equal query/key head dims (the value head dim may differ)"
        )
    if not (query.shape[0] == key.shape[0] == value.shape[0] == 1):
        raise ValueError(
            f"block-diagonal attention: batch sizes must all be 1 (one packed row per rank), got "
            f"{query.shape[0]}/{key.shape[0]}/{value.shape[0]}"
        )
    if key.shape[1] != value.shape[1]:
        raise ValueError(f"block-diagonal attention: key has {key.shape[1]} heads but value has {value.shape[1]}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"block-diagonal attention: query heads ({query.shape[1]}) must be a multiple of key/value "
            f"heads ({key.shape[1]})"
        )
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"block-diagonal attention: {query.shape[1]} query heads vs {key.shape[1]} key/value heads "
            "needs enable_gqa=True (or repeat K/V before the call)"
        )
    if variant.sinks is not None and (
        tuple(variant.sinks.shape) != (query.shape[1],) or variant.sinks.device != query.device
    ):
        raise ValueError(
            f"block-diagonal attention: {variant.describe('s_aux (attention sinks)')} has shape "
            f"{tuple(variant.sinks.shape)} on {variant.sinks.device}; expected one logit per query head, "
            f"[{query.shape[1]}] on {query.device}"
        )
    if not (query.shape[2] == key.shape[2] == value.shape[2] == local_len):
        raise ValueError(
            f"block-diagonal attention: sequence lengths {query.shape[2]}/{key.shape[2]}/{value.shape[2]} "
            f"must equal this rank's local length {local_len}; shard the batch with "
            "make_cp_blockdiag_batch_and_ctx"
        )


class _ZeroAttached(torch.autograd.Function):
    """Zeros ``[..., width]`` shaped like the first input but for the last dim, whose graph still reaches
    every input (with zero gradients).

    Padding rows launch no kernel, but their output stays connected to the
    inputs so gradients are defined (zero) everywhere and, on an all-padding
    rank, the exchange's backward collective still runs. Unlike ``0 * x`` this
    cannot turn into NaN.
    """

    @staticmethod
    def forward(ctx: Any, like: torch.Tensor, width: int, *deps: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in (like, *deps)]
        return like.new_zeros(*like.shape[:-1], width)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes]
        return zeros[0], None, *zeros[1:]


def zeros_attached(like: torch.Tensor, *deps: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Zeros shaped like ``like`` (last dim ``width``, default ``like``'s), with zero gradient to ``like`` and ``deps``.

    ``width`` is the value head dim when it differs from the query's (MLA models).
    """
    return _ZeroAttached.apply(like, like.shape[-1] if width is None else width, *deps)


def blockdiag_attention(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:
    """Run ``kernel`` on one rank's local queries and packed keys, in and out of ``[1, H, n, D]``.

    Args:
        kernel: A concrete kernel name from :data:`KERNELS`.
        q: Local queries ``[1, Hq, L, D]``.
        k: Packed keys ``[1, Hkv, K, D]`` (``K == meta.kv_len``).
        v: Packed values ``[1, Hkv, K, Dv]`` (``Dv`` may differ from ``D``: MLA models).
        meta: This rank's :class:`VarlenMeta`.
        scale: Softmax scale (``None``: ``D ** -0.5``).
        dropout_p: Attention dropout probability.
        variant: Soft-cap and sinks of the call (the window is ``meta.window``: the
            keys were selected for it).

    Returns:
        ``[1, Hq, L, Dv]``; padding rows are zero.
    """
    _check_window(meta, variant)
    if meta.n_real == 0:
        return zeros_attached(q, k, v, *variant.tensors, width=v.shape[3])
    spec = KERNELS[kernel]
    if spec.layout == "bhsd":
        return attend_packed(kernel, q, k, v, meta, scale, dropout_p, variant)
    (q_packed,), padding = kernel_io.query_parts(q, [(0, meta.n_real)], meta.n_real, "thd")
    out = attend_packed(kernel, q_packed, kernel_io.packed(k), kernel_io.packed(v), meta, scale, dropout_p, variant)
    shape = (meta.local_len, q.shape[1], v.shape[3])
    return kernel_io.unpack([out], [(0, meta.n_real)], "thd", q, shape, padding, *variant.tensors)


def attend_packed(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:
    """Run ``kernel`` on q/k/v already in its format (:attr:`KernelSpec.layout`); ``meta.n_real > 0``."""
    _check_window(meta, variant)
    return KERNELS[kernel].fn(q, k, v, meta, scale, dropout_p, variant)


def _check_window(meta: VarlenMeta, variant: AttentionVariant) -> None:
    if meta.window != variant.window:
        raise ValueError(f"internal error: metadata for window {meta.window} used for window {variant.window}")

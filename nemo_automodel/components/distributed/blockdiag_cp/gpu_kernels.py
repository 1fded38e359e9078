"""GPU varlen kernels: one library call (or, for the boundary guard, a few) per group of segments.

Each kernel takes the libraries' own token-major (THD) format: the real queries
``q [n_real, Hq, D]`` (possibly a strided view: the kernel packs them with at most one
copy, straight into the rows it launches) and packed keys/values ``k [K, Hkv, D]``,
``v [K, Hkv, Dv]`` (contiguous) described by a :class:`~.metadata.VarlenMeta`, and returns the output
``[n_real, Hq, Dv]`` as row pieces (:data:`Pieces`: one per library call, in row order),
which the caller writes once to where the model reads them (:mod:`.kernel_io`).
What each library can run is decided in :mod:`.gpu_libraries` from facts probed once;
the functions here adapt those rules to the registry (:data:`~.kernels.KERNELS`) and
call the libraries through the probed functions.

``flash``         flash-attn 2 (>= 2.6.2) ``flash_attn_varlen_func``/``flash_attn_func``, ``causal=True``.
``fa3``           FlashAttention-3 (``flash_attn_interface``), the same calls without dropout; Hopper.
``te``            TransformerEngine ``DotProductAttention`` in THD format with
                  ``padding_causal_bottom_right`` and ``attention_type="cross"`` (see :func:`te`).
``torch_varlen``  ``torch.nn.attention.varlen.varlen_attn`` (torch's bundled flash-attn 2): no extra
                  package, no dropout.

All of them align causal masks bottom-right, and none launches a varlen call
over a segment with more keys than queries (upstream's boundary guard; see
:func:`boundary_guarded`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from nemo_automodel.components.distributed.blockdiag_cp import gpu_libraries as libs_
from nemo_automodel.components.distributed.blockdiag_cp.gpu_libraries import (
    GpuLibraries,
    KernelCall,
    probe_gpu_libraries,
)
from nemo_automodel.components.distributed.blockdiag_cp.logs import log_once
from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant

if TYPE_CHECKING:
    from nemo_automodel.components.distributed.blockdiag_cp.metadata import VarlenMeta

logger = logging.getLogger(__name__)

# Torch's SDPA, captured before anything in this package can patch it (the straddling
# segments of torch_varlen go through it with a bottom-right causal bias).
_TORCH_SDPA = F.scaled_dot_product_attention


def reset_caches() -> None:
    """Forget every probe, TE module and per-call verdict (tests that swap packages in and out)."""
    libs_.reset_probes()
    _TE_MODULES.clear()
    _VERDICTS.clear()


# Host verdicts every layer of a step would otherwise recompute (variant re-checks, TE's backend):
# (what, kernel, the call's facts, the libraries) -> the verdict.
_VERDICTS: dict[tuple[Any, ...], Any] = {}


def _once(what: str, kernel: str, call: KernelCall, libs: GpuLibraries, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per kind of verdict, kernel, call shape, variant and probed libraries."""
    v = call.variant
    shape = (call.dtype, call.head_dim, call.value_head_dim, call.dropout_p)
    key = (what, kernel, shape, v.window, v.chunk, v.softcap, v.sinks is not None, v.source, libs)
    if key not in _VERDICTS:
        _VERDICTS[key] = compute()
    return _VERDICTS[key]


# ---------------------------------------------------------------------------
# Registry adapters: what the kernel registry asks of each GPU kernel
# ---------------------------------------------------------------------------


def variant_feature_kinds(variant: AttentionVariant) -> list[tuple[str, str]]:
    """``(kind, user-facing name)`` of each feature of ``variant``: ``window``, ``chunk``, ``softcap``, ``sinks``.

    A chunk is in the plan's segments (documents re-cut into chunks), so no kernel has a gap for it.
    """
    kinds = [
        kind
        for kind, present in (
            ("window", variant.window is not None),
            ("chunk", variant.chunk is not None),
            ("softcap", variant.softcap is not None),
            ("sinks", variant.sinks is not None),
        )
        if present
    ]
    names = variant.features()  # same order: window, chunk, softcap, sinks
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


def flash_variant_problem(call: KernelCall, libs: GpuLibraries) -> str | None:
    """Which feature flash-attn 2 cannot compute; soft-capping has no dropout (``flash_api.cpp``)."""
    variant = call.variant
    if variant.softcap is not None and call.dropout_p > 0:
        return (
            f"{variant.describe(f'softcap={variant.softcap}')} with dropout_p={call.dropout_p} is not supported by "
            "attn_backend=flash: flash-attn's soft-capping has no dropout; use dropout_p=0, attn_backend='auto' "
            "or 'sdpa_varlen'"
        )
    if variant.sinks is not None and (call.dropout_p > 0 or (call.head_dim or 8) % 8):
        # the private pair takes no rng_state from us, and from 2.7.0 pads no head dim (the public functions do)
        return (
            f"{variant.describe('s_aux (attention sinks)')} with dropout_p={call.dropout_p} and head_dim="
            f"{call.head_dim} is not supported by attn_backend=flash: sinks run without dropout on head dims that "
            "are multiples of 8; use attn_backend='auto' or 'sdpa_varlen'"
        )
    return variant_problem("flash", variant, libs_.flash_gaps(libs.flash))


def fa3_variant_problem(call: KernelCall, libs: GpuLibraries) -> str | None:
    """Which feature the FA3 build cannot compute (its parameters and build flags)."""
    return variant_problem("fa3", call.variant, libs_.fa3_gaps(libs.fa3))


def te_variant_problem(call: KernelCall, libs: GpuLibraries) -> str | None:
    """Which feature TransformerEngine cannot compute."""
    return variant_problem("te", call.variant, libs_.te_gaps(libs.te))


def torch_varlen_variant_problem(call: KernelCall, libs: GpuLibraries) -> str | None:
    """Which feature torch's ``varlen_attn`` cannot compute."""
    return variant_problem("torch_varlen", call.variant, libs_.torch_varlen_gaps(libs.torch_varlen))


def flash_environment(call: KernelCall, libs: GpuLibraries) -> str | None:
    """flash-attn 2 installed, >= 2.6.2 and able to run the call on this GPU."""
    return libs_.flash_problem(libs.flash, libs.device, call)


def fa3_environment(call: KernelCall, libs: GpuLibraries) -> str | None:
    """The FA3 build callable with our arguments, built with what the call needs, on Hopper."""
    return libs_.fa3_problem(libs.fa3, libs.device, call)


def te_environment(call: KernelCall, libs: GpuLibraries) -> str | None:
    """TransformerEngine importable, buildable for the head dims, with a backend that serves the call."""
    return libs_.te_problem(libs.te, libs.device, call)


def torch_varlen_environment(call: KernelCall, libs: GpuLibraries) -> str | None:
    """torch's ``varlen_attn`` with the parameters we pass, built with flash, on a GPU its kernel runs on."""
    return libs_.torch_varlen_problem(libs.torch_varlen, libs.device)


def te_auto_skip(call: KernelCall, libs: GpuLibraries) -> str | None:
    """Why ``auto`` passes over ``te`` although it could run (see :func:`.gpu_libraries.te_auto_problem`)."""
    return libs_.te_auto_problem(libs.te, libs.device, call)


def warn_if_te_auto_skipped(call: KernelCall, libs: GpuLibraries) -> None:
    """An explicit ``te`` runs even where ``auto`` would pass it over; say why once."""
    problem = te_auto_skip(call, libs)
    if problem is not None:
        log_once(
            logger,
            f"te-explicit:{problem}",
            logging.WARNING,
            "attn_backend=te: %s; it runs as asked. attn_backend='auto' would pick another kernel here.",
            problem,
        )


# ---------------------------------------------------------------------------
# Layout helpers and the boundary guard
# ---------------------------------------------------------------------------


def _first(result: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The output of a call that returns either ``out`` or ``(out, softmax_lse, ...)``."""
    return result[0] if isinstance(result, tuple | list) else result


@dataclass(frozen=True)
class BoundaryPiece:
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


def boundary_pieces(meta: VarlenMeta) -> list[BoundaryPiece]:
    """Split a group into its straddling segments (one piece each) and runs of square segments.

    Host-only: built from ``meta.q_lens``/``k_lens``, no device access.
    """
    pieces: list[BoundaryPiece] = []
    for i, (q0, q_len, k0, k_len) in enumerate(meta.segments()):
        straddles = k_len > q_len
        last = pieces[-1] if pieces else None
        if last is not None and not straddles and not last.straddles:
            merged = BoundaryPiece(
                last.first, i + 1, False, (last.q[0], q0 + q_len), (last.k[0], k0 + k_len), last.max_len
            )
            pieces[-1] = replace(merged, max_len=max(last.max_len, q_len))
        else:
            pieces.append(BoundaryPiece(i, i + 1, straddles, (q0, q0 + q_len), (k0, k0 + k_len), k_len))
    return pieces


# (q [q, Hq, D], k [k, Hkv, D], v [k, Hkv, Dv]) -> [q, Hq, Dv], bottom-right causal, one segment
FixedCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> [n, Hq, Dv]
VarlenCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]


Pieces = tuple[torch.Tensor, ...]
"""A kernel's output rows ``[n_i, Hq, Dv]``, in row order: together the ``[n_real, Hq, Dv]`` output."""


def boundary_guarded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMeta, fixed: FixedCall, varlen: VarlenCall
) -> Pieces:
    """Attend ``q [n_real, Hq, D]`` over ``k/v [K, Hkv, D|Dv]`` with no varlen launch over a segment with k > q.

    Upstream (NVIDIA-NeMo/Automodel ``_flash_varlen_with_long_prefix_guard``) saw
    some FlashAttention builds raise an asynchronous illegal memory access on
    varlen launches whose first segment has more keys than queries, which
    poisons the CUDA context. Like upstream, every such segment goes through a
    fixed-length call (same bottom-right causal layout, no ``cu_seqlens``); the
    square segments between them stay in varlen calls whose offsets are
    device-side slices of ``cu_q`` (no host sync). A group without a straddling
    segment is one varlen call. Each call's output is one piece (never concatenated here).
    """
    pieces = guarded_pieces(meta)
    if not any(p.straddles for p, _ in pieces):
        return (varlen(q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k),)
    outs = []
    for p, cu in pieces:
        qs, ks, vs = q[p.q[0] : p.q[1]], k[p.k[0] : p.k[1]], v[p.k[0] : p.k[1]]
        if cu is None:  # a straddling segment
            outs.append(fixed(qs, ks, vs))
        else:  # square segments: one offset tensor indexes queries and keys
            outs.append(varlen(qs, ks, vs, cu, cu, p.max_len, p.max_len))
    return tuple(outs)


def guarded_pieces(meta: VarlenMeta) -> tuple[tuple[BoundaryPiece, torch.Tensor | None], ...]:
    """:func:`boundary_pieces` with each square run's ``cu_seqlens`` (a device slice), built once per metadata."""
    found = meta._derived.get("guarded_pieces")
    if found is None:
        found = tuple(
            (p, None if p.straddles else meta.cu_q[p.first : p.stop + 1] - meta.cu_q[p.first])
            for p in boundary_pieces(meta)
        )
        meta._derived["guarded_pieces"] = found
    return found


def flash_window(window: int | None) -> tuple[int, int]:
    """Our window ``W`` (``W`` keys, the query's own included) as flash-attn's ``(left, right)``; ``None``: causal."""
    return (-1, 0) if window is None else (window - 1, 0)


def _require(problem: str | None) -> None:
    """Selection already refused what a kernel cannot compute; a direct call still never drops a feature."""
    if problem is not None:
        raise ValueError(problem)


def _checked_libraries(
    kernel: str,
    q: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    variant: AttentionVariant,
    variant_check: Callable[[KernelCall, GpuLibraries], str | None],
    takes_dropout: bool = True,
) -> tuple[GpuLibraries, KernelCall, Any]:
    """The probed libraries, the call's facts and ``kernel``'s library facts (``libs.<kernel>``), once it can run.

    Re-checks, as the registry did: the variant (its verdict memoized per call shape), the kernel's
    dropout support, then the library's installation problem.
    """
    libs = probe_gpu_libraries(q.device)
    call = _call_of(q, v, dropout_p, variant)
    _require(None if variant.plain else _once("variant", kernel, call, libs, lambda: variant_check(call, libs)))
    if not takes_dropout and dropout_p > 0:
        raise ValueError(f"{kernel} has no dropout; attn_backend='{kernel}' needs dropout_p=0")
    facts = getattr(libs, kernel)  # GpuLibraries names each library's facts after its kernel
    _require(facts.problem)
    return libs, call, facts


def _call_of(q: torch.Tensor, v: torch.Tensor, dropout_p: float, variant: AttentionVariant) -> KernelCall:
    return KernelCall(q.dtype, q.shape[-1], v.shape[-1], dropout_p, variant)


# ---------------------------------------------------------------------------
# flash-attn 2 and FlashAttention-3: one wrapper
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FlashFunctions:
    """A flash-attn family library: its fixed-length and varlen functions, and whether they take dropout."""

    fixed: Callable[..., Any]
    varlen: Callable[..., Any]
    takes_dropout: bool
    lse: libs_.FlashLse | libs_.Fa3Lse | None = None  # the library's private forward/backward pair, for sinks


def _flash_family(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant,
    functions: FlashFunctions,
) -> Pieces:
    """``causal=True`` (bottom-right) calls of flash-attn 2 or FA3, boundary-guarded.

    Only keywords after q/k/v: FA3's positional order changed between builds.
    Calls that return ``(out, softmax_lse)`` (FA3 before 2025-07-11) and ``out``
    are both accepted. A window is ``window_size=(W - 1, 0)`` and a soft-cap
    ``softcap=c``; plain calls pass neither (older builds lack them).
    """
    if variant.sinks is not None:
        assert functions.lse is not None  # the variant check refused the call otherwise
        scale = q.shape[2] ** -0.5 if scale is None else scale
        call = _LseCall(functions.lse, meta, scale, flash_window(meta.window), float(variant.softcap or 0.0))
        return (_FlashSinks.apply(q, k, v, variant.sinks, call),)
    options: dict[str, Any] = {"softmax_scale": scale, "causal": True}
    if functions.takes_dropout:
        options["dropout_p"] = dropout_p
    if meta.window is not None:
        options["window_size"] = flash_window(meta.window)
    if variant.softcap is not None:
        options["softcap"] = float(variant.softcap)

    def fixed(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        return _first(functions.fixed(qs[None], ks[None], vs[None], **options))[0]

    def varlen(
        qs: torch.Tensor,
        ks: torch.Tensor,
        vs: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
    ) -> torch.Tensor:
        seqlens = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k}
        return _first(functions.varlen(qs, ks, vs, **seqlens, **options))

    return boundary_guarded(q.contiguous(), k, v, meta, fixed, varlen)


@dataclass(frozen=True)
class _LseCall:
    """One group's calls of a private pair (:class:`.gpu_libraries.FlashLse`, :class:`.gpu_libraries.Fa3Lse`)."""

    lse: libs_.FlashLse | libs_.Fa3Lse
    meta: VarlenMeta
    scale: float
    window: tuple[int, int]
    softcap: float

    def pieces(self) -> tuple[tuple[BoundaryPiece, tuple[torch.Tensor, torch.Tensor, int, int] | None], ...]:
        """Each piece of :func:`guarded_pieces` with its varlen ``seqlens`` (``None``: a straddling segment, one
        fixed-length call); a group without a straddling segment is one varlen piece."""
        meta = self.meta
        pieces = guarded_pieces(meta)
        if not any(p.straddles for p, _ in pieces):
            whole = BoundaryPiece(0, len(meta.q_lens), False, (0, meta.n_real), (0, meta.kv_len), meta.max_k)
            return ((whole, (meta.cu_q, meta.cu_k, meta.max_q, meta.max_k)),)
        return tuple((p, None if cu is None else (cu, cu, p.max_len, p.max_len)) for p, cu in pieces)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, piece: Any) -> tuple[torch.Tensor, ...]:
        """``(out [q, Hq, Dv], lse [Hq, q])`` of one piece."""
        (p, seqlens), options = piece, (self.scale, self.window, self.softcap)
        qs, ks, vs = q[p.q[0] : p.q[1]], k[p.k[0] : p.k[1]], v[p.k[0] : p.k[1]]
        if seqlens is not None:
            return self.lse.forward(qs, ks, vs, seqlens, *options)
        out, lse = self.lse.forward(qs[None], ks[None], vs[None], None, *options)  # [1, s, H, D], lse [1, Hq, s]
        return out[0], lse[0]

    def backward(self, tensors: tuple[torch.Tensor, ...], lse: torch.Tensor, piece: Any) -> None:
        """Write one piece's ``dq, dk, dv`` (the last three of ``tensors = (dout, q, k, v, out, dq, dk, dv)``)."""
        (p, seqlens), options = piece, (self.scale, self.window, self.softcap)
        rows, keys = slice(*p.q), slice(*p.k)
        dout, q, k, v, out, dq, dk, dv = tensors
        parts = (dout[rows], q[rows], k[keys], v[keys], out[rows], lse[:, rows].contiguous())
        grads = (dq[rows], dk[keys], dv[keys])
        if seqlens is not None:
            self.lse.backward((*parts, *grads), seqlens, *options)
        else:
            fixed = (*(t[None] for t in parts[:5]), parts[5][None], *(t[None] for t in grads))
            self.lse.backward(fixed, None, *options)


class _FlashSinks(torch.autograd.Function):
    """flash-attn 2 or FA3 with sinks ``[Hq]``: ``q [n, Hq, D]`` over ``k/v [K, Hkv, D]`` -> ``[n, Hq, D]``.

    Each piece's sink-free output is scaled by ``a = sigmoid(lse - sink)``; backward calls the private
    backward with ``a * dout`` and the scaled output (the algebra of :class:`.cpu_kernels._LseAttention`),
    and the sink's gradient is ``-sum (1 - a) (dout . out)``. Segments with earlier keys still go through
    fixed-length calls (:func:`boundary_guarded`).
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, call: _LseCall
    ) -> torch.Tensor:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        # [Hq, n]; fp32 from the real kernels (fp16/bf16 only), wider with the float64 stand-ins
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        for piece in call.pieces():
            rows = slice(*piece[0].q)
            out[rows], lse[:, rows] = call.forward(q, k, v, piece)
        scaled = (out * _sink_share(lse, sinks)).to(q.dtype)
        ctx.save_for_backward(q, k, v, scaled, lse, sinks)
        ctx.call = call
        return scaled

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        share = _sink_share(lse, sinks)  # [n, Hq, 1]
        d_sinks = -((1 - share[..., 0]) * (grad.to(share.dtype) * out).sum(-1)).sum(0).to(sinks.dtype)
        grad = (grad * share).to(q.dtype).contiguous()
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for piece in ctx.call.pieces():
            ctx.call.backward((grad, q, k, v, out, dq, dk, dv), lse, piece)
        return dq, dk, dv, d_sinks, None


def _sink_share(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``sigmoid(lse - sink)`` as ``[n, Hq, 1]`` from ``lse [Hq, n]``: the share of each row's mass its keys keep."""
    return torch.sigmoid(lse - sinks.to(lse.dtype)[:, None]).t()[..., None]


def _flash_library(
    library: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant,
) -> Pieces:
    """``flash`` or ``fa3``: the probed library's functions through :func:`_flash_family`, features re-checked."""
    flash_2 = library == "flash"
    variant_check = flash_variant_problem if flash_2 else fa3_variant_problem
    *_, facts = _checked_libraries(library, q, v, dropout_p, variant, variant_check, takes_dropout=flash_2)
    functions = FlashFunctions(facts.fixed, facts.varlen, takes_dropout=flash_2, lse=facts.lse)
    return _flash_family(q, k, v, meta, scale, dropout_p, variant, functions)


def flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant = PLAIN,
) -> Pieces:
    """flash-attn 2: ``flash_attn_varlen_func`` with ``causal=True`` (bottom-right), boundary-guarded."""
    return _flash_library("flash", q, k, v, meta, scale, dropout_p, variant)


def fa3(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant = PLAIN,
) -> Pieces:
    """FlashAttention-3 varlen with ``causal=True`` (bottom-right), boundary-guarded like ``flash``."""
    return _flash_library("fa3", q, k, v, meta, scale, dropout_p, variant)


# ---------------------------------------------------------------------------
# torch's varlen_attn
# ---------------------------------------------------------------------------


def torch_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    scale: float | None,
    dropout_p: float,
    variant: AttentionVariant = PLAIN,
) -> Pieces:
    """torch's ``varlen_attn``; causal is ``window_size=(-1, 0)`` (it sets ``is_causal = window_size == (-1, 0)``).

    The bundled flash kernel aligns causal masks bottom-right, as flash-attn 2 does; a window
    ``W`` is ``window_size=(W - 1, 0)``. ``enable_gqa`` is passed where ``varlen_attn`` has it
    (torch >= 2.12 raises for ``Hq != Hkv`` without it; 2.11's kernel takes GQA as is).
    Segments with earlier keys never enter a varlen launch (:func:`boundary_guarded`): plain
    ones go through SDPA with a bottom-right causal bias (torch's fixed-length flash kernel),
    windowed ones are made square by :func:`_square_windowed`.
    """
    check = torch_varlen_variant_problem
    libs, _, _ = _checked_libraries("torch_varlen", q, v, dropout_p, variant, check, takes_dropout=False)
    gqa = q.shape[1] != k.shape[1]
    options: dict[str, Any] = {
        "scale": scale,
        "window_size": flash_window(meta.window),
    }  # a tuple: compared with (-1, 0)
    if gqa and "enable_gqa" in libs.torch_varlen.parameters:
        options["enable_gqa"] = True

    def varlen(
        qs: torch.Tensor,
        ks: torch.Tensor,
        vs: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
    ) -> torch.Tensor:
        return libs.torch_varlen.function(qs, ks, vs, cu_q, cu_k, max_q, max_k, **options)

    def fixed(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        bias = causal_lower_right(qs.shape[0], ks.shape[0])  # SDPA dispatches it to the fixed-length flash kernel
        to_bhsd = lambda x: x.transpose(0, 1)[None]  # noqa: E731
        out = _TORCH_SDPA(to_bhsd(qs), to_bhsd(ks), to_bhsd(vs), attn_mask=bias, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)

    if meta.window is not None:
        return _square_windowed(q, k, v, meta, varlen)
    return boundary_guarded(q.contiguous(), k, v, meta, fixed, varlen)


@dataclass(frozen=True)
class SquareRows:
    """Where a windowed group's rows sit once every segment is made square (built once per metadata).

    Attributes:
        real: Position of each real query row in the square layout ``[n_real]`` (device).
        total: Rows of the square layout (``sum(k_lens)``).
        runs: ``(start, stop)`` runs of real rows in the square layout, in row order: the output pieces.
    """

    real: torch.Tensor
    total: int
    runs: tuple[tuple[int, int], ...]


def square_rows(meta: VarlenMeta) -> SquareRows:
    """The :class:`SquareRows` of ``meta``, computed on its first use and kept with it."""
    found = meta._derived.get("square_rows")
    if found is None:
        runs: list[tuple[int, int]] = []
        for _, q_len, k0, k_len in meta.segments():
            start = k0 + k_len - q_len
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], k0 + k_len)
            else:
                runs.append((start, k0 + k_len))
        real = torch.cat([torch.arange(a, b) for a, b in runs]).to(meta.cu_k.device)
        found = meta._derived["square_rows"] = SquareRows(real, meta.kv_len, tuple(runs))
    return found


def _square_windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMeta, varlen: VarlenCall) -> Pieces:
    """One varlen call over square segments: each segment's ``k - q`` earlier keys get zero query rows.

    Windowed segments keep at most ``W - 1`` keys before their first row, so the
    dummy rows cost at most ``W - 1`` rows per segment. In a square segment row
    ``r`` sees keys ``[r - W + 1, r]``; the real row ``a`` sits at ``r = k - q + a``,
    its bottom-right window. Dummy rows' outputs are dropped, so their gradient is
    zero and they contribute nothing to dK/dV. The real rows go in with one
    ``index_copy`` (from a strided ``q`` too: the query's only pack) and come out as
    views (one piece per run of real rows).
    """
    if all(q_len == k_len for q_len, k_len in zip(meta.q_lens, meta.k_lens)):
        return (varlen(q.contiguous(), k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k),)
    rows = square_rows(meta)
    square = q.new_zeros(rows.total, *q.shape[1:]).index_copy_(0, rows.real, q)
    out = varlen(square, k, v, meta.cu_k, meta.cu_k, meta.max_k, meta.max_k)
    return tuple(out[a:b] for a, b in rows.runs)


# ---------------------------------------------------------------------------
# TransformerEngine
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TEModuleKey:
    """One configuration of TE's ``DotProductAttention`` (modules are built once per key and cached).

    ``qkv_format="thd"`` is our varlen call (``padding_causal_bottom_right``);
    ``"bshd"`` the fixed-length call of the boundary guard (``causal_bottom_right``).
    """

    heads: int
    kv_heads: int
    head_dim: int
    value_head_dim: int
    scale: float | None
    dropout_p: float
    device: str
    window: int | None
    qkv_format: str = "thd"


_TE_MODULES: dict[TEModuleKey, torch.nn.Module] = {}


def te_module(key: TEModuleKey, libs: GpuLibraries) -> torch.nn.Module:
    """The cached TransformerEngine ``DotProductAttention`` for ``key`` (built on first use)."""
    module = _TE_MODULES.get(key)
    if module is None:
        same = key.head_dim == key.value_head_dim
        module = libs.te.dot_product_attention(
            num_attention_heads=key.heads,
            # a value head dim of its own goes in as (D, Dv) (TE >= 1.10); an int means both
            kv_channels=key.head_dim if same else (key.head_dim, key.value_head_dim),
            num_gqa_groups=key.kv_heads,
            attention_dropout=key.dropout_p,
            qkv_format=key.qkv_format,
            # a rank's rows are the suffix of their document's keys
            attn_mask_type="padding_causal_bottom_right" if key.qkv_format == "thd" else "causal_bottom_right",
            # "self" (the default) makes TE's unfused backend build the key padding mask
            # from cu_seqlens_q: top-left over the first q keys when max_k == max_q, a
            # broadcast error when max_k > max_q. "cross" masks keys with cu_seqlens_kv.
            attention_type="cross",
            softmax_scale=key.scale,
            # only for a window: TE then aligns it bottom-right per sequence (get_full_mask,
            # padding_causal_bottom_right: [i + skv - sq - left, i + skv - sq]); None is plain causal
            **({} if key.window is None else {"window_size": flash_window(key.window)}),
        ).to(key.device)
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
) -> Pieces:
    """TransformerEngine THD attention, ``padding_causal_bottom_right``, ``attention_type="cross"``.

    ``max_seqlen`` goes in rounded up to a multiple of 64 (:func:`.gpu_libraries.te_round_seqlen`).
    Where TE would run a flash-attn kernel, segments with earlier keys go through a
    ``bshd``/``causal_bottom_right`` module of their own (TE's fixed-length flash call), as
    the boundary guard does for ``flash``. A window ``W`` is the modules' ``window_size=(W - 1, 0)``.
    """
    libs, call, _ = _checked_libraries("te", q, v, dropout_p, variant, te_variant_problem)
    key = TEModuleKey(q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale, dropout_p, str(q.device), meta.window)
    heads = q.shape[1]

    def varlen(
        qs: torch.Tensor,
        ks: torch.Tensor,
        vs: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
    ) -> torch.Tensor:
        max_q, max_k = libs_.te_round_seqlen(max_q), libs_.te_round_seqlen(max_k)
        out = te_module(key, libs)(
            qs, ks, vs, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k
        )
        return out.view(out.shape[0], heads, -1)

    def fixed(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        out = te_module(replace(key, qkv_format="bshd"), libs)(qs[None], ks[None], vs[None])
        return out.view(qs.shape[0], heads, -1)

    q = q.contiguous()
    if _once("guard", "te", call, libs, lambda: libs_.te_guards_boundaries(libs.te, libs.device, call)):
        return boundary_guarded(q, k, v, meta, fixed, varlen)
    return (varlen(q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k),)

"""The ``cp_size == 1`` packed path: stock SDPA calls of a packed row run block-diagonal.

For models that call ``torch.nn.functional.scaled_dot_product_attention``
directly. Two pieces:

1. :func:`attach_cp1_packed_varlen_hooks` registers a forward pre/post hook pair
   on every attention module. While (and only while) one of those forwards runs,
   ``F.scaled_dot_product_attention`` is :func:`packed_varlen_sdpa`; the post
   hook (``always_call=True``) restores the previous function even when the
   forward raises. Hooks sit on the checkpoint-wrapped inner module, so they
   also fire during activation-checkpoint recompute.
2. :func:`enable_cp1_packed_varlen` arms the document ids of the current row.
   The armed state deliberately outlives the forward: backward's recompute
   must see the same documents. Call :func:`disable_cp1_packed_varlen` before
   the next row (or keep calling ``enable`` with the next row's ids).

Any SDPA call whose shapes do not match the armed row passes straight through
to torch's SDPA, so vision towers or unpacked attention are unaffected (the policy
shared with ``cp_blockdiag_sdpa`` outside a row: :mod:`.outside`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from nemo_automodel.components.distributed.blockdiag_cp import gpu_libraries, kernels, options, outside
from nemo_automodel.components.distributed.blockdiag_cp import state as state_module
from nemo_automodel.components.distributed.blockdiag_cp.gpu_libraries import GpuLibraries
from nemo_automodel.components.distributed.blockdiag_cp.layout import ShardPlan, doc_runs_from_ids, make_shard_plan
from nemo_automodel.components.distributed.blockdiag_cp.metadata import VarlenMeta
from nemo_automodel.components.distributed.blockdiag_cp.state import ThreadSharedSlot
from nemo_automodel.components.distributed.blockdiag_cp.variant import PLAIN, AttentionVariant


@dataclass(frozen=True)
class PackedState:
    """The armed packed row: its length, document layout and requested kernel.

    ``metas`` holds the kernel metadata per sliding window (``None``: full
    causal), filled on the first call with each window; ``libraries``, the GPU
    libraries probed when the row was armed (no call imports or probes).
    """

    seq_len: int
    plan: ShardPlan
    backend: str
    metas: dict[int | None, VarlenMeta] = field(default_factory=dict)
    libraries: GpuLibraries | None = None

    def meta(self, window: int | None) -> VarlenMeta:
        """Kernel metadata of the row for ``window``, built once per armed row."""
        if window not in self.metas:
            segments = self.plan.segments(0, window)
            self.metas[window] = kernels.precompute_blockdiag_varlen_meta(segments, self.device)
        return self.metas[window]

    @property
    def device(self) -> torch.device:
        """Where the row's metadata lives (the document ids' device)."""
        return self.metas[None].cu_q.device


_PACKED: ThreadSharedSlot[PackedState] = ThreadSharedSlot()
# Functions replaced by the pre-hooks, restored by the post-hooks (nested attention modules stack).
_SAVED_SDPA: list[Any] = []


def enable_cp1_packed_varlen(doc_ids: torch.Tensor, backend: str | None = None) -> None:
    """Arm block-diagonal attention for one packed row (until disabled or re-armed).

    Args:
        doc_ids: Document ids ``[S]`` or ``[1, S]`` (1-based, 0 = padding tail).
        backend: ``attn_backend`` (any synonym; ``None``: the configured value).
    """
    requested = options.normalize_attn_backend(
        backend if backend is not None else state_module.cp_varlen_runtime_config()["attn_backend"]
    )
    plan = make_shard_plan(doc_runs_from_ids(doc_ids), 1)
    meta = kernels.precompute_blockdiag_varlen_meta(plan.segments(0), doc_ids.device)
    libraries = gpu_libraries.probe_gpu_libraries(doc_ids.device)
    _PACKED.set(PackedState(plan.runs.total_len, plan, requested, {None: meta}, libraries))


def disable_cp1_packed_varlen() -> None:
    """Disarm the packed row; SDPA calls pass through again."""
    _PACKED.set(None)


def cp1_packed_varlen_backend() -> str | None:
    """The ``attn_backend`` requested for the armed row, or ``None`` when nothing is armed."""
    armed = _PACKED.get()
    return None if armed is None else armed.backend


def _matches(armed: PackedState, *tensors: torch.Tensor) -> bool:
    return all(t.dim() == 4 and t.shape[0] == 1 and t.shape[2] == armed.seq_len for t in tensors)


def packed_varlen_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    variant: AttentionVariant | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """SDPA replacement for packed rows at ``cp_size == 1``.

    Args:
        query: ``[1, Hq, S, D]`` over the whole armed row.
        key: ``[1, Hkv, S, D]``.
        value: ``[1, Hkv, S, D]``.
        attn_mask: Ignored for the armed row (masking comes from the document ids).
        dropout_p: Attention dropout probability.
        is_causal: Ignored for the armed row (always per-document causal).
        scale: Softmax scale (``None``: ``D ** -0.5``).
        enable_gqa: As for stock SDPA.
        variant: Sliding window, soft-cap and sinks for the armed row (``None``:
            plain). Stock SDPA cannot express them: a non-plain variant on a
            pass-through call raises.
        **kwargs: Forwarded to stock SDPA on pass-through; for the armed row any of them raises.

    Returns:
        ``[1, Hq, S, Dv]``; padding rows are zero.

    Raises:
        ValueError: a non-plain ``variant`` on a call that is not the armed row.
        TypeError: keyword arguments for the armed row (they cannot be honoured).
    """
    variant = variant or PLAIN
    armed = _PACKED.get()
    if armed is None or not _matches(armed, query, key, value):
        call = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variant, kwargs)
        remedy = "arm the row with enable_cp1_packed_varlen"
        return outside.stock_sdpa("packed_varlen_sdpa outside the armed packed row", remedy, *call)
    outside.refuse_keywords("packed_varlen_sdpa on the armed packed row", kwargs)
    kernels.validate_qkv(query, key, value, enable_gqa, armed.seq_len, variant)
    kernel = kernels.select_kernel(
        armed.backend,
        query.dtype,
        query.device,
        head_dim=query.shape[3],
        value_head_dim=value.shape[3],
        dropout_p=dropout_p,
        variant=variant,
        libraries=armed.libraries,
    )
    meta = armed.meta(variant.window)
    kv_len = meta.kv_len
    return kernels.blockdiag_attention(
        kernel, query, key[:, :, :kv_len], value[:, :, :kv_len], meta, scale, dropout_p, variant
    )


def _install(*_: Any) -> None:
    _SAVED_SDPA.append(F.scaled_dot_product_attention)
    F.scaled_dot_product_attention = packed_varlen_sdpa


def _restore(*_: Any) -> None:
    F.scaled_dot_product_attention = _SAVED_SDPA.pop()


def _refuse_attention_features(model: torch.nn.Module, attention_features: Collection[str] | None) -> None:
    """Refuse a model whose attention has a window, soft-cap or sinks (``attention_features`` names them).

    Its stock-SDPA calls carry a window only in the mask, which the armed row
    replaces with the document mask, and soft-cap or sinks not at all: they would
    be silently dropped. A transformers model (a config with ``model_type``) must say
    which features it has: the core does not read model configs.
    """
    if attention_features is None:
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "model_type"):
            raise ValueError(
                "attach_cp1_packed_varlen_hooks: a transformers model must pass attention_features= (its sliding "
                "windows, soft-cap and sinks, which stock SDPA calls cannot carry to the packed path): "
                "attention_features=nemo_automodel.components.models.attention_features.attention_features("
                "model.config).names()"
            )
        return
    if attention_features:
        raise ValueError(
            f"attach_cp1_packed_varlen_hooks: the model asks for {', '.join(attention_features)}, which its stock "
            "SDPA calls cannot carry to the packed path (it would silently compute plain causal attention); load it "
            "with attn_implementation='cp_blockdiag' (cp_attention.register_cp_attention(): variants are passed "
            "on) and run it in a cp=1 step of make_cp_blockdiag_batch_and_ctx, as the recipe does"
        )


def attach_cp1_packed_varlen_hooks(
    model: torch.nn.Module, *, attention_suffix: str = "self_attn", attention_features: Collection[str] | None = None
) -> list[RemovableHandle]:
    """Scope :func:`packed_varlen_sdpa` to the forwards of the model's attention modules.

    Args:
        model: A model whose attention modules call ``F.scaled_dot_product_attention``.
        attention_suffix: Attention modules are those whose qualified name ends with this.
        attention_features: The model's attention features that stock SDPA cannot carry (e.g.
            ``models.attention_features.attention_features(model.config).names()``); required for
            a transformers model, ``None`` for a plain module.

    Returns:
        The hook handles (call ``.remove()`` on each to detach).

    Raises:
        ValueError: when no module name ends with ``attention_suffix``; when ``attention_features``
            names a sliding window, soft-capping or sinks, or a transformers model passes none (see
            :func:`_refuse_attention_features`).
    """
    _refuse_attention_features(model, attention_features)
    handles: list[RemovableHandle] = []
    for name, module in model.named_modules():
        if name.endswith(attention_suffix):
            # CheckpointWrapper's recompute calls the inner module directly: hook that one.
            target = getattr(module, "_checkpoint_wrapped_module", module)
            handles.append(target.register_forward_pre_hook(_install))
            handles.append(target.register_forward_hook(_restore, always_call=True))
    if not handles:
        raise ValueError(
            f"attach_cp1_packed_varlen_hooks: no module name ends with {attention_suffix!r}; pass the "
            "suffix of the model's attention modules as attention_suffix="
        )
    return handles

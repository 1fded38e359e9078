"""Block-diagonal context parallelism for packed-sequence training.

Packed training concatenates many documents into one row; correct attention is
causal inside each document and blocked between them. This package shards such
a row over ``cp`` ranks and keeps attention exactly block-diagonal:

- :mod:`.state`    knob normalization, the typed per-step state and its thread-shared slot.
- :mod:`.layout`   document runs and each rank's segments, from replicated document ids.
- :mod:`.kernels`  varlen metadata, the CPU kernels, the kernel registry and selection (``auto``).
- :mod:`.gpu_kernels` the GPU kernels (fa3, flash, te, torch_varlen) and what each library needs.
- :mod:`.exchange` differentiable K/V collectives (all-gather, halo, all-to-all-v) and their plan.
- :mod:`.runtime`  ``cp_blockdiag_sdpa`` and the collective-safe path decisions.
- :mod:`.batch`    batch validation, padding, sharding and the per-step context.
- :mod:`.packed`   the ``cp_size == 1`` packed path for models calling stock SDPA.
- :mod:`.consensus` collective agreement: failed-rank consensus, step agreement, guarded kernels.
- :mod:`.cost`     the cost model behind ``kv_exchange=auto`` and ``layout=auto``.
- :mod:`.plan`     the planner (library and ``python -m`` command line).
- :mod:`.variant`  attention variants: sliding window, logit soft-cap, attention sinks.
- :mod:`.logs`     the one log-once helper.
"""

from nemo_automodel.components.distributed.blockdiag_cp.batch import ShardLayout, make_cp_blockdiag_batch_and_ctx
from nemo_automodel.components.distributed.blockdiag_cp.packed import (
    attach_cp1_packed_varlen_hooks,
    cp1_packed_varlen_backend,
    disable_cp1_packed_varlen,
    enable_cp1_packed_varlen,
    packed_varlen_sdpa,
)
from nemo_automodel.components.distributed.blockdiag_cp.runtime import (
    cp_blockdiag_sdpa,
    exchange_stats,
    nonfinite_attention_inputs,
    patch_sdpa,
    reset_exchange_stats,
)
from nemo_automodel.components.distributed.blockdiag_cp.state import (
    BlockdiagCpModelState,
    CPOptions,
    configure_cp_varlen,
    cp_attn_fire_count,
    cp_varlen_runtime_config,
    current_blockdiag_cp_state,
    reset_cp_attn_fire_count,
)
from nemo_automodel.components.distributed.blockdiag_cp.variant import AttentionVariant

__all__ = [
    "AttentionVariant",
    "BlockdiagCpModelState",
    "CPOptions",
    "ShardLayout",
    "attach_cp1_packed_varlen_hooks",
    "configure_cp_varlen",
    "cp1_packed_varlen_backend",
    "cp_attn_fire_count",
    "cp_blockdiag_sdpa",
    "cp_varlen_runtime_config",
    "current_blockdiag_cp_state",
    "disable_cp1_packed_varlen",
    "enable_cp1_packed_varlen",
    "exchange_stats",
    "make_cp_blockdiag_batch_and_ctx",
    "nonfinite_attention_inputs",
    "packed_varlen_sdpa",
    "patch_sdpa",
    "reset_cp_attn_fire_count",
    "reset_exchange_stats",
]

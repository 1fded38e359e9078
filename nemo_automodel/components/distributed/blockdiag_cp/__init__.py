"""Block-diagonal context parallelism for packed-sequence training.

Packed training concatenates many documents into one row; correct attention is
causal inside each document and blocked between them. This package shards such
a row over ``cp`` ranks and keeps attention exactly block-diagonal:

- :mod:`.options`  ``CPOptions``, the one definition of the settings.
- :mod:`.state`    the typed state of a packed row, the rows agreed together, the thread-shared slot.
- :mod:`.layout`   document runs and each rank's segments, from replicated document ids.
- :mod:`.metadata` kernel metadata, attention groups and the plan of one window.
- :mod:`.kernels`  the kernel registry and selection (``auto``); :mod:`.cpu_kernels`, :mod:`.gpu_kernels`.
- :mod:`.exchange` differentiable K/V collectives (all-gather, halo, all-to-all-v) and their plan.
- :mod:`.runtime`  the core ``attend_row``, its SDPA adapter ``cp_blockdiag_sdpa``, the path decisions.
- :mod:`.outside`  the one policy of the SDPA replacements for a call outside a packed row.
- :mod:`.batch`    batch validation, padding, sharding and the row's context.
- :mod:`.packed`   the ``cp_size == 1`` packed path for models calling stock SDPA.
- :mod:`.consensus` collective agreement: the rows' agreement, the failure protocol, guarded kernels.
- :mod:`.compat`   the seed's private functions and upstream's state forms.
- :mod:`.cost`     the cost model behind ``kv_exchange=auto`` and ``layout=auto``.
- :mod:`.plan`     the planner (library and ``python -m`` command line).
- :mod:`.variant`  attention variants: sliding window, logit soft-cap, attention sinks.
- :mod:`.logs`     the one log-once helper.
"""

from nemo_automodel.components.distributed.blockdiag_cp.batch import ShardLayout, make_cp_blockdiag_batch_and_ctx
from nemo_automodel.components.distributed.blockdiag_cp.consensus import (
    failure_diagnostics,
    failure_message,
    failure_row,
)
from nemo_automodel.components.distributed.blockdiag_cp.packed import (
    attach_cp1_packed_varlen_hooks,
    cp1_packed_varlen_backend,
    disable_cp1_packed_varlen,
    enable_cp1_packed_varlen,
    packed_varlen_sdpa,
)
from nemo_automodel.components.distributed.blockdiag_cp.runtime import (
    attend_row,
    attention_inputs_nonfinite,
    cp_blockdiag_sdpa,
    exchange_stats,
    nonfinite_attention_inputs,
    patch_sdpa,
    reset_exchange_stats,
)
from nemo_automodel.components.distributed.blockdiag_cp.state import (
    BlockdiagCpModelState,
    CPOptions,
    RowState,
    StepAgreement,
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
    "RowState",
    "StepAgreement",
    "attach_cp1_packed_varlen_hooks",
    "attend_row",
    "attention_inputs_nonfinite",
    "configure_cp_varlen",
    "cp1_packed_varlen_backend",
    "cp_attn_fire_count",
    "cp_blockdiag_sdpa",
    "cp_varlen_runtime_config",
    "current_blockdiag_cp_state",
    "disable_cp1_packed_varlen",
    "enable_cp1_packed_varlen",
    "exchange_stats",
    "failure_diagnostics",
    "failure_message",
    "failure_row",
    "make_cp_blockdiag_batch_and_ctx",
    "nonfinite_attention_inputs",
    "packed_varlen_sdpa",
    "patch_sdpa",
    "reset_cp_attn_fire_count",
    "reset_exchange_stats",
]

"""The seed's private functions and upstream's state forms, kept with their documented signatures.

Nothing here is on the typed core's path: the runtime calls none of it. Callers of
the seed API (and its tests) may; each function delegates to the typed core.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import consensus, kernels, options
from nemo_automodel.components.distributed.blockdiag_cp.state import StepState


def _needed_only_preflight(
    state: StepState,
    group: dist.ProcessGroup | None,
    backend: str,
    query_dtype: torch.dtype,
    device: torch.device,
    query_len: int,
    key_len: int,
) -> tuple[bool, str | None]:
    """Collective: can every rank run ``backend`` for this dtype, device and these lengths?

    One all-reduce over ``group`` the first time a row asks with a key, memoized in the
    row's state per ``(backend, dtype, device, query_len, key_len)``: per-layer calls cost nothing.

    Args:
        state: The row's state.
        group: The CP process group (every rank of it must call with the same key).
        backend: ``attn_backend`` (canonical or upstream's spelling; ``auto`` always runs).
        query_dtype: Query dtype.
        device: Query device.
        query_len: Local query rows (must be the row's local length ``L``).
        key_len: Local key rows (must be ``L``: keys are exchanged after this check).

    Returns:
        ``(ok, reason)``: ``reason`` names the failing ranks and, on a failing rank, its own cause.
    """
    canonical = options.normalize_attn_backend(backend)
    key = (canonical, str(query_dtype), str(device), int(query_len), int(key_len))
    memo = state.cache.preflight
    if key not in memo:
        reason = None
        if canonical != "auto":
            reason = kernels.kernel_unavailable_reason(canonical, query_dtype, torch.device(device))
        if reason is None and (query_len, key_len) != (state.local_len, state.local_len):
            reason = f"query/key length {query_len}/{key_len} differs from the row's local length {state.local_len}"
        failed = consensus.failed_ranks(reason is None, group, torch.device(device))
        memo[key] = (True, None)
        if failed:
            memo[key] = (False, f"rank(s) {failed} cannot run {canonical}" + (f" ({reason})" if reason else ""))
    return memo[key]

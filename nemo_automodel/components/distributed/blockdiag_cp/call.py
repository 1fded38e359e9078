"""One attention call's kernel settings, shared by every K/V path (needed-only, head-parallel and the hybrid)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nemo_automodel.components.distributed.blockdiag_cp import consensus
from nemo_automodel.components.distributed.blockdiag_cp.consensus import CallRecorder
from nemo_automodel.components.distributed.blockdiag_cp.variant import AttentionVariant

# (q, k, v, variant) -> output: one kernel launch of a path
KernelRun = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionVariant], torch.Tensor]


@dataclass(frozen=True)
class KernelCall:
    """What one attention call runs, the same on every path.

    Attributes:
        kernel: The resolved kernel (registry name).
        scale: Softmax scale (``None``: ``D ** -0.5``).
        dropout_p: Attention dropout probability.
        variant: Window or chunk, soft-cap and sinks ``[Hq]``.
        recorder: Where a kernel failure of this call is recorded.
    """

    kernel: str
    scale: float | None
    dropout_p: float
    variant: AttentionVariant
    recorder: CallRecorder

    def guarded(
        self,
        run: KernelRun,
        describe: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        variant: AttentionVariant | None = None,
    ) -> torch.Tensor:
        """``run(q, k, v, variant)`` under :func:`.consensus.guarded`: a failure yields zeros and is recorded.

        ``variant`` (default: the call's) is what the kernel runs with, e.g. the sinks of a rank's heads.
        """
        variant = variant or self.variant

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *sinks: torch.Tensor) -> torch.Tensor:
            # the guard hands in its own (detached) sinks: their gradient flows through it
            return run(q, k, v, dataclasses.replace(variant, sinks=sinks[0]) if sinks else variant)

        diagnostic = f"kernel={self.kernel} {describe}"
        return consensus.guarded(attend, self.recorder, diagnostic, query, key, value, *variant.tensors)

"""Token cross-entropy sums; the step normalizes them by the GLOBAL label-token count.

With CP each rank holds a slice of a row and with DP other rows; if every rank
divided by its own token count, ranks with few labels would be over-weighted
and ``cp = N`` would not equal ``cp = 1``. Instead every rank back-propagates its
per-token CE *sum*, gradients are SUM-reduced over ``dp x cp``, and the step
divides them by the number of label tokens of the whole step across ``dp x cp``
(learned in its one all-reduce): exactly the mean CE over all label tokens of the
global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_automodel.components.datasets.packing import IGNORE_INDEX


def token_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy over label tokens.

    Args:
        logits: ``[1, L, V]``.
        labels: ``[1, L]``, already shifted (``labels[i]`` is the token after ``i``), ``-100`` = no label.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

"""Token cross-entropy normalized by the GLOBAL label-token count.

With CP each rank holds a slice of a row and with DP other rows; if every rank
divided by its own token count, ranks with few labels would be over-weighted
and ``cp = N`` would not equal ``cp = 1``. Instead every rank divides its
per-token CE *sum* by the number of label tokens of the whole step across
``dp x cp`` (one all-reduce), and gradients are SUM-reduced over ``dp x cp``:
the result is exactly the mean CE over all label tokens of the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_automodel.components.datasets.packing import IGNORE_INDEX


def global_label_count(local_labels: list[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """Label tokens (``!= -100``) of this step on all ranks of ``group`` (a float scalar, the same on every rank).

    Args:
        local_labels: This rank's label shards, one ``[1, L]`` per micro-batch.
        group: The ``dp x cp`` group.
    """
    count = torch.stack([(labels != IGNORE_INDEX).sum() for labels in local_labels]).sum().double()
    dist.all_reduce(count, group=group)
    return count


def token_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy over label tokens.

    Args:
        logits: ``[1, L, V]``.
        labels: ``[1, L]``, already shifted (``labels[i]`` is the token after ``i``), ``-100`` = no label.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

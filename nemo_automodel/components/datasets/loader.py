"""The packed dataset for a config, and which row each dp rank trains on at each micro-step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_automodel.components.config.schema import DataConfig
from nemo_automodel.components.datasets.jsonl import jsonl_documents
from nemo_automodel.components.datasets.packing import PackedRows, pack_documents
from nemo_automodel.components.datasets.synthetic import synthetic_documents
from nemo_automodel.components.datasets.tokenizer import ByteTokenizer, HFTokenizer


def build_packed_dataset(cfg: DataConfig, tokenizer: ByteTokenizer | HFTokenizer) -> PackedRows:
    """Read (or generate), tokenize and pack the documents; identical on every rank."""
    texts = synthetic_documents(cfg) if cfg.source == "synthetic" else jsonl_documents(cfg.path, cfg.text_field)
    tokens = [tokenizer.encode(t) for t in texts]
    return pack_documents(tokens, cfg.seq_len, cfg.packing_algorithm, tokenizer.pad_id, cfg.seed, cfg.long_documents)


@dataclass(frozen=True)
class RowSchedule:
    """Deterministic row order: a fresh seeded permutation per epoch, rows dealt out round-robin to dp ranks.

    The data position is a pure function of the step, so a checkpoint only needs
    the step (``rows_consumed`` is recorded to detect a changed ``dp * grad_accum``).
    CP ranks of one dp rank get the same row (the CP batch builder shards it).
    """

    num_rows: int
    dp_size: int
    grad_accum: int
    seed: int

    @property
    def rows_per_step(self) -> int:
        return self.dp_size * self.grad_accum

    def row_index(self, step: int, micro: int, dp_rank: int) -> int:
        """Dataset row for 0-based optimizer ``step``, micro-batch ``micro`` and ``dp_rank``."""
        slot = (step * self.grad_accum + micro) * self.dp_size + dp_rank
        epoch, offset = divmod(slot, self.num_rows)
        order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + epoch))
        return int(order[offset])

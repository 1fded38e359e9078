"""AdamW and its linear-warmup + cosine-decay schedule."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from nemo_automodel.components.config.schema import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over every trainable parameter."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def warmup_cosine(step: int, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at 0-based ``step``: linear 1/w .. 1 over ``warmup_steps``, then cosine to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> LambdaLR:
    """Per-optimizer-step schedule; ``cfg.decay_steps`` (default ``max_steps``) fixes its length."""
    decay_steps = cfg.decay_steps or max_steps
    return LambdaLR(optimizer, lambda step: warmup_cosine(step, cfg.warmup_steps, decay_steps, cfg.min_lr_ratio))

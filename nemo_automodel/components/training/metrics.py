"""Rank-0 reporting: a tqdm bar, a console line every ``log_every`` steps, ``metrics.jsonl`` and TensorBoard.

``metrics.jsonl`` gets one JSON object per step. After a resume from an older
checkpoint some steps appear twice; the later line is the one that counts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

logger = logging.getLogger("nemo_automodel.finetune")


@dataclass(frozen=True)
class StepMetrics:
    """What one optimizer step reports (global values, identical on every rank)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    tokens_per_s: float
    step_time_s: float
    kv_path: str | None
    kv_tokens_received: int | None
    skipped: bool = False


class TqdmLoggingHandler(logging.Handler):
    """Console logging that does not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record))


class MetricsWriter:
    """Writes on rank 0 only; every method is a no-op elsewhere."""

    def __init__(self, run_dir: Path, enabled: bool, start_step: int, max_steps: int, log_every: int) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self._bar = None
        self._file = None
        self._tensorboard = None
        if not enabled:
            return
        self._file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._tensorboard = _tensorboard_writer(run_dir / "tensorboard")
        # disable=None: a bar on a terminal, none in redirected logs (they get the periodic lines)
        self._bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", disable=None)

    def log(self, metrics: StepMetrics) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(asdict(metrics)) + "\n")
        self._file.flush()  # tests and humans tail it while training runs
        if self._tensorboard is not None:
            for name in ("loss", "lr", "grad_norm", "tokens_per_s"):
                self._tensorboard.add_scalar(f"train/{name}", getattr(metrics, name), metrics.step)
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{metrics.loss:.4f}", refresh=False)
        if metrics.step % self.log_every == 0:
            logger.info(_format(metrics))

    def close(self) -> None:
        if not self.enabled:
            return
        self._bar.close()
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _format(m: StepMetrics) -> str:
    kv = f" | kv {m.kv_path} recv {m.kv_tokens_received} tok" if m.kv_path is not None else ""
    skipped = " | SKIPPED (non-finite)" if m.skipped else ""
    return (
        f"step {m.step} | loss {m.loss:.4f} | lr {m.lr:.2e} | grad_norm {m.grad_norm:.3f} "
        f"| {m.tokens_per_s:,.0f} tok/s{kv}{skipped}"
    )


def _tensorboard_writer(directory: Path) -> Any:
    """A ``SummaryWriter`` when the ``tensorboard`` package is installed, else ``None``."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(directory))


def configure_logging(rank: int) -> None:
    """Rank 0 logs INFO (through tqdm), other ranks WARNING; keeps handlers a launcher (Hydra) installed."""
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not root.handlers:
        handler = TqdmLoggingHandler()
        handler.setFormatter(logging.Formatter(f"[%(asctime)s][rank{rank}][%(levelname)s] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)

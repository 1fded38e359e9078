"""Rank-0 reporting: a tqdm bar, a console line every ``log_every`` steps, ``metrics.jsonl``, TensorBoard, the log.

``metrics.jsonl`` gets one JSON object per step (``val_loss``/``val_ppl`` only in the
rows of steps that validation followed). After a resume from an older checkpoint
some steps appear twice; the later line is the one that counts. At the end,
:meth:`MetricsWriter.summary` says how the run went and where its outputs are.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
from collections import deque
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
    loss_tokens: int
    tokens_per_s: float
    step_time_s: float
    kv_path: str | None
    kv_tokens_received: int | None
    skipped: bool = False
    val_loss: float | None = None
    val_ppl: float | None = None

    def record(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` object: every field, the validation ones only when validation ran."""
        fields = asdict(self)
        return {k: v for k, v in fields.items() if v is not None or not k.startswith("val_")}


class TqdmLoggingHandler(logging.Handler):
    """Console logging that does not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record))


class MetricsWriter:
    """Writes on rank 0 only; every method is a no-op elsewhere."""

    def __init__(self, run_dir: Path, enabled: bool, start_step: int, max_steps: int, log_every: int) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self._recent: deque[StepMetrics] = deque(maxlen=20)  # for the summary's "mean of the last steps"
        self._totals = {"steps": 0, "tokens": 0, "loss_tokens": 0, "seconds": 0.0}
        self._validation: StepMetrics | None = None
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
        self._file.write(json.dumps(metrics.record()) + "\n")
        self._file.flush()  # tests and humans tail it while training runs
        self._recent.append(metrics)
        for name, value in (("steps", 1), ("tokens", metrics.tokens), ("loss_tokens", metrics.loss_tokens)):
            self._totals[name] += value
        self._totals["seconds"] += metrics.step_time_s
        if self._tensorboard is not None:
            for name in ("loss", "lr", "grad_norm", "tokens_per_s", "loss_tokens"):
                self._tensorboard.add_scalar(f"train/{name}", getattr(metrics, name), metrics.step)
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{metrics.loss:.4f}", refresh=False)
        if metrics.step % self.log_every == 0:
            logger.info(_format(metrics))
        if metrics.val_loss is not None:
            self._validation = metrics
            if self._tensorboard is not None:
                self._tensorboard.add_scalar("val/loss", metrics.val_loss, metrics.step)
                self._tensorboard.add_scalar("val/ppl", metrics.val_ppl, metrics.step)
            logger.info("step %d | val_loss %.4f | val_ppl %.3f", metrics.step, metrics.val_loss, metrics.val_ppl)

    def summary(self, outcome: str, places: dict[str, Path | None], best: tuple[int, float] | None = None) -> None:
        """Log the end-of-run summary: ``outcome``, loss, throughput, validation, and ``places`` that exist."""
        if not self.enabled:
            return
        lines = [f"summary: {outcome}"]
        if self._recent:
            last = self._recent[-1]
            mean = statistics.fmean(m.loss for m in self._recent)
            seconds, tokens = self._totals["seconds"], self._totals["tokens"]
            lines.append(
                f"  loss        {last.loss:.4f} at step {last.step} (mean of the last {len(self._recent)} steps: "
                f"{mean:.4f})"
            )
            lines.append(
                f"  throughput  {tokens / max(seconds, 1e-9):,.0f} tokens/s over {self._totals['steps']} steps this "
                f"run ({tokens:,} tokens, {self._totals['loss_tokens']:,} with loss, "
                f"{seconds:.1f} s in steps)"
            )
        if self._validation is not None:
            v = self._validation
            lines.append(f"  validation  loss {v.val_loss:.4f}, ppl {v.val_ppl:.3f} at step {v.step}")
        if best is not None:
            lines.append(f"  best        validation loss {best[1]:.4f} at step {best[0]}")
        width = max(len(name) for name in places)
        lines += [f"  {name:<{width}}  {path}" for name, path in places.items() if path is not None]
        logger.info("\n".join(lines))

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


LOG_FILE = "finetune.log"


DATASETS_BARS_ENV = "HF_DATASETS_DISABLE_PROGRESS_BARS"  # read by ``datasets`` when it is imported


def quiet_progress_bars() -> None:
    """Turn off the progress bars of transformers (loading and saving weights) and ``datasets`` in this process.

    ``datasets`` is not imported for it: with pyarrow its import costs a rank ~75 MiB of resident memory
    (docs/performance.md), and a rank that trains on synthetic or cached rows never needs it. When it is not
    imported yet, its environment switch turns the bars off at import (a value the user set is kept).
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    else:
        os.environ.setdefault(DATASETS_BARS_ENV, "1")


def configure_logging(rank: int, run_dir: Path | None = None) -> None:
    """Rank 0 logs INFO (through tqdm) and shows progress bars; other ranks log WARNING and show none.

    Keeps the handlers a launcher (Hydra) installed.

    Rank 0 also appends everything it logs to ``run_dir/finetune.log`` whatever started it: Hydra
    already writes there when rank 0 is the Hydra process (cp=1, torchrun, srun); a worker the
    local launcher spawned gets its own handler on the same file.
    """
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if rank != 0:  # one "Loading weights" bar per job, not one per rank
        quiet_progress_bars()
    if not root.handlers:
        handler = TqdmLoggingHandler()
        handler.setFormatter(logging.Formatter(f"[%(asctime)s][rank{rank}][%(levelname)s] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
    if rank == 0 and run_dir is not None:
        path = (run_dir / LOG_FILE).resolve()
        if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in root.handlers):
            run_dir.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(path, encoding="utf-8")
            handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
            root.addHandler(handler)

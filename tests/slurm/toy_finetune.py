"""A stand-in for ``recipes/finetune.py`` that honours its Slurm-facing contract (tests only).

It lets the Slurm tests prove the launch, preemption and requeue mechanics of
``recipes/slurm/finetune.sbatch`` without the real recipe: started by torchrun, it trains a tiny
linear model on gloo with data that depends only on (step, rank), so a resumed run reproduces an
uninterrupted one bitwise. Like the recipe it takes ``key=value`` overrides (unknown keys fail
with a readable error and a non-zero exit), appends ``{"step", "loss"}`` records to
``metrics.jsonl`` in the run directory, checkpoints atomically every ``trainer.ckpt_every`` steps,
resumes from the latest checkpoint with ``trainer.resume=auto``, and on SIGUSR1 or SIGTERM
finishes the step, checkpoints and exits with :data:`PREEMPTED_EXIT_CODE`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

# Deliberately non-zero (sysexits' EX_TEMPFAIL): the sbatch script must requeue because it saw
# the preemption signal, whatever code the trainer exits with afterwards.
PREEMPTED_EXIT_CODE = 75
FEATURES = 16
BATCH = 32


@dataclass
class Config:
    run_dir: Path = Path("outputs/toy")
    max_steps: int = 8
    ckpt_every: int = 4
    resume: str = "none"
    step_seconds: float = 0.0
    lr: float = 0.05
    cp_size: int = 1


# override key -> (Config field, parser)
OVERRIDES = {
    "hydra.run.dir": ("run_dir", Path),
    "trainer.max_steps": ("max_steps", int),
    "trainer.ckpt_every": ("ckpt_every", int),
    "trainer.resume": ("resume", str),
    "trainer.step_seconds": ("step_seconds", float),
    "optim.lr": ("lr", float),
    "cp.size": ("cp_size", int),
}
# Accepted for command-line parity with the recipe; they select nothing here.
ACCEPTED_GROUPS = {"+cp=blockdiag"}


class OverrideError(ValueError):
    """An override the toy does not know, or whose value does not parse."""


def parse_overrides(args: list[str]) -> Config:
    config = Config()
    for arg in args:
        if arg in ACCEPTED_GROUPS:
            continue
        key, sep, value = arg.partition("=")
        if not sep or key not in OVERRIDES:
            raise OverrideError(f"unknown override {arg!r}; known keys: {', '.join(sorted(OVERRIDES))}")
        field, parse = OVERRIDES[key]
        try:
            setattr(config, field, parse(value))
        except ValueError as err:
            raise OverrideError(f"bad value for {key}: {value!r} ({err})") from err
    if config.resume not in ("auto", "none"):
        raise OverrideError(f"trainer.resume must be 'auto' or 'none', not {config.resume!r}")
    return config


class StopFlag:
    """Set by SIGUSR1/SIGTERM; the step loop polls it between steps."""

    def __init__(self) -> None:
        self.raised = False
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.raised = True


def batch_for(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step on one rank: a pure function of both, so a resumed run sees the same."""
    generator = torch.Generator().manual_seed(1_000 * step + rank)
    true_weight = torch.linspace(-1.0, 1.0, FEATURES)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    y = x @ true_weight + 0.1 * torch.randn(BATCH, generator=generator)
    return x, y.unsqueeze(1)


def checkpoint_dir(config: Config) -> Path:
    return config.run_dir / "checkpoints"


def save_checkpoint(config: Config, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Rank 0 writes a temporary file and renames it, so a reader never sees a partial checkpoint."""
    if dist.get_rank() == 0:
        target = checkpoint_dir(config) / f"step_{step:06d}.pt"
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        torch.save({"step": step, "model": model.state_dict(), "optim": optimizer.state_dict()}, partial)
        os.replace(partial, target)
    dist.barrier()


def load_latest(config: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore the newest checkpoint; return the last completed step (0 when there is none)."""
    checkpoints = sorted(checkpoint_dir(config).glob("step_*.pt"))
    if config.resume != "auto" or not checkpoints:
        return 0
    state = torch.load(checkpoints[-1])
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return state["step"]


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"[toy_finetune] {message}", flush=True)


def train_step(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """One data-parallel SGD step; returns the loss averaged over ranks."""
    x, y = batch_for(step, dist.get_rank())
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    world = dist.get_world_size()
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= world
    optimizer.step()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    return mean_loss.item() / world


def any_rank_stopping(stop: StopFlag) -> bool:
    """Ranks receive the signal at different moments; all of them must stop after the same step."""
    flag = torch.tensor([1 if stop.raised else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def train(config: Config, stop: StopFlag) -> int:
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    done = load_latest(config, model, optimizer)
    if done:
        log(f"resumed from step {done}")
    metrics = config.run_dir / "metrics.jsonl"
    for step in range(done + 1, config.max_steps + 1):
        loss = train_step(step, model, optimizer)
        if dist.get_rank() == 0:
            with metrics.open("a") as sink:
                sink.write(json.dumps({"step": step, "loss": loss}) + "\n")
        log(f"step {step}/{config.max_steps} loss {loss:.6f}")
        time.sleep(config.step_seconds)
        stopping = any_rank_stopping(stop)
        if stopping or step % config.ckpt_every == 0:
            save_checkpoint(config, step, model, optimizer)
        if stopping:
            log(f"preempted after step {step}: checkpoint saved, exiting with {PREEMPTED_EXIT_CODE}")
            return PREEMPTED_EXIT_CODE
    log("training complete")
    return 0


def main(args: list[str]) -> int:
    stop = StopFlag()  # first, so an early signal is not lost
    try:
        config = parse_overrides(args)
    except OverrideError as err:
        print(f"toy_finetune: error: {err}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if dist.get_world_size() % config.cp_size:
            print(f"toy_finetune: error: cp.size={config.cp_size} does not divide the world size", file=sys.stderr)
            return 2
        config.run_dir.mkdir(parents=True, exist_ok=True)
        code = train(config, stop)
        dist.barrier()  # no rank tears its connections down while a peer is still in the last collective
        return code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_code = main(sys.argv[1:])
    # Leave without interpreter finalization: the process group is already destroyed, and once in CI a
    # finished rank aborted while gloo's threads were torn down at exit ("terminate called without an
    # active exception", exit -6 after "training complete"), turning a complete run into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)

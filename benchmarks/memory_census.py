"""Where one training step's bytes go: live CPU tensors per phase, by category and creator.

Used by ``recipe_throughput.py --scaling --census``. One step runs under ``torch.profiler`` with
``profile_memory=True``; marks recorded at the phase boundaries (the data path, forward, loss, backward,
optimizer step) split its allocation timeline into phases. For each phase the census takes the instant of
most live tensor bytes and sorts those bytes into the categories below, from torch's memory profiler
(parameter, gradient, optimizer state, activation, temporary) refined by the Python frame that allocated
them (the K/V exchange, the batch sharder, the loss). Resident memory (``VmRSS``) is read at every mark:
what it holds beyond the bare process and the live tensors is the allocator's retention.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.profiler import ProfilerActivity, profile, record_function
from torch.profiler._memory_profiler import Action, Category, MemoryProfile, TensorKey

PHASES = ("data", "forward", "loss", "backward", "optimizer")
BUCKETS = (
    "activations saved for backward",
    "received K/V",
    "logits and loss",
    "data path (row tensors)",
    "temporaries",
    "gradients",
    "optimizer state",
    "parameters",
)
_MARK = "census:"


def rss_mib() -> float:
    """This process's resident memory now (``VmRSS``), MiB."""
    with open("/proc/self/status") as status:
        line = next(s for s in status if s.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


class PhaseMarks:
    """Hooks that mark the phases of one step in the profile and read RSS at each mark."""

    def __init__(self) -> None:
        self.rss: dict[str, float] = {}
        self._handles: list[Any] = []

    def mark(self, phase: str) -> None:
        self.rss.setdefault(phase, rss_mib())
        with record_function(_MARK + phase):
            pass

    @contextlib.contextmanager
    def installed(self, model: torch.nn.Module) -> Iterator[None]:
        """Mark forward (model pre-hook), loss (model hook), backward (``autograd.backward``), optimizer."""
        real_backward = torch.autograd.backward

        def backward(*args: Any, **kwargs: Any) -> Any:
            self.mark("backward")
            return real_backward(*args, **kwargs)

        self._handles = [
            model.register_forward_pre_hook(lambda *_: self.mark("forward")),
            model.register_forward_hook(lambda *_: self.mark("loss")),
            register_optimizer_step_pre_hook(lambda *_: self.mark("optimizer")),
            register_optimizer_step_post_hook(lambda *_: self.mark("end")),
        ]
        torch.autograd.backward = backward
        try:
            self.mark("data")
            yield
        finally:
            torch.autograd.backward = real_backward
            for handle in self._handles:
                handle.remove()
            self.mark("end")


def profiled() -> profile:
    """The profiler of the census step (CPU ops, their allocations, shapes and Python frames)."""
    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True)


def _frames(event: Any) -> list[str]:
    """Python frames (``file(line): function``) above ``event``, innermost first."""
    frames = []
    while event is not None:
        if event.typed[0] == _EventType.PyCall:
            frames.append(event.name)
        event = event.parent
    return frames


def _bucket(category: Category | None, frames: list[str]) -> str:
    """One of :data:`BUCKETS` for a tensor of torch's ``category`` allocated under ``frames``."""
    if category == Category.PARAMETER:
        return "parameters"
    if category == Category.OPTIMIZER_STATE:
        return "optimizer state"
    if category == Category.GRADIENT:
        return "gradients"
    ours = [f for f in frames if "nemo_automodel" in f]
    if any("blockdiag_cp/exchange.py" in f for f in ours):
        return "received K/V"
    if any("training/loss.py" in f for f in ours) or any("lm_head" in f or "logits" in f for f in frames[:3]):
        return "logits and loss"
    if any("blockdiag_cp/batch.py" in f or ("step.py" in f and "_shard" in f) for f in ours):
        return "data path (row tensors)"
    if category == Category.ACTIVATION:
        return "activations saved for backward"
    return "temporaries"


def _creator(frames: list[str], op: str) -> str:
    """The innermost project or transformers frame and the op that allocated."""
    where = next((f for f in frames if "nemo_automodel/" in f or "transformers/" in f), frames[0] if frames else "?")
    return f"{where.split('site-packages/')[-1].split('nemo_automodel/')[-1]} [{op}]"


def analyse(prof: profile, rss: dict[str, float]) -> dict[str, Any]:
    """Per phase: peak live tensor bytes, their split by bucket and the top creators, and RSS at the marks."""
    result = prof.profiler.kineto_results
    memory = MemoryProfile(result)
    marks: dict[str, int] = {}
    origin: dict[tuple[int, int], tuple[list[str], str]] = {}
    for event in memory._op_tree.dfs():
        if event.name.startswith(_MARK):
            marks.setdefault(event.name[len(_MARK) :], event.start_time_ns)
        elif event.typed[0] == _EventType.Allocation and event.typed[1].alloc_size > 0:
            fields = event.typed[1]
            op = event.parent.name if event.parent is not None else "?"
            origin[(fields.ptr, fields.allocation_id)] = (_frames(event), op)
    order = [p for p in (*PHASES, "end") if p in marks]
    live: dict[tuple[Any, int], tuple[int, str, str]] = {}  # (key, version) -> (bytes, bucket, creator)
    peaks: dict[str, tuple[int, dict]] = {}
    total = 0

    def label(key: Any, version: int) -> tuple[str, str]:
        if not isinstance(key, TensorKey):
            return "temporaries", "untracked allocation"
        frames, op = origin.get((key.storage.ptr, key.storage.allocation_id), ([], "?"))
        return _bucket(memory._categories.get(key, version), frames), _creator(frames, op)

    for t, action, (key, version), nbytes in memory.timeline:
        if key.device.type != "cpu":
            continue
        if action in (Action.PREEXISTING, Action.CREATE):
            live[(key, version)] = (nbytes, *label(key, version))
            total += nbytes
        elif action == Action.INCREMENT_VERSION:
            size, *_ = live.pop((key, version), (nbytes, "", ""))
            live[(key, version + 1)] = (size, *label(key, version + 1))
        elif action == Action.DESTROY:
            total -= live.pop((key, version), (nbytes,))[0]
        phase = next((p for p, q in itertools.pairwise(order) if marks[p] <= t < marks[q]), None)
        if phase is not None and total > peaks.get(phase, (-1,))[0]:
            peaks[phase] = (total, dict(live))
    out: dict[str, Any] = {"rss_mib": rss}
    for phase, (peak, snapshot) in peaks.items():
        buckets: dict[str, int] = defaultdict(int)
        creators: dict[str, int] = defaultdict(int)
        for size, bucket, creator in snapshot.values():
            buckets[bucket] += size
            creators[f"{bucket}: {creator}"] += size
        top = sorted(creators.items(), key=lambda kv: -kv[1])[:12]
        out[phase] = {"peak_bytes": peak, "buckets": dict(buckets), "top": top}
    return out

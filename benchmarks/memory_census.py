"""Where one training step's bytes go: live CPU tensors per phase, by category and creator.

Used by ``recipe_throughput.py --scaling --census``. One step runs under ``torch.profiler`` with
``profile_memory=True``; marks recorded at the phase boundaries (the data path, forward, loss, backward,
optimizer step) split its allocation timeline into phases. For each phase the census takes the instant of
most live tensor bytes and sorts those bytes into the categories below, from torch's memory profiler
(parameter, gradient, optimizer state, activation, temporary) refined by the Python frame that allocated
them (the K/V exchange, the batch sharder, the loss). Resident memory (``VmRSS``) is read at every mark:
what it holds beyond the bare process and the live tensors is the allocator's retention.

Counts without the profiler (``PhaseMarks`` alone, ``--counts``): at every mark the peak RSS of the phase that
ended there (``VmHWM``, reset at each mark through ``/proc/self/clear_refs``), glibc's heap bytes in use and
free (``mallinfo2``: free heap chunks are resident until trimmed, which is the retention), the bytes glibc
mapped for large blocks, and the minor page faults of the phase (``getrusage``).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import resource
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


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        line = next(s for s in status if s.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def rss_mib() -> float:
    """This process's resident memory now (``VmRSS``), MiB."""
    return _status_mib("VmRSS")


_peak_before_reset_mib = 0.0  # the largest VmHWM read before a reset (marks reset it per phase)


def peak_rss_mib() -> float:
    """This process's own peak resident memory over its life, MiB.

    ``VmHWM`` is the high-water mark of this process's address space since ``exec``. ``ru_maxrss`` is not: a
    spawned worker inherits the RSS high-water mark of the process that spawned it (Linux records the old
    address space's peak at ``exec``), so it can never read below the driver's RSS.
    """
    return max(_peak_before_reset_mib, _status_mib("VmHWM"))


def _phase_peak_mib() -> float:
    """Peak RSS since the previous call (``VmHWM``, then reset to the current RSS), MiB."""
    global _peak_before_reset_mib
    peak = _status_mib("VmHWM")
    _peak_before_reset_mib = max(_peak_before_reset_mib, peak)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # 5: reset the peak RSS (Linux >= 4.0)
    return peak


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def heap_counts() -> dict[str, float]:
    """glibc's allocator now, MiB: heap bytes in use and free (all arenas; ``heap_top``: the free top of the main
    heap, which a trim can return), bytes in mapped blocks; {} off glibc."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    mib = {"heap_used": info.uordblks, "heap_free": info.fordblks, "heap_top": info.keepcost, "mapped": info.hblkhd}
    return {k: v / 2**20 for k, v in mib.items()}


def counts_now() -> dict[str, float]:
    """What a mark records: peak RSS of the phase ending now, RSS, heap, minor faults and CPU seconds so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "peak_rss": _phase_peak_mib(),
        "rss": rss_mib(),
        **heap_counts(),
        "minflt": float(usage.ru_minflt),
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }


class PhaseMarks:
    """Hooks that mark the phases of one step in the profile and read RSS at each mark."""

    def __init__(self) -> None:
        self.rss: dict[str, float] = {}
        self.counts: dict[str, dict[str, float]] = {}  # at each mark (see ``counts_now``)
        self._handles: list[Any] = []

    def mark(self, phase: str) -> None:
        if phase not in self.counts:
            self.counts[phase] = counts_now()
            self.rss[phase] = self.counts[phase]["rss"]
        with record_function(_MARK + phase):
            pass

    def per_phase(self) -> dict[str, dict[str, float]]:
        """Per phase: its peak RSS, RSS and heap at its end, and its minor faults and CPU seconds."""
        order = [p for p in (*PHASES, "end") if p in self.counts]
        out = {}
        for phase, after in itertools.pairwise(order):
            end, start = self.counts[after], self.counts[phase]
            out[phase] = {k: v for k, v in end.items() if k not in ("minflt", "cpu_s")}
            out[phase] |= {k: end[k] - start[k] for k in ("minflt", "cpu_s")}
        return out

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

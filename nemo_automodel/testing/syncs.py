"""Count control collectives and host synchronizations: a diagnostic for tests, benchmarks and users' models.

On a GPU every host synchronization (``.item()``, ``.tolist()``, ``.cpu()``,
``bool(tensor)``, ...) stops the CPU until the queued kernels finish, so it
cannot run ahead and queue the next layer; a collective that is not the K/V
exchange itself (a consensus all-reduce, say) does the same on every rank.
:func:`count_syncs` counts both, from Python, on any device, so a CPU test can
prove that the per-layer count is zero: run one step with ``N`` and with
``N + k`` layers and divide the difference by ``k`` (the metrics notes'
definition; per-step work cancels out).

It patches ``torch.Tensor``'s synchronizing methods and ``torch.distributed``'s
collectives for the duration (not thread-safe: a diagnostic, never for
production steps) and restores them on exit. Synchronizations inside C++
operators (e.g. ``repeat_interleave`` without ``output_size``) are invisible to
it; on CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` reports those.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import exchange

HOST_SYNC_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)
# isend/irecv are not wrapped: P2POp accepts only the original functions (batch_isend_irecv is counted).
# Collectives issued from these files move data, they do not synchronize control flow: the
# K/V exchange (what CP exists to do) and FSDP's parameter / gradient traffic.
_EXCHANGE_FILE = str(Path(exchange.__file__))
_TORCH_DIR = Path(torch.__file__).parent
_FSDP_DIR = str(_TORCH_DIR / "distributed" / "fsdp")
# Origins of host synchronizations, first match wins: (label, directory prefix).
_ORIGINS = (
    ("cp", str(Path(exchange.__file__).parent)),
    ("nemo_automodel", str(Path(__file__).parents[1])),
    ("torch.optim", str(_TORCH_DIR / "optim")),
    ("fsdp", _FSDP_DIR),
    ("torch", str(_TORCH_DIR)),
)


@dataclass
class SyncCounts:
    """What ran while :func:`count_syncs` was active.

    Attributes:
        control: Control collectives (anything but the K/V exchange and FSDP traffic), by name.
        exchange: K/V exchange collectives, by name.
        fsdp: FSDP parameter and gradient collectives, by name.
        host: Host synchronizations, by ``(tensor method, origin)``; the origin is the package of the
            direct caller (``cp``: this package; ``nemo_automodel``, ``torch.optim``, ``fsdp``, ``torch``,
            ``transformers``, ``other``). AdamW, for one, reads its per-parameter step counters with
            ``.item()``: those live on the host unless the optimizer is capturable, so on a GPU they
            do not synchronize.
    """

    control: Counter[str] = field(default_factory=Counter)
    exchange: Counter[str] = field(default_factory=Counter)
    fsdp: Counter[str] = field(default_factory=Counter)
    host: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def control_collectives(self) -> int:
        return sum(self.control.values())

    @property
    def host_syncs(self) -> int:
        return sum(self.host.values())

    def host_syncs_from(self, origin: str) -> int:
        """Host synchronizations whose direct caller is in ``origin`` (see :attr:`host`)."""
        return sum(n for (_, where), n in self.host.items() if where == origin)


def _caller_file() -> str:
    """The file of the code that called the counting wrapper (two frames up from here)."""
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    return caller.f_code.co_filename if caller is not None else ""


def _collective_kind(path: str) -> str:
    """``exchange``, ``fsdp`` or ``control``: what issued a collective, by its direct caller's file."""
    if path == _EXCHANGE_FILE:
        return "exchange"
    return "fsdp" if path.startswith(_FSDP_DIR) else "control"


def _origin(path: str) -> str:
    """The package a host synchronization came from (see :attr:`SyncCounts.host`)."""
    if "transformers" in Path(path).parts:
        return "transformers"
    return next((label for label, prefix in _ORIGINS if path.startswith(prefix)), "other")


def _counting_collective(name: str, real: Callable[..., Any], counts: SyncCounts) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        getattr(counts, _collective_kind(_caller_file()))[name] += 1
        return real(*args, **kwargs)

    return counted


def _counting_method(name: str, real: Callable[..., Any], counts: SyncCounts) -> Callable[..., Any]:
    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counts.host[name, _origin(_caller_file())] += 1
        return real(self, *args, **kwargs)

    return counted


@contextlib.contextmanager
def count_syncs() -> Iterator[SyncCounts]:
    """Count control collectives and host synchronizations of every rank-local call while active.

    Yields:
        The :class:`SyncCounts`, filled in place.
    """
    counts = SyncCounts()
    saved_methods = {name: torch.Tensor.__dict__.get(name) for name in HOST_SYNC_METHODS}
    saved_collectives = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    try:
        for name in HOST_SYNC_METHODS:
            setattr(torch.Tensor, name, _counting_method(name, getattr(torch.Tensor, name), counts))
        for name, real in saved_collectives.items():
            setattr(dist, name, _counting_collective(name, real, counts))
        yield counts
    finally:
        for name, real in saved_methods.items():
            if real is None:  # inherited from the C base class: drop the override
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, real)
        for name, real in saved_collectives.items():
            setattr(dist, name, real)

"""The machine the stand-ins pretend to be: library releases, the GPU, cuDNN and TE's environment.

A test picks one with ``tests.cases.fake_kernels(machine=Machine(...))``. The stand-ins
read :data:`ACTIVE` when they are imported (versions, signatures, which internals
exist) and when they are called (the checks their real kernels make on the device).
Versions are the releases at which the real libraries changed behaviour; the
values each stand-in understands are listed on its field below.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Device:
    """A pretend CUDA device: compute capability and ``cudaDevAttrMaxSharedMemoryPerBlockOptin`` (bytes)."""

    capability: tuple[int, int]
    smem_optin: int
    name: str


A100 = Device((8, 0), 163 * 1024, "NVIDIA A100-SXM4-80GB")
A10 = Device((8, 6), 99 * 1024, "NVIDIA A10")
L40S = Device((8, 9), 99 * 1024, "NVIDIA L40S")
H100 = Device((9, 0), 227 * 1024, "NVIDIA H100 80GB HBM3")
B200 = Device((10, 0), 227 * 1024, "NVIDIA B200")
RTX5090 = Device((12, 0), 99 * 1024, "NVIDIA GeForce RTX 5090")
T4 = Device((7, 5), 64 * 1024, "Tesla T4")

# FlashAttention-3 builds by the date their interface changed (hopper/flash_attn_interface.py history):
FA3_ERAS = (
    "2024-08",  # window_size (08-29); head dims 64/128/256 only; Hopper only; returns (out, lse)
    "2025-01",  # big refactor (01-07): softcap, seqused_q/seqused_k required positionally; Hopper only
    "2025-04",  # seqused keywords (02-16), sm80+ (02-16), Dv != D forward (02-03), attention_chunk (04-10)
    "2.8.3",  # flash_attn_config with build flags (07-16), returns out (07-11), Dv != D backward (04-24)
    "main",  # return_attn_probs (08-29)
)


@dataclass(frozen=True)
class Machine:
    """What the stand-ins pretend: ``None`` for a library means "not installed".

    Attributes:
        device: The pretend GPU (``None``: plain CPU run, no device checks anywhere).
        flash: flash-attn 2 release, e.g. ``"2.6.1"``, ``"2.8.3"``.
        fa3: FlashAttention-3 build era (:data:`FA3_ERAS`).
        fa3_disabled: FA3 build flags set (``"LOCAL"``, ``"SOFTCAP"``, ``"BACKWARD"``, ``"HDIM256"``, ...).
        te: TransformerEngine release, e.g. ``"1.9.0"``, ``"2.1.0"``, ``"2.20.0.dev0"``.
        cudnn: cuDNN version TE runs with.
        torch_varlen: ``varlen_attn`` signature era: ``"2.10"``, ``"2.11"`` or ``"2.13"`` (the installed torch).
        env: Environment while the stand-ins are active (``NVTE_FLASH_ATTN=0`` ...).
    """

    device: Device | None = None
    flash: str | None = "2.8.3"
    fa3: str | None = "main"
    fa3_disabled: frozenset[str] = frozenset()
    te: str | None = "2.20.0.dev0"
    cudnn: tuple[int, int, int] = (9, 8, 0)
    torch_varlen: str = "2.13"
    env: tuple[tuple[str, str], ...] = field(default=())


ACTIVE = Machine()


def release(version: str | None) -> tuple[int, ...]:
    """``"2.8.3.post1"`` -> ``(2, 8, 3)``."""
    parts = []
    for part in (version or "").split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def capability() -> tuple[int, int] | None:
    """The pretend device's capability (``None``: no device checks)."""
    return None if ACTIVE.device is None else ACTIVE.device.capability

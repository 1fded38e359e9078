"""The GPU kernels on CPU through the stand-ins of ``tests/fakes`` (shared cases: ``nemo_automodel.testing.cases``)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from nemo_automodel.components.distributed.blockdiag_cp import gpu_kernels, gpu_libraries, kernels
from nemo_automodel.testing.cases import GPU_KERNELS, Case, attend_cases

FAKES = Path(__file__).parent / "fakes"


# top-level modules the stand-ins provide: forgotten on exit (with their submodules) so a later
# import finds the real package (or none), and re-imported under the next machine (the stand-in
# helpers `machine`, `fake_varlen_core` and `torch_flash_cpu` stay loaded: aten kernels register once)
_SHADOWED = ("flash_attn", "flash_attn_interface", "flash_attn_config", "transformer_engine")


@contextlib.contextmanager
def fake_kernels(machine: Any = None) -> Iterator[None]:
    """Run the GPU kernels on CPU through the stand-ins of ``tests/fakes``, in any dtype; undone on exit.

    The stand-ins go first on ``sys.path`` (flash-attn, FA3, TransformerEngine),
    torch's ``varlen_attn`` gets CPU kernels for its two aten ops, and the
    registry drops the kernels' device and dtype restrictions. Availability is
    still checked for real: imports, versions, signatures, head dims and dropout.

    Args:
        machine: A ``tests/fakes/machine.py`` ``Machine`` (library releases, a pretend GPU, cuDNN,
            environment); default: flash-attn 2.8.3, FA3 main, TE main, torch's own ``varlen_attn``,
            no device (device rules are then not applied, by the probe or by the stand-ins).
    """
    saved = {name: kernels.KERNELS[name] for name in GPU_KERNELS}
    sys.path.insert(0, str(FAKES))
    _forget_stand_ins()
    profile = importlib.import_module("machine")
    profile.ACTIVE = machine or profile.Machine()
    torch_flash_cpu = importlib.import_module("torch_flash_cpu")
    torch_flash_cpu.install()
    patches = _machine_patches(profile.ACTIVE, torch_flash_cpu)
    env = {name: os.environ.get(name) for name, _ in profile.ACTIVE.env}
    os.environ.update(dict(profile.ACTIVE.env))
    gpu_kernels.reset_caches()
    try:
        for owner, name, value in patches:
            setattr(owner, name, value[1])
        for name in GPU_KERNELS:
            kernels.KERNELS[name] = replace(saved[name], device_types=None, dtypes=None)
        yield
    finally:
        kernels.KERNELS.update(saved)
        for owner, name, value in patches:
            setattr(owner, name, value[0])
        for name, old in env.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        profile.ACTIVE = profile.Machine()
        sys.path.remove(str(FAKES))
        _forget_stand_ins()
        gpu_kernels.reset_caches()


def _forget_stand_ins() -> None:
    for module in [m for m in sys.modules if m.split(".")[0] in _SHADOWED]:
        del sys.modules[module]


def _machine_patches(machine: Any, torch_flash_cpu: Any) -> list[tuple[Any, str, tuple[Any, Any]]]:
    """``(owner, attribute, (saved, pretend))`` for the machine's device and ``varlen_attn`` era."""
    import torch.nn.attention.varlen as varlen

    patches = []
    if machine.torch_varlen != "2.13":
        patches.append((varlen, "varlen_attn", (varlen.varlen_attn, torch_flash_cpu.ERAS[machine.torch_varlen])))
    if machine.device is not None:
        device = machine.device
        facts = gpu_libraries.DeviceFacts(device.capability, device.smem_optin, device.name)
        patches.append((gpu_libraries, "device_facts", (gpu_libraries.device_facts, lambda _device: facts)))
        available = torch.backends.cuda.is_flash_attention_available
        patches.append((torch.backends.cuda, "is_flash_attention_available", (available, lambda: True)))
    return patches


def attend_fake_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """:func:`~nemo_automodel.testing.cases.attend_cases` with the GPU kernels on the CPU stand-ins."""
    with fake_kernels():
        return attend_cases(cases)

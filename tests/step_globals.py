"""Which module-level mutable objects a piece of code reads: a profile of the package's functions it runs.

Every package function that runs under :func:`mutable_globals_read` is disassembled; each global it loads
(``LOAD_GLOBAL``, and ``module.attribute`` one level down) that holds a mutable object (a dict, list, set,
slot, lock, cache, ``os.environ``, a function swapped at run time...) is reported as ``module.name``.
Immutable values (modules, classes, plain functions, numbers, strings, tuples, frozen dataclasses, enums,
loggers) are not. It is a static view of the code that ran, not of the branches it took.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import enum
import logging
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import torch

_PACKAGE = str(Path(__file__).resolve().parent.parent / "nemo_automodel")
_WRITTEN = object()  # stands for a module attribute the code assigns (a process-wide swap)
# MappingProxyType: a read-only view of a table fixed at import
_IMMUTABLE = (
    int, float, complex, str, bytes, bool, type(None), tuple, frozenset, range, torch.dtype, torch.device,
    types.MappingProxyType,
)  # fmt: skip


def _mutable(value: object) -> bool:
    """Whether ``value`` may change after import (what the step path should not depend on)."""
    if isinstance(value, _IMMUTABLE) or value is Ellipsis:
        return False
    if isinstance(value, (types.ModuleType, type, types.BuiltinFunctionType, logging.Logger, enum.Enum)):
        return False
    if isinstance(value, (typing.TypeVar, types.GenericAlias)) or type(value).__module__ == "typing":
        return False
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return False
    if hasattr(value, "cache_info"):  # functools.cache / lru_cache: a process-wide memo
        return True
    if callable(value) and not isinstance(value, (dict, list, set)) and type(value).__module__.startswith("torch"):
        return False  # torch ops and autograd functions
    frozen = dataclasses.is_dataclass(value) and type(value).__dataclass_params__.frozen  # type: ignore[attr-defined]
    return not frozen


def _globals_of(code: types.CodeType, module_globals: dict[str, object]) -> Iterator[tuple[str, object]]:
    """``(name, object)`` of every global ``code`` loads, ``module.attribute`` for a module's attribute."""
    previous: object = None
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            name = ins.argval
            value = module_globals.get(name, getattr(__builtins__, name, None) if name != "__builtins__" else None)
            previous = value
            yield name, value
            continue
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR") and isinstance(previous, types.ModuleType):
            label = f"{previous.__name__.rsplit('.', 1)[-1]}.{ins.argval}"
            yield (label, _WRITTEN) if ins.opname == "STORE_ATTR" else (label, getattr(previous, ins.argval, None))
        previous = None


@contextlib.contextmanager
def mutable_globals_read() -> Iterator[dict[str, set[str]]]:
    """Yield ``{"module.name": {functions that read it}}``, filled when the block exits."""
    seen: dict[types.CodeType, dict[str, object]] = {}

    def profile(frame: types.FrameType, event: str, _: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(_PACKAGE) and frame.f_code not in seen:
            seen[frame.f_code] = frame.f_globals

    found: dict[str, set[str]] = {}
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield found
    finally:
        sys.setprofile(previous)
    loads = []
    for code, module_globals in seen.items():
        module = str(module_globals.get("__name__", "?")).rsplit(".", 1)[-1]
        for name, value in _globals_of(code, module_globals):
            loads.append((name if "." in name else f"{module}.{name}", value, f"{module}.{code.co_qualname}"))
    swapped = {label for label, value, _ in loads if value is _WRITTEN}
    for label, value, reader in loads:
        if label in swapped or _mutable(value):
            found.setdefault(label, set()).add(reader)

"""Signals sent at a chosen phase of a recipe worker (test-only; installed by ``inject/sitecustomize.py``).

``NEMO_TEST_SIGNAL`` (JSON) names the phase; the worker of rank ``rank`` sends ``count`` signals
when that phase starts, to its launcher (which forwards them to every worker, as a scheduler's
SIGTERM does) or to itself only (the other ranks learn it through the agreement):

- ``step``: before training step ``step`` (1-based) runs; ``save``: the DCP write of the checkpoint
  of step ``step`` (``checkpoints/``), so a signal lands inside a save that already has its temp dir;
  ``validate``: the first validation pass; ``export``: the HF export.

Each signal is followed by ``gap_s`` seconds of sleep, so it is delivered (and a second one is not the
launcher's forwarded copy of the first) before the phase goes on.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any


def _firing(config: dict[str, Any]) -> Callable[[], None]:
    fired = [False]

    def fire() -> None:
        if fired[0] or int(os.environ.get("RANK", "-1")) != config["rank"]:
            return
        fired[0] = True
        target = os.getppid() if config.get("to", "launcher") == "launcher" else os.getpid()
        for _ in range(config.get("count", 1)):
            os.kill(target, signal.Signals[config.get("signal", "SIGTERM")])
            time.sleep(config.get("gap_s", 2.0))

    return fire


def _always(*args: Any, **kwargs: Any) -> bool:
    return True


def _signal_before(owner: Any, name: str, fire: Callable[[], None], when: Callable[..., bool]) -> None:
    """Replace ``owner.<name>`` by a wrapper that calls ``fire()`` first whenever ``when(*args, **kwargs)`` holds."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            fire()
        return real(*args, **kwargs)

    setattr(owner, name, wrapper)


def install_from_env(spec: str) -> None:
    """Wrap the function of the phase named in ``spec`` (module docstring) so it signals first."""
    from torch.distributed import checkpoint as torch_dcp

    from nemo_automodel.components.checkpoint import hf_export
    from nemo_automodel.components.training import step as step_module

    config = json.loads(spec)
    fire = _firing(config)
    phase = config["phase"]
    if phase == "step":  # train_step's sixth argument is the 1-based step
        _signal_before(step_module, "train_step", fire, lambda *args, **kwargs: args[5] == config["step"])
    elif phase == "save":
        tmp = f"checkpoints/.tmp-step_{config['step']:08d}"
        _signal_before(torch_dcp, "save", fire, lambda *args, checkpoint_id="", **kwargs: checkpoint_id.endswith(tmp))
    elif phase == "validate":
        _signal_before(step_module, "validate", fire, _always)
    elif phase == "export":
        _signal_before(hf_export, "export_hf", fire, _always)
    else:
        raise ValueError(f"NEMO_TEST_SIGNAL phase={phase!r}: expected step, save, validate or export")

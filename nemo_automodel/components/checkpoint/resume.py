"""What a resumed run may differ in from its checkpoint, and the refusals that name the way out."""

from __future__ import annotations

from pathlib import Path

from nemo_automodel.components.config.errors import InputError


def check_resume_step(max_steps: int, checkpoint: Path, step: int) -> None:
    """Refuse ``trainer.max_steps`` below the checkpoint's step: nothing to train, and not the model asked for.

    Raises:
        InputError: naming both steps and the two ways out.
    """
    if step > max_steps:
        raise InputError(
            f"trainer.max_steps={max_steps} but {checkpoint} is already complete at step {step}; raise "
            f"trainer.max_steps above {step} to continue, or pass a new hydra.run.dir to train {max_steps} steps "
            "from scratch"
        )

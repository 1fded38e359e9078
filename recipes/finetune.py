"""Fine-tune a causal LM on packed sequences, optionally with block-diagonal context parallelism.

    python recipes/finetune.py                      # cp=1, built-in defaults (CPU or GPU)
    python recipes/finetune.py +cp=blockdiag        # cp=2: starts 2 local workers
    torchrun --nproc-per-node 4 recipes/finetune.py +cp=blockdiag   # dp=2 x cp=2

Exit codes: 0 finished, 75 preempted (checkpoint saved: requeue), anything else failed.
See the README's recipe section for every option.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from nemo_automodel.components.config.errors import report_input_error
from nemo_automodel.components.config.overrides import check_override_keys
from nemo_automodel.components.config.schema import register_schema
from nemo_automodel.components.launcher.env import SECONDARY_RANK_HYDRA_OVERRIDES, is_secondary_rank
from nemo_automodel.components.training.preemption import combined_exit_code
from nemo_automodel.recipes.finetune import main

register_schema()
_exit_codes: list[int] = []  # Hydra drops the task's return value (a -m sweep runs it several times)


@hydra.main(version_base="1.3", config_path="../conf", config_name="finetune")
def finetune(cfg: DictConfig) -> None:
    _exit_codes.append(main(cfg, Path(HydraConfig.get().runtime.output_dir)))


if __name__ == "__main__":
    try:  # a plain typo gets our did-you-mean before Hydra's "+key" hint
        check_override_keys(sys.argv[1:])
    except ValueError as exc:
        sys.exit(report_input_error(exc, not is_secondary_rank()))
    if is_secondary_rank():
        sys.argv.extend(SECONDARY_RANK_HYDRA_OVERRIDES)
    finetune()
    sys.exit(combined_exit_code(_exit_codes))

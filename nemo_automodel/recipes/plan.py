"""The planner's command line with ``--data``: the recipe's own packed rows (:mod:`.blockdiag_cp.plan`).

    python -m nemo_automodel.recipes.plan --cp 8 --seq-len 131072 --data train.jsonl \\
        [--data-format text|chat|instruction] [--text-field text] [--tokenizer /local/hf_tokenizer_dir] [--rows 8]

Takes every option of the core planner; ``--data`` is read, formatted, tokenized and
packed by the recipe's data pipeline (:func:`~nemo_automodel.components.datasets.loader.prepare_data`),
which the CP core does not import.
"""

from __future__ import annotations

import argparse

from nemo_automodel.components.config.schema import DataConfig, TokenizerConfig
from nemo_automodel.components.datasets.loader import prepare_data
from nemo_automodel.components.datasets.tokenizer import build_tokenizer
from nemo_automodel.components.distributed.blockdiag_cp import plan


def recipe_rows(args: argparse.Namespace) -> list[list[int]]:
    """Document lengths of the first ``--rows`` rows the recipe would pack from ``--data``.

    Raises:
        ValueError: the recipe's own message for bad data.
    """
    cfg = DataConfig(source=args.data_format, path=args.data, text_field=args.text_field, seq_len=args.seq_len)
    rows = prepare_data(cfg, build_tokenizer(TokenizerConfig(name_or_path=args.tokenizer))).train
    lengths = []
    for seq_ids in rows.seq_ids[: args.rows]:
        _, counts = seq_ids[seq_ids > 0].unique_consecutive(return_counts=True)
        lengths.append(counts.tolist())
    return lengths


def main(argv: list[str] | None = None) -> None:
    """The core planner's command line, with ``--data`` served by :func:`recipe_rows`."""
    plan.main(argv, rows_from_data=recipe_rows)


if __name__ == "__main__":
    main()

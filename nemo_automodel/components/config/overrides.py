"""Command-line overrides checked against the schema before Hydra composes them.

Hydra answers a plain typo (``trainer.max_step=5``) with "To append to your config use
+trainer.max_step=5", which sends a newcomer the wrong way; following it only then reaches our
did-you-mean (:func:`~nemo_automodel.components.config.schema.to_finetune_config`). Checking the keys of
the plain ``key=value`` overrides first gives the did-you-mean on the first try. Additions (``+``,
``++``), deletions (``~``), ``hydra.*`` and package-qualified overrides are left to Hydra and to the
schema's own checks.
"""

from __future__ import annotations

from typing import Any

from nemo_automodel.components.config.schema import FinetuneConfig, reject_unknown_keys


def override_keys(argv: list[str]) -> list[str]:
    """The dotted keys of ``argv``'s plain ``key=value`` overrides (Hydra's own grammar parses them).

    Flags (``-m``, ``--cfg job``) and their values are skipped; an override Hydra cannot parse yields
    nothing here (Hydra reports it).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    candidates = [arg for arg in argv if "=" in arg and not arg.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(candidates)
    except HydraException:
        return []
    plain = [o for o in parsed if not (o.is_add() or o.is_force_add() or o.is_delete() or o.package)]
    return [o.key_or_group for o in plain if o.key_or_group.split(".")[0] != "hydra"]


def check_override_keys(argv: list[str]) -> None:
    """Raise a ``ValueError`` with a did-you-mean for the first override whose key the schema lacks.

    A group choice (``data=chat``) is a top-level key, so a misspelt group (``dat=chat``) is caught too.
    """
    for key in override_keys(argv):
        nested: dict[str, Any] = {}
        parts = key.split(".")
        leaf = nested
        for part in parts[:-1]:
            leaf = leaf.setdefault(part, {})
        leaf[parts[-1]] = None
        try:
            reject_unknown_keys(nested, FinetuneConfig)
        except ValueError as exc:  # say where it came from: the line a job log shows is all a user sees
            raise ValueError(f"{exc} (from the command-line override {key}=...)") from None

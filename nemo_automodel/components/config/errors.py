"""Config, path and data errors: one clear line on the console, the traceback in the run dir's log.

Such an error is the user's to fix, and its message says how (it names the field);
a traceback would bury it. The recipe catches ``ValueError`` where it validates the
config, opens paths and prepares the data (:func:`input_errors`), prints
``error: <message>`` to stderr, writes message and traceback only to the log files
(``finetune.log``) and exits with
:data:`EXIT_INPUT_ERROR`; the local launcher recognises that exit code and does
not print the workers' tracebacks either.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

# sysexits.h EX_DATAERR: the input was incorrect.
EXIT_INPUT_ERROR = 65

logger = logging.getLogger("nemo_automodel.finetune")


class InputError(ValueError):
    """A bad config value, path or data record (the message names the field and the fix).

    ``echo`` marks a copy of another rank's error (rank 0's data outcome): it is not printed again.
    """

    def __init__(self, message: str, echo: bool = False) -> None:
        super().__init__(message)
        self.echo = echo


@contextlib.contextmanager
def input_errors() -> Iterator[None]:
    """Turn a ``ValueError`` raised inside into an :class:`InputError` (same message, chained)."""
    try:
        yield
    except InputError:
        raise
    except ValueError as exc:
        raise InputError(str(exc)) from exc


def log_to_files_only(record: logging.LogRecord) -> None:
    """Hand ``record`` to the root logger's file handlers only (the console stays uncluttered)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            handler.handle(record)


def report_input_error(exc: ValueError, show: bool = True) -> int:
    """Print ``error: <message>`` to stderr (when ``show``), log it with its traceback to the log files only.

    Returns:
        :data:`EXIT_INPUT_ERROR`.
    """
    if show and not getattr(exc, "echo", False):
        print(f"error: {exc}", file=sys.stderr, flush=True)
    record = logger.makeRecord(
        logger.name, logging.ERROR, __file__, 0, "%s", (exc,), (type(exc), exc, exc.__traceback__)
    )
    log_to_files_only(record)
    return EXIT_INPUT_ERROR

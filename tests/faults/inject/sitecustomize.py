"""Test-only: a recipe subprocess started with this directory on ``PYTHONPATH`` gets the fault in ``NEMO_TEST_FAULT``
(a kernel fault) or ``NEMO_TEST_SIGNAL`` (signals at a phase, ``tests/faults/signals.py``).

Python imports ``sitecustomize`` at start-up in every process, so the launcher and
each spawned worker install the fault before the recipe runs
(``tests.faults.injection.install_from_env``; only the worker whose ``RANK``
matches misbehaves). Without ``NEMO_TEST_FAULT`` this does nothing.
"""

import os

if os.environ.get("NEMO_TEST_FAULT"):
    from tests.faults.injection import install_from_env

    install_from_env(os.environ["NEMO_TEST_FAULT"])

if os.environ.get("NEMO_TEST_SIGNAL"):
    from tests.faults.signals import install_from_env as install_signal

    install_signal(os.environ["NEMO_TEST_SIGNAL"])

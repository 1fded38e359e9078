#!/usr/bin/env bash
# The project's test command (the README's second command). It sets itself up:
# installs the pinned CPU torch (from local disk on these machines) and the
# project with its test extras, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
exec "$PY" -m pytest -q "$@"

#!/usr/bin/env bash
# The project's test command (the README's second command).
#
#   bash tests/run.sh                 # the whole suite
#   bash tests/run.sh --quick         # a first check: the CP core, the bad-input catalogue, one cp=2 recipe run
#   bash tests/run.sh --keep-images   # keep the container tests' images (or TESTS_KEEP_IMAGES=1)
#   bash tests/run.sh [--quick] -k parity -x   # anything else goes to pytest
#
# What it does, and what it leaves behind:
# - pip installs the pinned CPU torch and this project (editable, with its test extras) into the Python it runs
#   ($PYTHON, default python3); they stay installed.
# - The whole suite, run as root, also installs Debian packages with apt-get when they are missing, and they
#   stay installed: slurm-wlm, munge and iproute2 (tests/slurm: a two-node Slurm cluster in network
#   namespaces) and buildah, podman, runc and mmdebstrap (tests/container: builds docker/Dockerfile). Not as
#   root, those tests skip and say why. --quick installs no Debian package.
# - The container tests build images (a local Debian base, localhost/blockdiag-cp-base:<hash>, and
#   localhost/blockdiag-cp:test; about 3.1 GB) and a wheel cache (~/.cache/blockdiag-cp/container, about
#   400 MB). The images are removed when the run ends unless --keep-images or TESTS_KEEP_IMAGES=1 (keeping
#   them saves the next run the base build); the wheel cache stays (rm -rf it to reclaim the space).
# - Time on 2 idle CPU cores: the whole suite about 16 minutes (14.3 of pytest, 1833 tests); --quick
#   about 1 minute (394 tests; see docs/first_run.md for the measured figures).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
KEEP_IMAGES=${TESTS_KEEP_IMAGES:-0}
QUICK=0
ARGS=()
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        --keep-images) KEEP_IMAGES=1 ;;
        *) ARGS+=("$arg") ;;
    esac
done
# --quick: the CP core (shard plans, layouts, cost model, kernels against the float64 reference), every
# rejected input of docs/bad_inputs.md, and the README's main command (cp=2, a few steps) end to end.
QUICK_TESTS=(
    tests/test_batch.py
    tests/test_layout.py
    tests/test_cost.py
    tests/test_state.py
    tests/test_kernels.py
    tests/faults/test_bad_input_catalogue.py
    tests/test_recipe_end_to_end.py::test_main_command_trains_cp2_and_writes_metrics_checkpoint_and_hf_export
)

remove_test_images() {
    [[ $KEEP_IMAGES == 1 ]] && return 0
    command -v podman >/dev/null 2>&1 || return 0
    local images
    images=$(podman images --format '{{.Repository}}:{{.Tag}}' 2>/dev/null \
        | grep -E '^localhost/blockdiag-cp(-base)?:' | grep -v ':local$' || true)
    [[ -z $images ]] && return 0
    echo "tests/run.sh: removing the container tests' images (keep them: --keep-images or TESTS_KEEP_IMAGES=1)" >&2
    # shellcheck disable=SC2086  # one image name per word
    podman rmi -f $images >/dev/null 2>&1 || echo "tests/run.sh: could not remove $images" >&2
}

"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
if [[ $QUICK == 1 ]]; then
    exec "$PY" -m pytest -q "${QUICK_TESTS[@]}" "${ARGS[@]}"
fi
trap remove_test_images EXIT
"$PY" -m pytest -q "${ARGS[@]}"

"""Config composition, and bad configs failing before any worker or process group exists.

Every rejected value is a row of docs/bad_inputs.md (tests/faults/test_bad_input_catalogue.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from nemo_automodel.components.config.errors import EXIT_INPUT_ERROR
from nemo_automodel.components.config.schema import register_schema, to_finetune_config
from nemo_automodel.components.distributed.parallel import resolve_topology
from tests.recipe_helpers import REPO, recipe_env, run_recipe


def _compose(*overrides: str):
    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="finetune", overrides=list(overrides))


def _config(*overrides: str):
    return to_finetune_config(_compose(*overrides))


def test_plain_run_is_cp1_and_plus_cp_blockdiag_selects_cp2_and_the_cost_model():
    assert _config().cp.size == 1
    cp = _config("+cp=blockdiag").cp
    assert (cp.size, cp.attn_backend, cp.kv_exchange, cp.layout, cp.overlap) == (2, "auto", "auto", "auto", True)


@pytest.mark.parametrize(
    ("override", "field", "canonical"),
    [
        ("cp.kv_exchange=needed_only", "kv_exchange", "halo"),
        ("cp.kv_exchange=all_to_all", "kv_exchange", "a2a"),
        ("cp.kv_exchange=all-gather", "kv_exchange", "allgather"),
        ("cp.attn_backend=flash_attn", "attn_backend", "flash"),
        ("cp.attn_backend=sdpa_varlen", "attn_backend", "sdpa_varlen"),
        ("cp.check_finite=false", "check_finite", False),
    ],
)
def test_cp_knobs_accept_canonical_and_upstream_spellings(override, field, canonical):
    assert getattr(_config("+cp=blockdiag", override).cp, field) == canonical


def test_topology_derives_dp_and_the_dp_rank():
    topo = resolve_topology(world=4, rank=3, local_rank=1, cp_size=2, dp_size=None)
    assert (topo.dp, topo.cp, topo.dp_rank) == (2, 2, 1)


def test_script_rejects_a_bad_config_before_starting_workers(tmp_path):
    done = run_recipe(["+cp=blockdiag", "cp.kv_exchange=ring", f"hydra.run.dir={tmp_path}"], timeout=120)
    assert done.returncode == EXIT_INPUT_ERROR
    assert "Unknown kv_exchange 'ring'" in done.stderr
    assert "starting 2 local workers" not in done.stderr + done.stdout


def test_script_under_torchrun_env_rejects_cp_not_dividing_world(tmp_path):
    """RANK/WORLD_SIZE from a launcher: the topology check fails before init_process_group (no hang)."""
    env = recipe_env() | {
        "RANK": "0",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    done = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "finetune.py"), "+cp=blockdiag", f"hydra.run.dir={tmp_path}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_INPUT_ERROR
    assert "cp.size=2 does not divide the world size 3" in done.stderr

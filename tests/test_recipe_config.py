"""Config composition and bad-input errors (raised before any process group exists)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from nemo_automodel.components.config.checks import check_paths
from nemo_automodel.components.config.schema import register_schema, to_finetune_config
from nemo_automodel.components.distributed.parallel import resolve_topology
from tests.recipe_helpers import REPO, recipe_env, run_recipe


def _compose(*overrides: str):
    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="finetune", overrides=list(overrides))


def _config(*overrides: str):
    return to_finetune_config(_compose(*overrides))


def test_plain_run_is_cp1_and_plus_cp_blockdiag_selects_cp2_auto_halo():
    assert _config().cp.size == 1
    cp = _config("+cp=blockdiag").cp
    assert (cp.size, cp.attn_backend, cp.kv_exchange) == (2, "auto", "halo")


@pytest.mark.parametrize(
    ("override", "field", "canonical"),
    [
        ("cp.kv_exchange=neighbour", "kv_exchange", "halo"),
        ("cp.kv_exchange=all_to_all", "kv_exchange", "a2a"),
        ("cp.kv_exchange=all-gather", "kv_exchange", "allgather"),
        ("cp.attn_backend=fa2", "attn_backend", "flash"),
        ("cp.attn_backend=per_doc", "attn_backend", "sdpa_varlen"),
        ("cp.attn_backend=sdpa", "attn_backend", "dense"),
    ],
)
def test_cp_knobs_accept_the_core_synonyms(override, field, canonical):
    assert getattr(_config("+cp=blockdiag", override).cp, field) == canonical


@pytest.mark.parametrize(
    ("override", "message"),
    [("cp.kv_exchange=ring", "Unknown kv_exchange 'ring'"), ("cp.attn_backend=cudnn", "Unknown attn_backend 'cudnn'")],
)
def test_unknown_cp_knob_values_fail_with_the_normalizer_message(override, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        _config("+cp=blockdiag", override)
    assert "Valid values" in str(info.value)


def test_misspelt_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as info:
        _compose("trainer.max_stepz=3")
    assert "max_stepz" in str(info.value.__cause__ or info.value)


def test_wrongly_typed_value_fails_at_composition():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose("trainer.max_steps=many")


def test_misspelt_key_in_a_plain_dict_fails_like_in_hydra():
    with pytest.raises(ConfigKeyError, match=re.escape("seq_length")):
        to_finetune_config({"data": {"seq_length": 128}})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+cp=blockdiag", "data.seq_len=3"], "data.seq_len=3 is smaller than 2 * cp.size = 4"),
        (["data.seq_len=1"], "data.seq_len=1 cannot hold"),
        (["data.seq_len=8192"], "exceeds model.max_position_embeddings"),
        (["+cp=blockdiag", "model.attention=eager"], "model.attention=eager never reaches SDPA"),
        (["model.attention=flex"], "model.attention='flex' is not valid"),
        (["data.packing_algorithm=best_fit"], "data.packing_algorithm='best_fit' is not valid"),
        (["model.num_heads=6"], "must be a multiple of model.num_kv_heads"),
        (["trainer.resume=sometimes"], "trainer.resume='sometimes' is not valid"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(*overrides)


def test_jsonl_without_path_names_the_missing_field():
    with pytest.raises(ValueError, match=re.escape("data.path is required with data=jsonl")):
        check_paths(_config("data=jsonl"))


def test_missing_files_and_directories_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"data\.path=.*no such file"):
        check_paths(_config("data=jsonl", f"data.path={tmp_path / 'none.jsonl'}"))
    with pytest.raises(ValueError, match=r"model\.pretrained_path=.*no such directory"):
        check_paths(_config(f"model.pretrained_path={tmp_path / 'no_model'}"))
    with pytest.raises(ValueError, match=r"tokenizer\.name_or_path=.*no such directory"):
        check_paths(_config(f"tokenizer.name_or_path={tmp_path / 'no_tok'}"))


def test_cp_size_must_divide_the_world():
    with pytest.raises(ValueError, match=re.escape("cp.size=2 does not divide the world size 3")):
        resolve_topology(world=3, rank=0, local_rank=0, cp_size=2, dp_size=None)
    with pytest.raises(ValueError, match=re.escape("dist.dp_size=2 with cp.size=2 needs 4 ranks")):
        resolve_topology(world=2, rank=0, local_rank=0, cp_size=2, dp_size=2)
    topo = resolve_topology(world=4, rank=3, local_rank=1, cp_size=2, dp_size=None)
    assert (topo.dp, topo.cp, topo.dp_rank) == (2, 2, 1)


def test_script_rejects_a_bad_config_before_starting_workers(tmp_path):
    done = run_recipe(["+cp=blockdiag", "cp.kv_exchange=ring", f"hydra.run.dir={tmp_path}"], timeout=120)
    assert done.returncode == 1
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
    assert done.returncode == 1
    assert "cp.size=2 does not divide the world size 3" in done.stderr

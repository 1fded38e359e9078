"""CPOptions is the one definition of the CP settings: spellings, defaults, the Hydra node and the environment."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
import torch.distributed as dist

from nemo_automodel.components.config.schema import CPConfig, to_finetune_config
from nemo_automodel.components.distributed.blockdiag_cp import (
    cp_blockdiag_sdpa,
    make_cp_blockdiag_batch_and_ctx,
    options,
)
from nemo_automodel.components.distributed.blockdiag_cp.options import CPOptions
from nemo_automodel.testing.cases import cp_mesh, layout


@pytest.mark.parametrize("name", list(options.UPSTREAM_SPELLINGS))
def test_each_value_is_its_canonical_name_or_upstreams_spelling(name):
    for value in options.choices(name):
        assert options.normalize(name, value) == value
        assert options.normalize(name, value.upper()) == value
    for spelling, canonical in options.UPSTREAM_SPELLINGS[name].items():
        assert canonical in options.choices(name)
        assert options.normalize(name, spelling) == canonical
    assert options.normalize(name, None) == options.default(name)


@pytest.mark.parametrize("name", list(options.RETIRED_SPELLINGS))
def test_a_former_synonym_raises_naming_the_canonical_value(name):
    for spelling, canonical in options.RETIRED_SPELLINGS[name].items():
        with pytest.raises(ValueError, match=f"{name}='{spelling}' is no longer accepted: write {name}='{canonical}'"):
            options.normalize(name, spelling)


def test_unknown_value_names_the_setting_and_every_valid_value():
    with pytest.raises(ValueError) as err:
        CPOptions(kv_exchange="ring")
    assert "Unknown kv_exchange 'ring'" in str(err.value)
    assert all(v in str(err.value) for v in options.choices("kv_exchange"))


def test_string_settings_are_literal_typed_with_one_set_of_defaults():
    hints = typing.get_type_hints(CPOptions)
    for name in options.UPSTREAM_SPELLINGS:
        assert typing.get_origin(hints[name]) is typing.Literal
    # The Hydra node is generated from CPOptions: same fields (attn_shape is the caller's, not config) and defaults.
    node = {f.name: f for f in dataclasses.fields(CPConfig)}
    core = [f.name for f in dataclasses.fields(CPOptions) if f.name != "attn_shape"]
    assert list(node) == ["size", *core]
    defaults = CPConfig()
    assert all(getattr(defaults, name) == getattr(CPOptions(), name) for name in core)


def test_the_recipe_sets_every_setting_including_check_finite():
    cp = to_finetune_config({"cp": {"size": 2, "check_finite": False, "kv_exchange": "needed_only"}}).cp
    built = cp.options()
    assert (built.check_finite, built.kv_exchange, cp.kv_exchange) == (False, "halo", "halo")


def test_allow_cross_node_is_read_from_the_environment_once_when_options_are_built(monkeypatch):
    monkeypatch.setenv("NEMO_CP_ALLOW_XNODE", "1")
    built = CPOptions()
    from_config = to_finetune_config({"cp": {"size": 2}}).cp.options()
    monkeypatch.delenv("NEMO_CP_ALLOW_XNODE")
    assert built.allow_cross_node and from_config.allow_cross_node
    assert built.replace(layout="balanced").allow_cross_node  # a copy keeps it; the environment is not read again
    assert not CPOptions().allow_cross_node
    assert not CPOptions(allow_cross_node=False).allow_cross_node


def _odd_setting(name: str, value: object) -> str:
    ids = layout("straddle", dist.get_world_size())
    batch = {"input_ids": torch.zeros(1, ids.shape[1], dtype=torch.long), "_packed_seq_ids": ids}
    opts = CPOptions(attn_backend="sdpa_varlen")
    if dist.get_rank() == 1:
        opts = opts.replace(**{name: value})
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, batch, options=opts)
    q = torch.zeros(1, 2, shard.local_len, 4)
    try:
        with ctx():
            cp_blockdiag_sdpa(q, q, q)
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return "no error"


@pytest.mark.parametrize(("name", "value"), [("allow_cross_node", True), ("check_finite", True)])
def test_every_setting_is_agreed_by_the_ranks_without_listing_it(pools, name, value):
    """A new CPOptions field is in the row's agreement automatically: ranks that differ all raise, naming it."""
    heads = pools.get(2).run_ok(_odd_setting, name, value, timeout=60)
    assert all(head.startswith(f"block-diagonal CP ranks disagree on {name}") for head in heads), heads

"""CPOptions is the one definition of the CP settings: spellings, defaults, the Hydra node and the environment."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from nemo_automodel.components.config.schema import CPConfig, to_finetune_config
from nemo_automodel.components.distributed.blockdiag_cp import options
from nemo_automodel.components.distributed.blockdiag_cp.options import CPOptions


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

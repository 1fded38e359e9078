"""Shared fixtures: persistent gloo process pools and clean package state per test."""

from __future__ import annotations

import pytest

from nemo_automodel.components.distributed.blockdiag_cp import state as state_module
from tests.dist_pool import PoolCache


@pytest.fixture(scope="session")
def pools():
    """``pools.get(world)`` -> a live :class:`tests.dist_pool.DistPool` of ``world`` gloo ranks."""
    cache = PoolCache()
    yield cache
    cache.close()


@pytest.fixture(autouse=True)
def _no_leftover_state():
    """Every test starts and must end with no active step state and default knobs."""
    state_module.configure_cp_varlen()
    yield
    leftover = state_module.current_row_state()
    state_module._ROW_STATE.set(None)
    state_module.configure_cp_varlen()
    assert leftover is None, "a test left a block-diagonal CP step state active"

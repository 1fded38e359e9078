"""The seed API of runtime.py: pass-through, config resolution, path decisions, consensus, failure handling."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_automodel.components.distributed.blockdiag_cp import (
    AttentionVariant,
    CPOptions,
    compat,
    configure_cp_varlen,
    consensus,
    cp_blockdiag_sdpa,
    exchange_stats,
    kernels,
    make_cp_blockdiag_batch_and_ctx,
    runtime,
)
from nemo_automodel.components.distributed.blockdiag_cp.logs import reset_log_once
from nemo_automodel.testing.cases import cp_mesh, layout
from nemo_automodel.testing.reference import doc_ids_from_lengths

# ----------------------------------------------------------------------------- single process


def _qkv(hq=4, hkv=2, length=8, d=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(1, hq, length, d, generator=gen, dtype=dtype),
        torch.randn(1, hkv, length, d, generator=gen, dtype=dtype),
        torch.randn(1, hkv, length, d, generator=gen, dtype=dtype),
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"is_causal": True},
        {"scale": 0.2},
        {"enable_gqa": True},
        {"attn_mask": torch.rand(8, 8) > 0.3},
        {"attn_mask": torch.randn(8, 8)},
        {"dropout_p": 0.5, "is_causal": True},
    ],
)
def test_without_step_state_it_is_exactly_stock_sdpa(kwargs):
    q, k, v = _qkv()
    if not kwargs.get("enable_gqa"):
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    torch.manual_seed(1)
    want = F.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.manual_seed(1)
    assert torch.equal(cp_blockdiag_sdpa(q, k, v, **kwargs), want)


def test_without_step_state_unknown_arguments_fail_like_stock_sdpa():
    q, k, v = _qkv(hkv=4)
    with pytest.raises(TypeError):
        cp_blockdiag_sdpa(q, k, v, not_an_sdpa_argument=1)


def test_step_snapshot_wins_over_module_config():
    configure_cp_varlen(attn_backend="dense", kv_exchange="a2a")
    ctx, _, _ = make_cp_blockdiag_batch_and_ctx(
        None, None, {"input_ids": torch.ones(1, 4, dtype=torch.long)}, attn_backend="te", kv_exchange="allgather"
    )
    with ctx() as st:
        assert compat._resolve_cp_varlen_config(st) == ("te", "allgather")
        configure_cp_varlen(kv_exchange="halo")  # a later default never reaches a built step
        assert compat._resolve_cp_varlen_config(st) == ("te", "allgather")
    configure_cp_varlen(attn_backend="dense", kv_exchange="a2a")
    assert compat._resolve_cp_varlen_config({"attn_backend": "flash_attn"}) == ("flash", "a2a")
    assert compat._resolve_cp_varlen_config({}) == ("dense", "a2a")


# ----------------------------------------------------------------------------- distributed helpers


@contextlib.contextmanager
def _env(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _kernel(name, **changes):
    saved = kernels.KERNELS[name]
    kernels.KERNELS[name] = replace(saved, **changes)
    try:
        yield
    finally:
        kernels.KERNELS[name] = saved


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


@contextlib.contextmanager
def _captured(logger):
    handler = _Records()
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _step(ids, **knobs):
    batch = {"input_ids": torch.zeros(1, ids.shape[1], dtype=torch.long), "_packed_seq_ids": ids}
    ctx, _, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh(), None, batch, **knobs)
    return ctx, shard


def _local_qkv(shard, requires_grad=False):
    q, k, v = _qkv(length=shard.padded_seq_len)
    rows = slice(shard.row_offset, shard.row_offset + shard.local_len)
    return tuple(t[:, :, rows].clone().requires_grad_(requires_grad) for t in (q, k, v))


# ----------------------------------------------------------------------------- path decisions


def _path_for(ids, env, knobs, broken_rank=None):
    with (
        _env(**env),
        _kernel(
            "dense",
            device_types=frozenset({"cuda"})
            if dist.get_rank() == broken_rank
            else kernels.KERNELS["dense"].device_types,
        ),
    ):
        ctx, shard = _step(ids, **knobs)
        q, k, v = _local_qkv(shard)
        with ctx() as st:
            path, plan, reason = compat._select_kv_exchange_path(
                st, st.group, compat.row_doc_ids(st), shard.local_len, q.device, st.row_offset, query_dtype=q.dtype
            )
            out = cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
            stats = exchange_stats()
    return path, plan is not None, reason, stats["path"], stats["attn_backend"], out


@pytest.mark.parametrize(
    ("env", "knobs", "broken", "want_path", "needle"),
    [
        ({}, {"kv_exchange": "allgather"}, None, "allgather", "kv_exchange=allgather (configured)"),
        ({}, {"kv_exchange": "halo"}, None, "halo", "left neighbour only"),
        ({}, {"kv_exchange": "a2a"}, None, "a2a", "kv_exchange=a2a (configured)"),
    ],
)
def test_every_downgrade_names_its_reason_on_every_rank(pools, env, knobs, broken, want_path, needle):
    env = {"NEMO_CP_ALLOW_XNODE": None, **env}  # spanning nodes: tests/test_topology.py
    results = pools.get(2).run_ok(_path_for, layout("straddle", 2), env, knobs, broken)
    for path, has_plan, reason, used_path, _, _ in results:
        assert (path, used_path) == (want_path, want_path)
        assert has_plan == (want_path != "allgather")
        assert needle in reason


@pytest.mark.parametrize("kv_exchange", ["allgather", "halo"])
def test_an_explicit_kernel_one_rank_cannot_run_makes_every_rank_raise(pools, kv_exchange):
    """Never a silent downgrade (the seed replaced it by sdpa_varlen), never a hang: every rank raises."""
    env = {"LOCAL_WORLD_SIZE": None, "NPROC_PER_NODE": None, "NEMO_CP_ALLOW_XNODE": None}
    knobs = {"kv_exchange": kv_exchange, "attn_backend": "dense"}
    results = pools.get(2).run(_path_for, layout("straddle", 2), env, knobs, 1, timeout=60)
    assert all(not r.ok and r.error_type == "RuntimeError" for r in results), [r.message for r in results]
    assert all("disagree on resolved kernel" in r.message for r in results)
    assert "attn_backend='dense' cannot run here: dense needs device cuda" in results[1].message
    pools.ensure_healthy(2)


def _attend_with_window(ids, windows):
    """One CP call whose sliding window is ``windows[rank]`` (a model differing between ranks)."""
    ctx, shard = _step(ids, kv_exchange="halo")
    q, k, v = _local_qkv(shard)
    with ctx():
        variant = AttentionVariant(window=windows[dist.get_rank()])
        return cp_blockdiag_sdpa(q, k, v, enable_gqa=True, variant=variant).shape


def test_ranks_with_different_attention_variants_all_raise(pools):
    """The variant is part of the step agreement: a rank with another window makes every rank raise together."""
    results = pools.get(2).run(_attend_with_window, layout("straddle", 2), [None, 4], timeout=60)
    assert all(not r.ok and r.error_type == "RuntimeError" for r in results), [r.message for r in results]
    assert all("disagree on attention variant" in r.message for r in results), [r.message for r in results]
    assert all(r.ok for r in pools.get(2).run(_attend_with_window, layout("straddle", 2), [4, 4], timeout=60))
    pools.ensure_healthy(2)


def test_halo_becomes_a2a_when_a_document_spans_three_ranks(pools):
    results = pools.get(3).run_ok(_path_for, layout("spans_many", 3), {}, {"kv_exchange": "halo"})
    assert {r[0] for r in results} == {"a2a"}
    assert all("upgraded to a2a" in r[2] for r in results)


def _counting_all_reduce_calls(layers):
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    ctx, shard = _step(layout("straddle", 2), kv_exchange="halo")
    q, k, v = _local_qkv(shard)
    dist.all_reduce = counting
    try:
        with ctx() as st:
            for _ in range(layers):
                cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
            plans = {id(st.cache.windows[None].kv_plan())}
            compat._select_kv_exchange_path(
                st, st.group, compat.row_doc_ids(st), shard.local_len, q.device, st.row_offset, query_dtype=q.dtype
            )
            plans.add(id(st.cache.windows[None].kv_plan()))
    finally:
        dist.all_reduce = original
    return len(calls), len(plans)


def test_control_collectives_and_plan_do_not_grow_with_layers(pools):
    one = pools.get(2).run_ok(_counting_all_reduce_calls, 1)
    four = pools.get(2).run_ok(_counting_all_reduce_calls, 4)
    # per step: the agreement check and, when the context exits, the failure settlement; none per layer
    assert [c for c, _ in one] == [2, 2] and [c for c, _ in four] == [2, 2]
    assert all(n_plans == 1 for _, n_plans in one + four)


# ----------------------------------------------------------------------------- consensus and failures


def _succeeded_when(failing_rank):
    out = None if dist.get_rank() == failing_rank else torch.zeros(1)
    return runtime._needed_only_kernel_succeeded_on_all_ranks(
        out, dist.group.WORLD, torch.device("cpu"), diagnostic="test"
    )


@pytest.mark.parametrize("failing_rank", [None, 0, 2])
def test_kernel_success_consensus_is_the_same_on_every_rank(pools, failing_rank):
    assert pools.get(3).run_ok(_succeeded_when, failing_rank) == [failing_rank is None] * 3


def _boom(*args, **kwargs):
    raise RuntimeError("injected kernel failure")


def _fail_kernel_on(rank, kv_exchange, backward):
    ctx, shard = _step(layout("straddle", 2), kv_exchange=kv_exchange, attn_backend="sdpa_varlen")
    q, k, v = _local_qkv(shard, requires_grad=True)
    fn = _boom if dist.get_rank() == rank else kernels.KERNELS["sdpa_varlen"].fn
    with _kernel("sdpa_varlen", fn=fn), ctx():
        out = cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
        out.sum().backward()


@pytest.mark.parametrize("kv_exchange", ["allgather", "halo", "a2a"])
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_kernel_failure_on_one_rank_makes_every_rank_raise(pools, kv_exchange, failing_rank):
    results = pools.get(2).run(_fail_kernel_on, failing_rank, kv_exchange, False, timeout=60)
    assert all(not r.ok and r.error_type == "RuntimeError" for r in results)
    assert all(f"failed on CP rank(s) [{failing_rank}]" in r.message for r in results)
    assert "injected kernel failure" in results[failing_rank].message
    pools.ensure_healthy(2)


def _pad_rank_kernel_calls():
    calls = []
    real = kernels.KERNELS["sdpa_varlen"].fn

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    ids = doc_ids_from_lengths([14], 32)  # rank 1 of 2 (rows 16..31) holds only padding
    ctx, shard = _step(ids, kv_exchange="a2a", attn_backend="sdpa_varlen")
    q, k, v = _local_qkv(shard, requires_grad=True)
    with _kernel("sdpa_varlen", fn=counting), ctx():
        out = cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
        out.sum().backward()
    return len(calls), k.grad is not None


def test_all_padding_rank_launches_no_kernel_but_joins_backward(pools):
    assert pools.get(2).run_ok(_pad_rank_kernel_calls) == [(1, True), (0, True)]


def _path_logs():
    reset_log_once()
    ctx, shard = _step(layout("straddle", 2), kv_exchange="halo")
    q, k, v = _local_qkv(shard)
    with _captured(runtime.logger) as logs, ctx():
        for _ in range(3):
            cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
    return [m for level, m in logs if level == logging.INFO], exchange_stats()


def test_path_is_logged_once_at_info_and_stats_describe_the_call(pools):
    for infos, stats in pools.get(2).run_ok(_path_logs):
        assert len(infos) == 1 and "path=halo" in infos[0]
        assert {"path", "reason", "attn_backend", "kv_tokens_received", "kv_bytes_received"} <= set(stats)
        assert stats["exchange_calls"] >= 3 and stats["exchange_wait_s"] >= 0.0
        # fused [K; V]: 2 * Hkv heads x D x 4 bytes per received token
        assert stats["kv_bytes_received"] == stats["kv_tokens_received"] * 2 * 2 * 8 * 4


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected backward failure")


def _fail_backward_on(rank, kv_exchange):
    ctx, shard = _step(layout("straddle", 2), kv_exchange=kv_exchange, attn_backend="sdpa_varlen")
    q, k, v = _local_qkv(shard, requires_grad=True)
    real = kernels.KERNELS["sdpa_varlen"].fn

    def failing(*args):
        return _FailingBackward.apply(real(*args))

    with _kernel("sdpa_varlen", fn=failing if dist.get_rank() == rank else real), ctx():
        out = cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
        out.sum().backward()


@pytest.mark.parametrize("kv_exchange", ["allgather", "halo", "a2a"])
def test_backward_kernel_failure_on_one_rank_makes_every_rank_raise(pools, kv_exchange):
    results = pools.get(2).run(_fail_backward_on, 1, kv_exchange, timeout=60)
    assert all(not r.ok and r.error_type == "RuntimeError" for r in results), [r.message for r in results]
    assert all("backward failed on CP rank(s) [1]" in r.message for r in results)
    assert "injected backward failure" in results[1].message
    pools.ensure_healthy(2)


def _auto_paths(name, shard_layout):
    ctx, shard = _step(layout(name, 3), kv_exchange="auto", layout=shard_layout)
    q, k, v = _local_qkv(shard)
    with _captured(runtime.logger) as logs, ctx():
        cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
    return exchange_stats()["path"], exchange_stats()["reason"], [m for _, m in logs if "kv_exchange=auto" in m]


@pytest.mark.parametrize("name", ["straddle", "spans_many"])
@pytest.mark.parametrize("shard_layout", ["contiguous", "balanced"])
def test_auto_exchange_picks_one_path_on_every_rank_and_logs_its_prediction(pools, name, shard_layout):
    results = pools.get(3).run_ok(_auto_paths, name, shard_layout)
    assert len({(path, reason) for path, reason, _ in results}) == 1
    path, reason, _ = results[0]
    assert path in ("allgather", "halo", "a2a") and "predicted" in reason


def _fail_with_options(rank, options, settle):
    """A forward kernel failure on ``rank``; returns where each rank raised (``None``: it did not)."""
    ctx, shard = _step(layout("straddle", 2), options=options)
    q, k, v = _local_qkv(shard, requires_grad=True)
    fn = _boom if dist.get_rank() == rank else kernels.KERNELS["sdpa_varlen"].fn
    raised = []
    with _kernel("sdpa_varlen", fn=fn):
        try:
            with ctx(settle=settle) as st:
                try:
                    out = cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
                except RuntimeError as exc:
                    raised.append(("call", str(exc)))
                    raise
                out.sum().backward()
        except RuntimeError as exc:
            if not raised:
                raised.append(("exit", str(exc)))
    if not settle:
        try:
            consensus.settle_failures([st.failures], st.group, torch.device("cpu"))
        except RuntimeError as exc:
            raised.append(("settle_failures", str(exc)))
    return raised


@pytest.mark.parametrize(
    ("consensus_mode", "settle", "where"),
    [("step", True, "exit"), ("call", True, "call"), ("step", False, "settle_failures")],
)
def test_a_failure_is_raised_once_per_step_or_per_call_on_every_rank(pools, consensus_mode, settle, where):
    options = CPOptions(attn_backend="sdpa_varlen", kv_exchange="halo", consensus=consensus_mode)
    results = pools.get(2).run_ok(_fail_with_options, 1, options, settle, timeout=60)
    for raised in results:
        assert [w for w, _ in raised] == [where]
        assert "forward failed on CP rank(s) [1] (CP rank 1: CP attention call 0)" in raised[0][1]
    assert "injected kernel failure" in results[1][0][1] and "injected" not in results[0][0][1]
    pools.ensure_healthy(2)

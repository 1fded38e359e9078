"""Packed layouts, the per-rank attention worker and independent expectations for CP parity checks.

Shared by the tests and ``benchmarks/gpu_check.py`` (which runs them on a GPU): each case's CP output and
gradients against the float64 reference of :mod:`nemo_automodel.testing.reference`, and its exchange path
and received K/V against a brute force from the definitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from nemo_automodel.components.distributed.blockdiag_cp import (
    AttentionVariant,
    configure_cp_varlen,
    cp_blockdiag_sdpa,
    exchange_stats,
    make_cp_blockdiag_batch_and_ctx,
)
from nemo_automodel.testing.reference import doc_ids_from_lengths, reference_attention

LOCAL = 16  # local rows per rank in the standard layouts
GPU_KERNELS = ("fa3", "flash", "te", "torch_varlen")


def _fill(pattern: list[int], total: int) -> list[int]:
    """Repeat ``pattern`` lengths until they cover exactly ``total`` tokens."""
    out: list[int] = []
    i = 0
    while sum(out) < total:
        out.append(min(pattern[i % len(pattern)], total - sum(out)))
        i += 1
    return out


def layout(name: str, cp: int) -> torch.Tensor:
    """Document ids ``[1, S]`` (S before CP padding) of a named layout family."""
    total = LOCAL * cp
    if name == "straddle":  # documents cross rank boundaries, none spans more than two ranks
        return doc_ids_from_lengths(_fill([11, 9, 14, 7], total), total)
    if name == "spans_many":  # one document over more than two ranks (two ranks at cp=2)
        first = LOCAL * cp // 2 + 5 if cp == 2 else int(LOCAL * 2.5)
        return doc_ids_from_lengths([first, *_fill([5, 12], total - first)], total)
    if name == "single_doc":
        return doc_ids_from_lengths([total], total)
    if name == "tiny_docs":
        return doc_ids_from_lengths(_fill([1, 2, 3, 1, 4], total), total)
    if name == "pad_rank":  # the last rank holds only padding
        real = LOCAL * (cp - 1) - 3
        return doc_ids_from_lengths([LOCAL + 1, real - LOCAL - 1], total)
    if name == "pad_tail":  # an odd length with an explicit padding tail; the builder pads further
        real = total - 9
        return doc_ids_from_lengths(_fill([13, 6], real), total - 3)
    raise KeyError(name)


LAYOUTS = ("straddle", "spans_many", "single_doc", "tiny_docs", "pad_rank", "pad_tail")


@dataclass(frozen=True)
class Case:
    """One CP attention call to check against the reference."""

    doc_ids: torch.Tensor
    backend: str
    kv_exchange: str
    heads: tuple[int, int]  # (Hq, Hkv)
    seed: int = 0
    head_dim: int = 8
    scale: float | None = None
    layout: str = "contiguous"
    overlap: bool = True
    device: str = "cpu"  # where q/k/v live (results come back as float64 on CPU)
    dtype: torch.dtype = torch.float64
    # one attention call per window in the step (None: full causal), like a model mixing layer kinds;
    # the checked output is sum_i (i + 1) * out_i
    windows: tuple[int | None, ...] = (None,)
    softcap: float | None = None
    sinks: bool = False  # learned sink logits [Hq] (a gradient is checked, summed over ranks)
    value_dim: int | None = None  # value head dim (None: head_dim); MLA models differ
    chunks: tuple[int, ...] = ()  # one more call per attention chunk size (Llama 4's chunked layers)

    @property
    def label(self) -> str:
        variant = "".join(
            (
                "" if self.windows == (None,) else f"/windows{list(self.windows)}",
                "" if self.softcap is None else f"/softcap{self.softcap}",
                "/sinks" if self.sinks else "",
                "" if self.value_dim is None else f"/Dv{self.value_dim}",
                "" if not self.chunks else f"/chunks{list(self.chunks)}",
            )
        )
        return (
            f"{self.layout}/{self.kv_exchange}/{self.backend}/Hq{self.heads[0]}-Hkv{self.heads[1]}"
            f"{'' if self.overlap else '/no-overlap'}{variant}"
        )

    def variants(self, sinks: torch.Tensor | None) -> list[AttentionVariant]:
        """The step's calls, one per window then one per chunk, sharing soft-cap and sinks."""
        windowed = [AttentionVariant(window=w, softcap=self.softcap, sinks=sinks) for w in self.windows]
        return windowed + [AttentionVariant(chunk=c, softcap=self.softcap, sinks=sinks) for c in self.chunks]

    @property
    def masks(self) -> list[tuple[int | None, int | None]]:
        """``(window, chunk)`` of each call of :meth:`variants`, in order."""
        return [(w, None) for w in self.windows] + [(None, c) for c in self.chunks]


def full_inputs(case: Case, padded_len: int) -> dict[str, torch.Tensor]:
    """Deterministic full-row q/k/v and output gradient (float64) for ``case``, in original order."""
    gen = torch.Generator().manual_seed(case.seed)
    hq, hkv = case.heads
    value_dim = case.value_dim or case.head_dim
    shapes = {
        "q": (1, hq, padded_len, case.head_dim),
        "k": (1, hkv, padded_len, case.head_dim),
        "v": (1, hkv, padded_len, value_dim),
        "gout": (1, hq, padded_len, value_dim),
        "sinks": (hq,),
    }
    return {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}


def cp_mesh():
    """The 1-D CP mesh over the whole (gloo) world."""
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))


def attend_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """Worker: run each case's forward and backward on this rank; return local outputs and grads."""
    mesh = cp_mesh()
    return [attend_one(mesh, c) for c in cases]


def attend_one(mesh: Any, case: Case) -> dict[str, Any]:
    """One case's forward and backward on this rank of ``mesh``: local outputs and gradients (float64, CPU)."""
    seq = case.doc_ids.shape[1]
    ids = case.doc_ids.to(case.device)
    batch = {"input_ids": torch.zeros(1, seq, dtype=torch.long, device=case.device), "_packed_seq_ids": ids}
    configure_cp_varlen(overlap=case.overlap)
    try:
        ctx, _, shard = make_cp_blockdiag_batch_and_ctx(
            mesh, None, batch, attn_backend=case.backend, kv_exchange=case.kv_exchange, layout=case.layout
        )
    finally:
        configure_cp_varlen()
    full = full_inputs(case, shard.padded_seq_len)
    positions = shard.positions.cpu()
    local = {n: full[n].index_select(2, positions).to(case.device, case.dtype) for n in ("q", "k", "v", "gout")}
    q, k, v = (local[n].requires_grad_() for n in ("q", "k", "v"))
    sinks = full["sinks"].to(case.device, case.dtype).requires_grad_() if case.sinks else None
    gqa = case.heads[0] != case.heads[1]
    with ctx():
        out = sum(
            (i + 1) * cp_blockdiag_sdpa(q, k, v, scale=case.scale, enable_gqa=gqa, variant=variant)
            for i, variant in enumerate(case.variants(sinks))
        )
        (out * local["gout"]).sum().backward()
    results = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if sinks is not None:
        results["dsinks"] = sinks.grad
    return {
        **{n: t.to("cpu", torch.float64) for n, t in results.items()},
        "stats": exchange_stats(),
        "padded_len": shard.padded_seq_len,
        "positions": positions,
    }


def reference_for(case: Case, padded_len: int) -> dict[str, torch.Tensor]:
    """Full-row float64 reference output and gradients for ``case``."""
    full = full_inputs(case, padded_len)
    q, k, v, sinks = (full[n].clone().requires_grad_() for n in ("q", "k", "v", "sinks"))
    ids = torch.nn.functional.pad(case.doc_ids, (0, padded_len - case.doc_ids.shape[1]))
    out = sum(
        (i + 1) * reference_attention(q, k, v, ids, case.scale, w, case.softcap, sinks if case.sinks else None, c)
        for i, (w, c) in enumerate(case.masks)
    )
    (out * full["gout"]).sum().backward()
    results = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if case.sinks:
        results["dsinks"] = sinks.grad
    return results


def expected_exchange(
    doc_ids: torch.Tensor,
    positions: list[list[int]],
    kv_exchange: str,
    window: int | None = None,
    chunk: int | None = None,
) -> tuple[str, list[int]]:
    """Brute-force path and per-rank received tokens, straight from the definitions in the metrics notes.

    ``positions[r]`` are the original positions of rank ``r``'s rows. A rank needs,
    for every real local query, the keys of its document up to that query (and,
    with a sliding ``window``, no further back than ``window - 1`` keys; with a
    ``chunk``, none before the query's chunk of its document); the lower bound
    counts those living on other ranks.
    """
    padded_len = sum(len(p) for p in positions)
    ids = torch.nn.functional.pad(doc_ids, (0, padded_len - doc_ids.shape[1])).reshape(-1).tolist()
    owner = {pos: r for r, rows in enumerate(positions) for pos in rows}
    first: dict[int, int] = {}
    for pos, d in enumerate(ids):
        first.setdefault(d, pos)
    received, sources = [], []
    for r, rows in enumerate(positions):
        reach = (lambda p: first[ids[p]]) if window is None else (lambda p: max(first[ids[p]], p - window + 1))
        if chunk is not None:
            reach = lambda p: first[ids[p]] + (p - first[ids[p]]) // chunk * chunk  # noqa: E731
        needed = {k for p in rows if ids[p] for k in range(reach(p), p + 1)}
        remote = {k for k in needed if owner[k] != r}
        received.append(len(remote))
        sources.append({owner[k] for k in remote})
    if kv_exchange == "allgather":
        return "allgather", [padded_len - len(positions[0])] * len(positions)
    halo_ok = all(src <= {r - 1} for r, src in enumerate(sources))
    return ("halo" if kv_exchange == "halo" and halo_ok else "a2a"), received


def compare(case: Case, results: list[dict[str, Any]], cp: int, tol: float = 1e-10) -> list[str]:
    """Problems of one case's CP results against the reference (empty when all match)."""
    padded = results[0]["padded_len"]
    ref = reference_for(case, padded)
    positions = [r["positions"].tolist() for r in results]
    order = torch.tensor([p for rows in positions for p in rows])
    problems = []
    for name in ref:
        got = torch.cat([r[name] for r in results], dim=2) if name != "dsinks" else sum(r[name] for r in results)
        want = ref[name].index_select(2, order) if name != "dsinks" else ref[name]
        err = (got - want).abs().max().item()
        if not err <= tol:
            problems.append(f"{case.label}: {name} max error {err:.3g}")
    for window, chunk in case.masks:
        stats = [r["stats"]["windows"][window] if chunk is None else r["stats"]["chunks"][chunk] for r in results]
        problems += _exchange_problems(case, stats, positions, window, chunk)
    return problems


def _exchange_problems(
    case: Case, stats: list[dict[str, Any]], positions: list[list[int]], window: int | None, chunk: int | None = None
) -> list[str]:
    """Path, K/V received and reported lower bound of one window's (or chunk's) calls against brute force."""
    label = f"{case.label} window={window} chunk={chunk}"
    paths = {s["path"] for s in stats}
    if paths == {"ulysses"} and case.kv_exchange in ("ulysses", "auto"):
        return _ulysses_problems(case, stats, positions, window, chunk, label)
    if "+" in case.kv_exchange or any("+" in p for p in paths):  # configured, or auto's pick
        return _hybrid_problems(case, stats, positions, window, chunk, label)
    requested = case.kv_exchange
    if requested == "auto":  # the cost model may pick any path that can deliver the keys; check that one
        requested = next(iter(paths)) if len(paths) == 1 else "a2a"
    want_path, want_received = expected_exchange(case.doc_ids, positions, requested, window, chunk)
    problems = []
    if paths != {want_path}:
        problems.append(f"{label}: paths {paths}, expected {want_path}")
    received = [s["kv_tokens_received"] for s in stats]
    if received != want_received:
        problems.append(f"{label}: received {received}, expected {want_received}")
    bound = expected_exchange(case.doc_ids, positions, "a2a", window, chunk)[1]
    reported = [s["kv_tokens_lower_bound"] for s in stats]
    if reported != bound:
        problems.append(f"{label}: reported lower bound {reported}, expected {bound}")
    return problems


def _ulysses_problems(
    case: Case,
    stats: list[dict[str, Any]],
    positions: list[list[int]],
    window: int | None,
    chunk: int | None,
    label: str,
) -> list[str]:
    """Head-parallel calls: every rank with a query head (ranks ``r < Hq``: near-equal contiguous head ranges)
    receives the other ranks' rows; the reported lower bound is still the needed-only one."""
    cp, local = len(positions), len(positions[0])
    want = [(cp - 1) * local if r < case.heads[0] else 0 for r in range(cp)]
    problems = []
    received = [s["kv_tokens_received"] for s in stats]
    if received != want:
        problems.append(f"{label}: ulysses received {received}, expected {want}")
    bound = expected_exchange(case.doc_ids, positions, "a2a", window, chunk)[1]
    reported = [s["kv_tokens_lower_bound"] for s in stats]
    if reported != bound:
        problems.append(f"{label}: reported lower bound {reported}, expected {bound}")
    return problems


def _hybrid_problems(
    case: Case,
    stats: list[dict[str, Any]],
    positions: list[list[int]],
    window: int | None,
    chunk: int | None,
    label: str,
) -> list[str]:
    """``ulysses+*`` calls (default factorization: ``h`` = the largest proper divisor of ``cp``): a rank with a
    query head receives its head group's other ``(h - 1) L`` rows plus what its sequence group's needed-only
    exchange over the head groups' unions of rows delivers; the reported lower bound is the plain needed-only one."""
    cp, local = len(positions), len(positions[0])
    h = max(d for d in range(2, cp) if cp % d == 0)
    unions = [[p for rows in positions[g * h : (g + 1) * h] for p in rows] for g in range(cp // h)]
    paths = {s["path"] for s in stats}
    path = case.kv_exchange if case.kv_exchange != "auto" else next(iter(paths))
    sequence = expected_exchange(case.doc_ids, unions, path.split("+")[1], window, chunk)[1]
    want = [(h - 1) * local + sequence[r // h] if r % h < case.heads[0] else 0 for r in range(cp)]
    problems = []
    if paths != {path}:
        problems.append(f"{label}: paths {[s['path'] for s in stats]}, expected {path}")
    received = [s["kv_tokens_received"] for s in stats]
    if received != want:
        problems.append(f"{label}: hybrid received {received}, expected {want}")
    bound = expected_exchange(case.doc_ids, positions, "a2a", window, chunk)[1]
    reported = [s["kv_tokens_lower_bound"] for s in stats]
    if reported != bound:
        problems.append(f"{label}: reported lower bound {reported}, expected {bound}")
    return problems

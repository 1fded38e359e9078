"""One-shot GPU readiness check of the attention kernels: one table, at most 8 minutes on one H100/H200.

    python benchmarks/gpu_check.py                     # every section
    python benchmarks/gpu_check.py --sections parity   # parity, tflops, overhead, exchange (comma-separated)

Sections (each kernel that cannot run here gets a ``skip: <reason>`` row, the reason from the registry):

- ``parity``: forward + backward of ``kernels.blockdiag_attention`` for every kernel x bf16/fp16 against the
  float64 reference (``tests/reference.py``) on segments with earlier keys (k > q, some long) and GQA, and
  with a sliding window (GQA) and a window + soft-cap (a kernel that cannot compute one says so in a skip row);
- ``tflops``: forward + backward TFLOP/s of one packed row of 8K/32K/128K tokens (a long-tailed document mix,
  32/8 heads of 128, bf16), against the device's dense bf16 peak;
- ``overhead``: our wrapper's time per forward call minus the bare library call's on the same tensors;
- ``exchange``: CP attention on 2 gloo ranks with CUDA tensors (one GPU cannot host two NCCL ranks), when gloo
  implements the exchange's collectives for CUDA tensors; otherwise a skip row naming the missing ones.

Without CUDA (no flag needed) the CPU kernels' parity rows run and every GPU section prints ``skip:``; the
script exits 0 then (1 when a parity row fails). ``tests/test_gpu_check.py`` runs it that way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's test kit: float64 reference, CP cases

from cp_attention import _collect, _free_port, sft_mix

from nemo_automodel.components.distributed.blockdiag_cp import gpu_kernels, kernels
from nemo_automodel.components.distributed.blockdiag_cp.variant import AttentionVariant
from tests.cases import Case, attend_cases, compare, layout
from tests.reference import reference_attention

KERNELS = ("fa3", "flash", "te", "torch_varlen", "sdpa_varlen", "dense")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Parity passes when every max abs error / max abs reference (output and each gradient) is within these.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3}
# Dense bf16 tensor-core peaks (TFLOP/s, NVIDIA datasheets, without sparsity), by device-name substring.
BF16_PEAK = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "GH200": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.0}
SECTIONS = ("parity", "tflops", "overhead", "exchange")


@dataclass(frozen=True)
class ParityCase:
    """Segments ``(q_len, k_len)`` in units (64 tokens on a GPU, 4 on CPU), heads ``(Hq, Hkv)``, head dim.

    ``window`` (in units) and ``softcap`` make it an :class:`AttentionVariant` case; a kernel that
    cannot compute the variant gets a ``skip:`` row naming the feature.
    """

    name: str
    segments: tuple[tuple[int, int], ...]
    heads: tuple[int, int] = (8, 8)
    head_dim: int = 128
    window: int | None = None
    softcap: float | None = None

    def variant(self, unit: int) -> AttentionVariant:
        window = None if self.window is None else self.window * unit
        return AttentionVariant(window=window, softcap=self.softcap, source=f"gpu_check {self.name}")


CASES = (
    # earlier keys on the first and the last segment, square ones between
    ParityCase("straddle", ((5, 19), (8, 8), (3, 3), (2, 11))),
    ParityCase("straddle-gqa", ((5, 19), (8, 8), (3, 3), (2, 11)), heads=(8, 2)),
    # one long segment with 3x more keys than queries: the launch upstream's boundary guard avoids
    ParityCase("long-straddle-gqa", ((32, 128),), heads=(8, 2)),
    # a sliding window narrower than the straddling segments' keys, GQA (Mistral/Gemma-2 local layers)
    ParityCase("window-gqa", ((5, 19), (8, 8), (3, 3), (2, 11)), heads=(8, 2), window=4),
    # a window and a soft-cap small enough to bend N(0, 1) scores (Gemma-2)
    ParityCase("window-softcap", ((5, 19), (8, 8), (2, 11)), heads=(8, 2), window=3, softcap=1.5),
)


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    section: str
    kernel: str
    dtype: str
    case: str
    result: str
    detail: str = ""


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- parity


@dataclass
class Problem:
    """A case's float64 inputs and reference (output and gradients of ``sum(out * gout)``)."""

    meta: kernels.VarlenMeta
    inputs: dict[str, torch.Tensor]
    reference: dict[str, torch.Tensor]
    variant: AttentionVariant


def _variant_segment(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: AttentionVariant, scale: float
) -> torch.Tensor:
    """One segment from the variant's definition: ``q [1, Hq, Lq, D]`` are the last rows of ``k/v [1, Hkv, Lk, D]``.

    Row ``a`` is key position ``i = Lk - Lq + a`` and attends keys ``j`` with ``i - W < j <= i``;
    scores are scaled, soft-capped, masked, softmaxed (float64 explicit softmax, as ``tests/reference.py``).
    """
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    i = torch.arange(k.shape[2] - q.shape[2], k.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    allowed = j <= i
    if variant.window is not None:
        allowed &= i - j < variant.window
    scores = (q @ k.transpose(-1, -2)) * scale
    if variant.softcap is not None:
        scores = variant.softcap * torch.tanh(scores / variant.softcap)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def _problem(case: ParityCase, unit: int, device: torch.device) -> Problem:
    q_lens = tuple(q * unit for q, _ in case.segments)
    k_lens = tuple(k * unit for _, k in case.segments)
    variant = case.variant(unit)
    meta = kernels.build_varlen_meta(q_lens, k_lens, sum(q_lens), device, window=variant.window)
    gen = torch.Generator().manual_seed(0)
    hq, hkv = case.heads
    shapes = {"q": (hq, meta.n_real), "k": (hkv, meta.kv_len), "v": (hkv, meta.kv_len), "gout": (hq, meta.n_real)}
    inputs = {
        n: torch.randn(1, h, t, case.head_dim, generator=gen, dtype=torch.float64).to(device)
        for n, (h, t) in shapes.items()
    }
    q, k, v = (inputs[n].clone().requires_grad_() for n in ("q", "k", "v"))
    outs = []
    for q0, q_len, k0, k_len in meta.segments():
        if not variant.plain:
            segment = (q[:, :, q0 : q0 + q_len], k[:, :, k0 : k0 + k_len], v[:, :, k0 : k0 + k_len])
            outs.append(_variant_segment(*segment, variant, case.head_dim**-0.5))
            continue
        # a segment's rows are the last q_len rows of a document of k_len tokens: embed them in a full row
        rows = torch.cat((q.new_zeros(1, hq, k_len - q_len, case.head_dim), q[:, :, q0 : q0 + q_len]), dim=2)
        ones = torch.ones(1, k_len, dtype=torch.long, device=device)
        full = reference_attention(rows, k[:, :, k0 : k0 + k_len], v[:, :, k0 : k0 + k_len], ones)
        outs.append(full[:, :, k_len - q_len :])
    out = torch.cat(outs, dim=2)
    (out * inputs["gout"]).sum().backward()
    return Problem(meta, inputs, {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}, variant)


def _relative_errors(problem: Problem, kernel: str, dtype: torch.dtype) -> dict[str, float]:
    q, k, v = (problem.inputs[n].to(dtype).requires_grad_() for n in ("q", "k", "v"))
    out = kernels.blockdiag_attention(kernel, q, k, v, problem.meta, None, 0.0, problem.variant)
    (out * problem.inputs["gout"].to(dtype)).sum().backward()
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {
        n: ((got[n].double() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        for n, want in problem.reference.items()
    }


def parity_rows(device: torch.device) -> list[Row]:
    unit = 64 if device.type == "cuda" else 4
    rows = []
    for case in CASES:
        problem = _problem(case, unit, device)
        for kernel in KERNELS:
            for dname, dtype in DTYPES.items():
                row = Row("parity", kernel, dname, case.name, "")
                reason = kernels.kernel_unavailable_reason(
                    kernel, dtype, device, head_dim=case.head_dim, variant=problem.variant
                )
                if reason is not None:
                    rows.append(replace(row, result=f"skip: {reason}"))
                else:
                    errors = _relative_errors(problem, kernel, dtype)
                    ok = max(errors.values()) <= TOLERANCE[dtype]
                    detail = "error / reference (max abs): " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
                    rows.append(replace(row, result="ok" if ok else "FAIL", detail=detail))
    return rows


# ----------------------------------------------------------------------------- throughput and overhead


def _timed_ms(fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` on the GPU (CUDA events)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop))
    return statistics.median(samples)


def _per_call_us(fn: Callable[[], Any], calls: int, repeats: int = 3) -> float:
    """Median over ``repeats`` of the wall time per call of ``calls`` back-to-back calls (host + device work)."""
    fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def _row_inputs(lengths: tuple[int, ...], heads: tuple[int, int], head_dim: int, device: torch.device) -> tuple:
    total = sum(lengths)
    meta = kernels.build_varlen_meta(lengths, lengths, total, device)
    q = torch.randn(1, heads[0], total, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(1, heads[1], total, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "kv"
    )
    return meta, q, k, v


def _peak() -> float | None:
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in BF16_PEAK.items() if key in name), None)


def tflops_rows(device: torch.device, iters: int) -> list[Row]:
    if device.type != "cuda":
        return [Row("tflops", "-", "bf16", "8K/32K/128K", "skip: no CUDA device")]
    heads, head_dim, rows, peak = (32, 8), 128, [], _peak()
    for total in (8192, 32768, 131072):
        lengths = sft_mix(total, seed=3)
        # causal work: sum over documents of n (n + 1) / 2 pairs; fwd 2 matmuls, bwd 5 (= 2.5 x fwd)
        flops = 3.5 * 4 * heads[0] * head_dim * sum(n * (n + 1) // 2 for n in lengths)
        for kernel in KERNELS:
            row = Row("tflops", kernel, "bf16", f"{total // 1024}K ({len(lengths)} docs)", "")
            reason = kernels.kernel_unavailable_reason(kernel, torch.bfloat16, device, head_dim=head_dim)
            if kernel == "dense" and total > 32768:
                reason = "dense builds an [n, K] mask (32 GiB at 128K tokens)"
            if reason is not None:
                rows.append(replace(row, result=f"skip: {reason}"))
                continue
            meta, q, k, v = _row_inputs(lengths, heads, head_dim, device)

            def step(kernel: str = kernel, meta: Any = meta, q: Any = q, k: Any = k, v: Any = v) -> None:
                kernels.blockdiag_attention(kernel, q, k, v, meta, None, 0.0).sum().backward()

            ms = _timed_ms(step, iters)
            tflops = flops / (ms * 1e-3) / 1e12
            share = f" ({100 * tflops / peak:.0f}% of {peak:.0f} peak)" if peak else " (peak unknown)"
            rows.append(replace(row, result=f"{tflops:.0f} TFLOP/s{share}", detail=f"{ms:.2f} ms"))
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def _bare_calls(meta: kernels.VarlenMeta, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable]:
    """The library call each kernel wraps, on THD tensors prepared once (no layout work per call)."""
    qt, kt, vt = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
    args = (qt, kt, vt, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k)

    def flash() -> Any:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(*args, causal=True)

    def fa3() -> Any:
        from flash_attn_interface import flash_attn_varlen_func

        return flash_attn_varlen_func(*args, causal=True)

    def torch_varlen() -> Any:
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(*args, window_size=(-1, 0), enable_gqa=True)

    def te() -> Any:
        module = gpu_kernels.te_module(q.shape[1], k.shape[1], q.shape[3], None, 0.0, q.device)
        cu = {"cu_seqlens_q": meta.cu_q, "cu_seqlens_kv": meta.cu_k}
        return module(qt, kt, vt, **cu, max_seqlen_q=meta.max_q, max_seqlen_kv=meta.max_k)

    return {"flash": flash, "fa3": fa3, "torch_varlen": torch_varlen, "te": te}


def overhead_rows(device: torch.device, calls: int) -> list[Row]:
    if device.type != "cuda":
        return [Row("overhead", "-", "bf16", "-", "skip: no CUDA device")]
    lengths = (1024, 512, 512, 256, 1792)  # 4096 tokens: small enough that per-call costs show
    meta, q, k, v = _row_inputs(lengths, (32, 8), 128, device)
    rows = []
    with torch.no_grad():
        for kernel, bare in _bare_calls(meta, q, k, v).items():
            row = Row("overhead", kernel, "bf16", "4K fwd", "")
            reason = kernels.kernel_unavailable_reason(kernel, torch.bfloat16, device, head_dim=128)
            if reason is not None:
                rows.append(replace(row, result=f"skip: {reason}"))
                continue
            ours = _per_call_us(
                lambda kernel=kernel: kernels.blockdiag_attention(kernel, q, k, v, meta, None, 0.0), calls
            )
            theirs = _per_call_us(bare, calls)
            detail = f"wrapper {ours:.0f} us, bare call {theirs:.0f} us (per call, {calls} calls back to back)"
            rows.append(replace(row, result=f"{ours - theirs:+.0f} us/call", detail=detail))
    return rows


# ----------------------------------------------------------------------------- CP exchange on 2 gloo ranks


def _ring_exchange(x: torch.Tensor, rank: int, world: int) -> None:
    """One send to the right neighbour and one receive from the left (the halo exchange's pattern)."""
    ops = [
        dist.P2POp(dist.isend, x, (rank + 1) % world),
        dist.P2POp(dist.irecv, x.new_empty(x.shape), (rank - 1) % world),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def probe_collectives(device: torch.device) -> list[str]:
    """Collectives of the K/V exchange that this process group cannot run on ``device`` tensors (with why)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.ones(4, device=device)
    ops: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(x.new_empty(4 * world), x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(x.new_empty(4 // world), x),
        "all_to_all_single": lambda: dist.all_to_all_single(x.new_empty(4), x),
        "isend/irecv": lambda: _ring_exchange(x, rank, world),
    }
    missing = []
    for name, op in ops.items():
        try:
            op()
        except (RuntimeError, ValueError) as exc:
            missing.append(f"{name} ({str(exc).splitlines()[0][:80]})")
    return missing


EXCHANGE_CASES = tuple(
    Case(layout("straddle", 2), "auto", ex, (4, 2), seed=i, head_dim=64, device="cuda", dtype=torch.bfloat16)
    for i, ex in enumerate(("allgather", "halo", "a2a"))
)


def _exchange_worker(rank: int, port: int, results: Any) -> None:
    """One of two gloo ranks on the same GPU: which collectives fail on CUDA tensors, else the CP cases."""
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=120)
    )
    torch.cuda.set_device(0)
    missing = probe_collectives(torch.device("cuda"))
    results.put({"rank": rank, "missing": missing, "outputs": None if missing else attend_cases(list(EXCHANGE_CASES))})
    dist.destroy_process_group()


def exchange_rows(device: torch.device) -> list[Row]:
    row = Row("exchange", "auto", "bf16", "cp=2 gloo", "")
    if device.type != "cuda":
        return [replace(row, result="skip: no CUDA device")]
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_exchange_worker, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    reports = sorted(_collect(results, procs), key=lambda r: r["rank"])
    missing = sorted({m for r in reports for m in r["missing"]})
    if missing:
        return [replace(row, result=f"skip: gloo cannot run these on CUDA tensors: {'; '.join(missing)}")]
    rows = []
    for i, case in enumerate(EXCHANGE_CASES):
        outputs = [r["outputs"][i] for r in reports]
        problems = compare(case, outputs, 2, tol=4 * TOLERANCE[torch.bfloat16])
        kernel = outputs[0]["stats"]["attn_backend"]
        detail = "; ".join(problems) or "outputs and gradients within tolerance; K/V received = the lower bound"
        rows.append(Row("exchange", kernel, "bf16", f"cp=2 {case.kv_exchange}", "FAIL" if problems else "ok", detail))
    return rows


# ----------------------------------------------------------------------------- the table


def render(rows: list[Row]) -> str:
    lines = ["| section | kernel | dtype | case | result | detail |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.section} | {r.kernel} | {r.dtype} | {r.case} | {r.result} | {r.detail} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per measurement (median)")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from {SECTIONS}")
    device = _device()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (no CUDA device)"
    print(f"gpu_check on {name}, torch {torch.__version__}")
    start = time.perf_counter()
    runs = {
        "parity": lambda: parity_rows(device),
        "tflops": lambda: tflops_rows(device, args.iters),
        "overhead": lambda: overhead_rows(device, 20 * args.iters),
        "exchange": lambda: exchange_rows(device),
    }
    rows = [row for section in sections for row in runs[section]()]
    print(render(rows))
    for row in rows:
        if row.result.startswith("skip:") and row.kernel in ("-", "auto"):
            print(f"{row.section}: {row.result}")
    print(f"{len(rows)} rows in {time.perf_counter() - start:.0f} s")
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""One-shot GPU readiness check of the attention kernels: rows printed as they finish, at most ~8 minutes.

    python benchmarks/gpu_check.py                          # every section, budget 450 s, outputs/gpu_check.json
    python benchmarks/gpu_check.py --sections parity        # parity, tflops, overhead, exchange (comma-separated)
    python benchmarks/gpu_check.py --budget-s 120 --json $OUT/gpu_check.json

Sections (a kernel that cannot run here gets a ``skip: <reason>`` row, the reason from the registry):

- ``parity``: forward + backward of ``kernels.blockdiag_attention`` for every kernel x bf16/fp16 against the
  float64 reference (``testing/reference.py``) on segments with earlier keys (k > q, some long) and GQA, with a
  sliding window (GQA), a window + soft-cap, attention sinks (and their gradient), and a value head dim of its own
  (MLA);
- ``tflops``: forward + backward TFLOP/s of one packed row of 8K/32K/128K tokens (a long-tailed document mix,
  32/8 heads of 128, bf16) against the device's dense bf16 peak; a row whose memory would not fit is skipped
  before it runs, and ``te`` names the TE backend it would use (only-unfused TE is skipped: its scores grow
  with segments x heads x max_q x max_k);
- ``overhead``: our wrapper's time per forward call minus the bare library call's on the same tensors;
- ``exchange``: CP attention on 2 gloo ranks, when gloo runs every collective the K/V exchanges and the step
  agreement use (``all_gather``/``reduce_scatter`` lists, ``batch_isend_irecv``, ``all_to_all_single`` with
  splits, an int64 ``all_reduce``, ``all_gather_object``) on the device's tensors; else a skip row naming them.

Every row runs guarded: an exception (a kernel error, an out-of-memory, TE's "no backend") becomes an
``error: <type>: <message>`` row and the check goes on; after an asynchronous CUDA error (which poisons the
process's CUDA context) the remaining in-process GPU rows are skipped with the row that lost it named.
Each row is printed when it finishes, each section ends with a summary line, and the JSON file is rewritten
after every row, so a check killed half-way keeps what it measured. ``--budget-s`` stops cleanly: rows that
would start after it are recorded as skipped. Without CUDA the CPU kernels' parity rows run and the GPU
sections print ``skip: no CUDA device`` (``--device cpu`` runs them on CPU, a smoke test with small sizes).
The exit code is 1 when a row failed or raised, else 0.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.blockdiag_cp import gpu_kernels, gpu_libraries, kernels
from nemo_automodel.components.distributed.blockdiag_cp.gpu_libraries import KernelCall
from nemo_automodel.components.distributed.blockdiag_cp.variant import AttentionVariant
from nemo_automodel.testing.cases import Case, attend_cases, compare, layout
from nemo_automodel.testing.dist import init_gloo, run_ranks
from nemo_automodel.testing.reference import reference_attention
from nemo_automodel.testing.workloads import sft_mix

KERNELS = ("fa3", "flash", "te", "torch_varlen", "sdpa_varlen", "dense")
GPU_KERNELS = ("fa3", "flash", "te", "torch_varlen")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Parity passes when every max abs error / max abs reference (output and each gradient) is within these.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3}
# Dense bf16 tensor-core peaks (TFLOP/s, NVIDIA datasheets, without sparsity), by device-name substring.
BF16_PEAK = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "GH200": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.0}
SECTIONS = ("parity", "tflops", "overhead", "exchange")
DEFAULT_SIZES = (8192, 32768, 131072)
DEFAULT_JSON = "outputs/gpu_check.json"
# What a row may use of the free device memory (the rest is headroom for the allocator and the library).
MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class ParityCase:
    """Segments ``(q_len, k_len)`` in units (64 tokens on a GPU, 4 on CPU), heads ``(Hq, Hkv)``, head dims.

    ``window`` (in units), ``softcap`` and ``sinks`` (one logit per query head, ``linspace(-1, 1.5)``) make it
    an :class:`AttentionVariant` case; a kernel that cannot compute the variant gets a ``skip:`` row naming the
    feature.
    """

    name: str
    segments: tuple[tuple[int, int], ...]
    heads: tuple[int, int] = (8, 8)
    head_dim: int = 128
    value_head_dim: int | None = None
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False

    def variant(self, unit: int) -> AttentionVariant:
        window = None if self.window is None else self.window * unit
        sinks = torch.linspace(-1.0, 1.5, self.heads[0], dtype=torch.float64) if self.sinks else None
        return AttentionVariant(window=window, softcap=self.softcap, sinks=sinks, source=f"gpu_check {self.name}")


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
    # gpt-oss: learned sinks on straddling segments (flash/fa3 rescale their private pair's output), GQA
    ParityCase("sinks-gqa", ((5, 19), (8, 8), (2, 11)), heads=(8, 2), head_dim=64, sinks=True),
    # DeepSeek-V3's MLA head dims: queries/keys 192, values 128
    ParityCase("mla-192-128", ((5, 19), (8, 8)), heads=(8, 8), head_dim=192, value_head_dim=128),
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

    def line(self) -> str:
        return f"| {self.section} | {self.kernel} | {self.dtype} | {self.case} | {self.result} | {self.detail} |"


@dataclass(frozen=True)
class Task:
    """A row still to measure: ``run()`` returns ``(result, detail)``.

    ``gpu``: the row needs this process's CUDA context (every GPU kernel's row, also when the
    stand-ins run them on CPU), so a lost context skips it.
    """

    section: str
    kernel: str
    dtype: str
    case: str
    run: Callable[[], tuple[str, str]]
    gpu: bool = True


def _device(name: str | None) -> torch.device:
    if name is not None:
        return torch.device(name)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- running rows, guarded


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _poisons_cuda(exc: BaseException) -> bool:
    """An asynchronous CUDA error (illegal address, launch failure) leaves the process's context unusable."""
    text = str(exc)
    return type(exc).__name__ == "AcceleratorError" or ("CUDA error" in text and "out of memory" not in text)


@dataclass
class Report:
    """Prints rows as they finish and rewrites the JSON file after every row."""

    path: Path | None
    header: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    sections: dict[str, str] = field(default_factory=dict)
    stopped: str | None = None

    def start(self, section: str) -> None:
        self.sections[section] = "running"
        print(
            f"\n{section}:\n| section | kernel | dtype | case | result | detail |\n|---|---|---|---|---|---|",
            flush=True,
        )
        self.write()

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(row.line(), flush=True)
        self.write()

    def finish(self, section: str, seconds: float) -> None:
        rows = [r for r in self.rows if r.section == section]
        counts = {kind: sum(_kind(r) == kind for r in rows) for kind in ("ok", "FAIL", "error", "skip", "measured")}
        summary = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
        print(f"{section}: {len(rows)} rows ({summary or 'none'}) in {seconds:.0f} s", flush=True)
        self.sections[section] = "done"
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        document = {
            **self.header,
            "sections": self.sections,
            "stopped": self.stopped,
            "rows": [asdict(r) for r in self.rows],
        }
        partial = self.path.with_suffix(self.path.suffix + ".part")
        partial.write_text(json.dumps(document, indent=1))
        os.replace(partial, self.path)  # a reader never sees half a file


def _memo(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run once, shared by a section's rows; a failure is raised again for each row, not rerun."""
    outcome: list[tuple[bool, Any]] = []

    def once() -> Any:
        if not outcome:
            try:
                outcome.append((True, fn()))
            except Exception as exc:
                outcome.append((False, exc))
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    return once


def _kind(row: Row) -> str:
    for kind in ("ok", "FAIL", "error", "skip"):
        if row.result == kind or row.result.startswith(f"{kind}:"):
            return kind
    return "measured"


@dataclass
class Runner:
    """Runs tasks guarded, within the budget, remembering a lost CUDA context."""

    report: Report
    budget_s: float
    start: float = field(default_factory=time.perf_counter)
    cuda_lost_at: str | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def section(self, name: str, tasks: Iterator[Task]) -> None:
        begin = time.perf_counter()
        self.report.start(name)
        try:
            for task in tasks:
                self.report.add(self._run(task))
        except Exception as exc:  # building the next task failed: the section ends with a row that says why
            self.report.add(Row(name, "-", "-", "setup", f"error: {_first_line(exc)}"))
        self.report.finish(name, time.perf_counter() - begin)

    def _run(self, task: Task) -> Row:
        row = Row(task.section, task.kernel, task.dtype, task.case, "")
        if self.elapsed() >= self.budget_s:
            if self.report.stopped is None:
                self.report.stopped = f"budget of {self.budget_s:.0f} s spent after {len(self.report.rows)} rows"
            return replace(row, result=f"skip: budget of {self.budget_s:.0f} s spent")
        if task.gpu and self.cuda_lost_at is not None:
            return replace(row, result=f"skip: CUDA context lost at {self.cuda_lost_at}; rerun with --sections")
        try:
            result, detail = task.run()
            return replace(row, result=result, detail=detail)
        except Exception as exc:  # every failure is a row; the check goes on
            if _poisons_cuda(exc):
                self.cuda_lost_at = f"{task.section}/{task.kernel}/{task.dtype}/{task.case}"
            if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc):
                torch.cuda.empty_cache()
            return replace(row, result=f"error: {_first_line(exc)}")


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
    """One segment from the variant's definition: ``q [1, Hq, Lq, D]`` are the last rows of ``k/v [1, Hkv, Lk, *]``.

    Row ``a`` is key position ``i = Lk - Lq + a`` and attends keys ``j`` with ``i - W < j <= i``;
    scores are scaled, soft-capped, masked, softmaxed (float64 explicit softmax, as ``testing/reference.py``),
    a head's sink logit joining the softmax as one more column that carries no value.
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
    scores = scores.masked_fill(~allowed, float("-inf"))
    if variant.sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = variant.sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1] @ v


def _problem(case: ParityCase, unit: int, device: torch.device) -> Problem:
    q_lens = tuple(q * unit for q, _ in case.segments)
    k_lens = tuple(k * unit for _, k in case.segments)
    variant = case.variant(unit)
    if variant.sinks is not None:  # a leaf on the device: the reference's sink gradient is compared too
        variant = replace(variant, sinks=variant.sinks.to(device).requires_grad_())
    meta = kernels.build_varlen_meta(q_lens, k_lens, sum(q_lens), device, window=variant.window)
    gen = torch.Generator().manual_seed(0)
    hq, hkv = case.heads
    dv = case.value_head_dim or case.head_dim
    shapes = {"q": (hq, meta.n_real, case.head_dim), "k": (hkv, meta.kv_len, case.head_dim)}
    shapes.update({"v": (hkv, meta.kv_len, dv), "gout": (hq, meta.n_real, dv)})
    inputs = {n: torch.randn(1, *shape, generator=gen, dtype=torch.float64).to(device) for n, shape in shapes.items()}
    q, k, v = (inputs[n].clone().requires_grad_() for n in ("q", "k", "v"))
    outs = []
    for q0, q_len, k0, k_len in meta.segments():
        segment = (q[:, :, q0 : q0 + q_len], k[:, :, k0 : k0 + k_len], v[:, :, k0 : k0 + k_len])
        if not variant.plain or dv != case.head_dim:
            outs.append(_variant_segment(*segment, variant, case.head_dim**-0.5))
            continue
        # a segment's rows are the last q_len rows of a document of k_len tokens: embed them in a full row
        rows = torch.cat((q.new_zeros(1, hq, k_len - q_len, case.head_dim), segment[0]), dim=2)
        ones = torch.ones(1, k_len, dtype=torch.long, device=device)
        outs.append(reference_attention(rows, segment[1], segment[2], ones)[:, :, k_len - q_len :])
    out = torch.cat(outs, dim=2)
    (out * inputs["gout"]).sum().backward()
    reference = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if variant.sinks is not None:
        reference["dsinks"] = variant.sinks.grad
    return Problem(meta, inputs, reference, variant)


def _relative_errors(problem: Problem, kernel: str, dtype: torch.dtype) -> dict[str, float]:
    q, k, v = (problem.inputs[n].to(dtype).requires_grad_() for n in ("q", "k", "v"))
    variant = problem.variant
    if variant.sinks is not None:  # the model's s_aux: a parameter in the run's dtype
        variant = replace(variant, sinks=variant.sinks.detach().to(dtype).requires_grad_())
    out = kernels.blockdiag_attention(kernel, q, k, v, problem.meta, None, 0.0, variant)
    (out * problem.inputs["gout"].to(dtype)).sum().backward()
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if variant.sinks is not None:
        got["dsinks"] = variant.sinks.grad
    return {
        n: ((got[n].double() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        for n, want in problem.reference.items()
    }


def _parity_row(
    problem: Callable[[], Problem], kernel: str, dtype: torch.dtype, case: ParityCase, device
) -> tuple[str, str]:
    variant = case.variant(1)  # window presence is what selection looks at; sizes are the problem's
    reason = kernels.kernel_unavailable_reason(
        kernel, dtype, device, head_dim=case.head_dim, value_head_dim=case.value_head_dim, variant=variant
    )
    if reason is not None:
        return f"skip: {reason}", ""
    errors = _relative_errors(problem(), kernel, dtype)
    detail = "error / reference (max abs): " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
    return ("ok" if max(errors.values()) <= TOLERANCE[dtype] else "FAIL"), detail


def parity_tasks(device: torch.device) -> Iterator[Task]:
    unit = 64 if device.type == "cuda" else 4
    for case in CASES:
        problem = _memo(lambda case=case: _problem(case, unit, device))
        for kernel, (dname, dtype) in ((k, d) for k in KERNELS for d in DTYPES.items()):
            run = functools.partial(_parity_row, problem, kernel, dtype, case, device)
            yield Task("parity", kernel, dname, case.name, run, gpu=kernel in GPU_KERNELS or device.type == "cuda")


# ----------------------------------------------------------------------------- throughput and overhead


def _timed_ms(fn: Callable[[], Any], iters: int, device: torch.device, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, wall time elsewhere)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(stop))
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def _per_call_us(fn: Callable[[], Any], calls: int, device: torch.device, repeats: int = 3) -> float:
    """Median over ``repeats`` of the wall time per call of ``calls`` back-to-back calls (host + device work)."""
    fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
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


def _peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in BF16_PEAK.items() if key in name), None)


def _free_bytes(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info()[0] if device.type == "cuda" else None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _memory_problem(kernel: str, lengths: tuple[int, ...], heads: tuple[int, int], head_dim: int, device) -> str | None:
    """Why a throughput row would not fit in free device memory, decided before it allocates anything.

    Inputs, outputs and their gradients (bf16), plus the ``[n, n]`` mask ``dense`` builds and
    its scores. (TE's unfused backend, whose scores grow with segments x heads x max_len^2,
    is never timed: see :func:`_tflops_row`.)
    """
    total = sum(lengths)
    need = 2 * total * head_dim * (heads[0] * 3 + heads[1] * 4)  # q, k, v, out and their gradients, bf16
    if kernel == "dense":
        need += total * total * (1 + 2 * heads[0] * 4)  # the mask, fp32 scores and probabilities per head
    free = _free_bytes(device)
    if free is not None and need > MEMORY_SHARE * free:
        return f"needs about {_gib(need)}, {_gib(free)} free (so it is not started)"
    return None


def _te_backend(device: torch.device, head_dim: int) -> str | None:
    libs = gpu_libraries.probe_gpu_libraries(device)
    if libs.device is None or libs.te.problem is not None:
        return None
    return gpu_libraries.te_plan(libs.te, libs.device, KernelCall(torch.bfloat16, head_dim, head_dim)).backend


def _tflops_row(kernel: str, lengths: tuple[int, ...], iters: int, device: torch.device) -> tuple[str, str]:
    heads, head_dim = (32, 8), 128
    reason = kernels.kernel_unavailable_reason(kernel, torch.bfloat16, device, head_dim=head_dim)
    if reason is not None:
        return f"skip: {reason}", ""
    backend = _te_backend(device, head_dim) if kernel == "te" else None
    if backend == "unfused":
        return "skip: TransformerEngine would use its unfused backend here (scores per padded segment)", ""
    problem = _memory_problem(kernel, lengths, heads, head_dim, device)
    if problem is not None:
        return f"skip: {problem}", ""
    meta, q, k, v = _row_inputs(lengths, heads, head_dim, device)

    def step() -> None:
        kernels.blockdiag_attention(kernel, q, k, v, meta, None, 0.0).sum().backward()

    ms = _timed_ms(step, iters, device)
    # causal work: sum over documents of n (n + 1) / 2 pairs; fwd 2 matmuls, bwd 5 (= 2.5 x fwd)
    flops = 3.5 * 4 * heads[0] * head_dim * sum(n * (n + 1) // 2 for n in lengths)
    tflops, peak = flops / (ms * 1e-3) / 1e12, _peak(device)
    share = f" ({100 * tflops / peak:.0f}% of {peak:.0f} peak)" if peak else " (peak unknown)"
    detail = f"{ms:.2f} ms" + (f"; TE backend: {backend}" if backend else "")
    return f"{tflops:.0f} TFLOP/s{share}", detail


def tflops_tasks(device: torch.device, iters: int, sizes: tuple[int, ...]) -> Iterator[Task]:
    for total in sizes:
        lengths = sft_mix(total, 16384, seed=3)
        for kernel in KERNELS:
            run = functools.partial(_tflops_row, kernel, lengths, iters, device)
            gpu = kernel in GPU_KERNELS or device.type == "cuda"
            yield Task("tflops", kernel, "bf16", f"{total // 1024}K ({len(lengths)} docs)", run, gpu=gpu)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _bare_calls(meta: kernels.VarlenMeta, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable]:
    """The library call each kernel wraps, on THD tensors prepared once (no layout work per call)."""
    qt, kt, vt = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
    args = (qt, kt, vt, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k)
    libs = gpu_libraries.probe_gpu_libraries(q.device)
    gqa = {"enable_gqa": True} if "enable_gqa" in libs.torch_varlen.parameters else {}

    def te() -> Any:
        key = gpu_kernels.TEModuleKey(q.shape[1], k.shape[1], q.shape[3], v.shape[3], None, 0.0, str(q.device), None)
        rounded = gpu_libraries.te_round_seqlen
        cu = {"cu_seqlens_q": meta.cu_q, "cu_seqlens_kv": meta.cu_k}
        return gpu_kernels.te_module(key, libs)(
            qt, kt, vt, **cu, max_seqlen_q=rounded(meta.max_q), max_seqlen_kv=rounded(meta.max_k)
        )

    return {
        "flash": lambda: libs.flash.varlen(*args, causal=True),
        "fa3": lambda: libs.fa3.varlen(*args, causal=True),
        "torch_varlen": lambda: libs.torch_varlen.function(*args, window_size=(-1, 0), **gqa),
        "te": te,
    }


def _overhead_row(kernel: str, inputs: Callable[[], tuple], calls: int, device: torch.device) -> tuple[str, str]:
    reason = kernels.kernel_unavailable_reason(kernel, torch.bfloat16, device, head_dim=128)
    if reason is not None:
        return f"skip: {reason}", ""
    meta, q, k, v = inputs()
    bare = _bare_calls(meta, q, k, v)[kernel]
    with torch.no_grad():
        ours = _per_call_us(lambda: kernels.blockdiag_attention(kernel, q, k, v, meta, None, 0.0), calls, device)
        theirs = _per_call_us(bare, calls, device)
    detail = f"wrapper {ours:.0f} us, bare call {theirs:.0f} us (per call, {calls} calls back to back)"
    return f"{ours - theirs:+.0f} us/call", detail


def overhead_tasks(device: torch.device, calls: int) -> Iterator[Task]:
    lengths = (1024, 512, 512, 256, 1792)  # 4096 tokens: small enough that per-call costs show
    inputs = _memo(lambda: _row_inputs(lengths, (32, 8), 128, device))
    for kernel in GPU_KERNELS:
        yield Task(
            "overhead", kernel, "bf16", "4K fwd", functools.partial(_overhead_row, kernel, inputs, calls, device)
        )


# ----------------------------------------------------------------------------- CP exchange on 2 gloo ranks


def _ring_exchange(x: torch.Tensor, rank: int, world: int) -> None:
    """One send to the right neighbour and one receive from the left (the halo exchange's batch_isend_irecv)."""
    ops = [
        dist.P2POp(dist.isend, x, (rank + 1) % world),
        dist.P2POp(dist.irecv, x.new_empty(x.shape), (rank - 1) % world),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def collective_calls(device: torch.device, rank: int, world: int) -> dict[str, Callable[[], Any]]:
    """The collectives of the K/V exchanges and the step agreement, called as exchange.py, consensus.py and topology.py
    call them: ``all_gather`` and ``reduce_scatter`` over lists (the allgather exchange and its backward),
    ``batch_isend_irecv`` (halo), ``all_to_all_single`` with uneven splits (a2a), an int64 ``all_reduce``
    (the step agreement), ``all_gather_object`` (host placement)."""
    x = torch.ones(4 * world, device=device)
    splits = [rank + 1] * world  # rank r sends r + 1 rows to everyone
    received = [r + 1 for r in range(world)]
    return {
        "all_gather": lambda: dist.all_gather([x.new_empty(x.shape) for _ in range(world)], x, async_op=True).wait(),
        "reduce_scatter": lambda: dist.reduce_scatter(x.new_empty(4), list(x.chunk(world)), async_op=True).wait(),
        "batch_isend_irecv": lambda: _ring_exchange(x, rank, world),
        "all_to_all_single": lambda: dist.all_to_all_single(
            x.new_empty(sum(received)),
            x.new_ones(sum(splits)),
            output_split_sizes=received,
            input_split_sizes=splits,
            async_op=True,
        ).wait(),
        "all_reduce": lambda: dist.all_reduce(torch.zeros(world, 2, dtype=torch.int64, device=device)),
        "all_gather_object": lambda: dist.all_gather_object([None] * world, rank),
    }


def probe_collectives(device: torch.device) -> list[str]:
    """Collectives of :func:`collective_calls` this process group cannot run on ``device`` tensors (with why)."""
    missing = []
    for name, call in collective_calls(device, dist.get_rank(), dist.get_world_size()).items():
        try:
            call()
        except (RuntimeError, ValueError) as exc:
            missing.append(f"{name} ({str(exc).splitlines()[0][:80]})")
    return missing


def _exchange_cases(device: torch.device) -> tuple[Case, ...]:
    return tuple(
        Case(layout("straddle", 2), "auto", ex, (4, 2), seed=i, head_dim=64, device=device.type, dtype=torch.bfloat16)
        for i, ex in enumerate(("allgather", "halo", "a2a"))
    )


def _exchange_worker(rank: int, port: int, device_name: str, results: Any) -> None:
    """One of two gloo ranks on the same device: which collectives fail on its tensors, else the CP cases."""
    init_gloo(rank, 2, port, timeout_s=120)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    missing = probe_collectives(device)
    outputs = None if missing else attend_cases(list(_exchange_cases(device)))
    # bytes, not tensors: a tensor in a torch Queue is a file descriptor that dies with this process
    buffer = io.BytesIO()
    torch.save({"rank": rank, "missing": missing, "outputs": outputs}, buffer)
    results.put(buffer.getvalue())
    dist.destroy_process_group()


def _exchange_reports(device: torch.device) -> list[dict[str, Any]]:
    reports = [torch.load(io.BytesIO(data), weights_only=False) for data in run_ranks(_exchange_worker, 2, str(device))]
    return sorted(reports, key=lambda r: r["rank"])


def _exchange_row(reports: Callable[[], list[dict[str, Any]]], index: int, device: torch.device) -> tuple[str, str]:
    missing = sorted({m for r in reports() for m in r["missing"]})
    if missing:
        return f"skip: gloo cannot run these on this device's tensors: {'; '.join(missing)}", ""
    case = _exchange_cases(device)[index]
    outputs = [r["outputs"][index] for r in reports()]
    problems = compare(case, outputs, 2, tol=4 * TOLERANCE[torch.bfloat16])
    kernel = outputs[0]["stats"]["attn_backend"]
    detail = (
        "; ".join(problems)
        or f"kernel {kernel}; outputs and gradients within tolerance; K/V received = the lower bound"
    )
    return ("FAIL" if problems else "ok"), detail


def exchange_tasks(device: torch.device) -> Iterator[Task]:
    reports = _memo(lambda: _exchange_reports(device))  # both ranks run every case once
    for index, name in enumerate(("allgather", "halo", "a2a")):
        run = functools.partial(_exchange_row, reports, index, device)
        yield Task("exchange", "auto", "bf16", f"cp=2 {name}", run, gpu=False)


# ----------------------------------------------------------------------------- the check


def _skipped(section: str, reason: str) -> Iterator[Task]:
    yield Task(section, "-", "-", "-", lambda: (f"skip: {reason}", ""), gpu=False)


def section_tasks(section: str, device: torch.device, args: argparse.Namespace, forced: bool) -> Iterator[Task]:
    """The tasks of one section; GPU sections on CPU only when ``--device cpu`` asked for them."""
    if section == "parity":
        return parity_tasks(device)
    if device.type != "cuda" and not forced:
        return _skipped(section, "no CUDA device")
    if section == "tflops":
        sizes = tuple(int(s) for s in args.sizes.split(","))
        return tflops_tasks(device, args.iters, sizes)
    if section == "overhead":
        return overhead_tasks(device, 20 * args.iters)
    return exchange_tasks(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per measurement (median)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="no row starts after this many seconds")
    parser.add_argument("--json", default=DEFAULT_JSON, help="rewritten after every row ('' for none)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="tflops row lengths in tokens")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from {SECTIONS}")
    device = _device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (no CUDA device)"
    libs = gpu_libraries.probe_gpu_libraries(device)
    header = {"device": name, "torch": torch.__version__, "libraries": repr(libs), "budget_s": args.budget_s}
    print(f"gpu_check on {name}, torch {torch.__version__}, budget {args.budget_s:.0f} s")
    print(f"libraries: {libs}", flush=True)
    report = Report(Path(args.json) if args.json else None, header)
    runner = Runner(report, args.budget_s)
    for section in sections:
        runner.section(section, section_tasks(section, device, args, forced=args.device is not None))
    for row in report.rows:
        if row.result.startswith("skip:") and row.kernel in ("-", "auto"):
            print(f"{row.section}: {row.result}")
    if report.stopped:
        print(f"stopped: {report.stopped}")
    report.write()
    print(f"{len(report.rows)} rows in {runner.elapsed():.0f} s" + (f"; JSON: {args.json}" if args.json else ""))
    return 1 if any(_kind(r) in ("FAIL", "error") for r in report.rows) else 0


if __name__ == "__main__":
    sys.exit(main())

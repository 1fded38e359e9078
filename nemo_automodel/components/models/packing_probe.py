"""The packing-isolation probe: does this model, packed and under CP, compute each document as if alone?

A list of known features cannot keep up with transformers; a measurement can. Before
step 1 the probe runs one short packed row of four random documents through the model
with the project's attention on the real CP group, forward and backward, and compares
each document's logits, and the gradients of a few parameters, with that document run
alone in one process through the model's own eager attention. Anything that lets
documents see each other (a token mixer outside attention, ALiBi in the model's own code,
positions from the row index, attention that never reaches the CP function) shows up as a
difference far above float32 rounding, and the model is refused by name.

Cost: one packed forward + backward of the row and one per document in eager, on the
training device, in float32 (a half-precision model is cast up and back, which is exact).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from nemo_automodel.components.distributed.blockdiag_cp import CPOptions, make_cp_blockdiag_batch_and_ctx
from nemo_automodel.components.models.packing_guard import model_name, packing_blockers

logger = logging.getLogger(__name__)

# Fractions of the probe row per document: uneven, so that under CP documents straddle rank boundaries
# (contiguous layout) and the balanced layout cuts the longest one.
_SHARES = (0.4, 0.3, 0.2, 0.1)
_PROBE_PARAMS = 6  # gradients compared: a few tensors spread over the model, first and last included


class PackingLeakError(ValueError):
    """The probe found packed documents influencing each other beyond rounding."""


@dataclass(frozen=True)
class ProbeReport:
    """What the probe measured (every rank of the CP group holds the same figures).

    Attributes:
        doc_lengths: The probe row's documents, in tokens.
        logits_leak: Per document, ``max |packed - alone| / max |alone|`` of its logits.
        grad_leak: Per compared parameter, the same for its gradient.
        tolerance: The largest difference accepted (from the probe's float32 rounding).
        attention_calls: CP attention calls in the packed forward (0: attention never reached CP).
        seconds: Wall time of the probe on this rank.
    """

    doc_lengths: tuple[int, ...]
    logits_leak: tuple[float, ...]
    grad_leak: dict[str, float]
    tolerance: float
    attention_calls: int
    seconds: float

    @property
    def leak(self) -> float:
        """The largest difference, logits or gradients."""
        return max([*self.logits_leak, *self.grad_leak.values()])


def probe_tolerance(dtype: torch.dtype = torch.float32) -> float:
    """The largest relative difference that is rounding, for a probe in ``dtype`` (float32: 1.5e-5).

    ``128 eps`` of float32 at least, whatever ``dtype``: transformers' eager reference runs its softmax in float32,
    and the per-document and packed runs sum in different orders through every layer (exact models measure
    1e-7 to 1e-6 on 2-16 layers). A leak between documents is far larger even in a random-init model
    (short convolutions 2.5e-4, linear attention 3e-2, ALiBi and chunks 0.5 to 1).
    """
    return 128 * max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)


def probe_lengths(cp: int, seq_len: int | None = None) -> tuple[int, ...]:
    """The probe row's document lengths: ``48 * cp`` tokens (>= 96), at most ``seq_len``, a multiple of ``2 cp``."""
    total = max(96, 48 * cp)
    if seq_len is not None:
        total = min(total, seq_len)
    total -= total % (2 * cp)
    lengths = [max(1, int(total * share)) for share in _SHARES]
    lengths[0] += total - sum(lengths)
    if min(lengths) < 1 or total < len(_SHARES):
        raise ValueError(f"verify_packing_isolation: seq_len={seq_len} is too short for a probe row at cp={cp}")
    return tuple(lengths)


def _probe_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """A few trainable parameters spread evenly over the model, first and last included."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        return {}
    count = min(_PROBE_PARAMS, len(named))
    picks = sorted({round(i * (len(named) - 1) / max(count - 1, 1)) for i in range(count)})
    return dict(named[i] for i in picks)


@contextlib.contextmanager
def _probe_mode(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> Iterator[None]:
    """Eval mode (no dropout), gradients only for ``params``, float32; everything restored on exit."""
    training = model.training
    requires = {p: p.requires_grad for p in model.parameters()}
    dtype = next(model.parameters()).dtype
    half = dtype in (torch.float16, torch.bfloat16)
    try:
        model.eval()
        if half:
            model.float()  # half -> float32 -> half is exact: the weights come back unchanged
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params.values():
            p.requires_grad_(True)
        yield
    finally:
        for p in model.parameters():
            p.grad = None
        for p, flag in requires.items():
            p.requires_grad_(flag)
        if half:
            model.to(dtype)
        model.train(training)


@contextlib.contextmanager
def _attention_implementation(model: Any, name: str) -> Iterator[None]:
    """The model's attention set to ``name`` (``"eager"``: its own code), restored on exit."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _reference(
    model: Any, ids: torch.Tensor, lengths: tuple[int, ...], cotangent: torch.Tensor, params: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each document alone through the model's eager attention: logits ``[S, V]`` and the params' gradients."""
    logits, start = [], 0
    with _attention_implementation(model, "eager"):
        for n in lengths:
            out = model(input_ids=ids[None, start : start + n], position_ids=torch.arange(n, device=ids.device)[None])
            doc = out.logits[0].float()
            (doc * cotangent[start : start + n]).sum().backward()
            logits.append(doc.detach())
            start += n
    grads = {name: _grad(p) for name, p in params.items()}
    for p in params.values():
        p.grad = None
    return torch.cat(logits), grads


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    return param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)


def _rel(diff: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return diff / scale.clamp_min(torch.finfo(torch.float32).tiny)


def run_packing_probe(
    model: Any,
    cp_mesh: DeviceMesh | None,
    *,
    options: CPOptions | None = None,
    attention_scope: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    seq_len: int | None = None,
    seed: int = 0,
) -> ProbeReport:
    """Collective over ``cp_mesh``: measure how far packed, CP-sharded documents differ from each one alone.

    Args:
        model: A transformers causal LM on its training device, not yet FSDP-sharded, identical on every rank.
        cp_mesh: The 1-D CP mesh training will use (``None``: one process).
        options: The training's CP options (layout, exchange); the kernel is ``sdpa_varlen`` (any dtype: the
            probe checks the model, the kernels have their own tests).
        attention_scope: A context held around the packed forward and backward (``patch_sdpa`` routes).
        seq_len: The training row length; the probe row is no longer.
        seed: Seeds the random documents (the same on every rank).
    """
    began = time.perf_counter()
    lengths = probe_lengths(_cp_size(cp_mesh), seq_len)
    total = sum(lengths)
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (total,), generator=gen).to(device)
    cotangent = torch.randn(total, model.get_output_embeddings().weight.shape[0], generator=gen).to(device)
    params = _probe_params(model)
    with _probe_mode(model, params):
        want, want_grads = _reference(model, ids, lengths, cotangent, params)
        row = {
            "input_ids": ids[None],
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None].to(device),
            "_packed_seq_ids": torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None].to(device),
        }
        probe_options = replace(options or CPOptions(), attn_backend="sdpa_varlen")
        ctx, local, shard = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, row, options=probe_options)
        positions = shard.positions.to(device)
        real = positions < total
        scope = attention_scope() if attention_scope is not None else contextlib.nullcontext()
        with ctx() as state, scope:
            got = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits[0].float()
            local_cotangent = torch.zeros_like(got)
            local_cotangent[real] = cotangent[positions[real]]
            (got * local_cotangent).sum().backward()
            calls = state.stats.calls
        doc_of = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).to(device)
        diff = (got[real] - want[positions[real]]).abs().amax(dim=-1)
        per_doc = torch.zeros(len(lengths), device=device).scatter_reduce(0, doc_of[positions[real]], diff, "amax")
        flat = torch.cat([_grad(p).flatten().float() for p in params.values()]) if params else None
        per_doc, flat, calls = _reduce_over(cp_mesh, per_doc, flat, calls, device)
        shares = flat.split([p.numel() for p in params.values()]) if flat is not None else ()
    logits_leak = _rel(per_doc, want.abs().amax()).tolist()
    grad_leak = {
        name: float(_rel((shares[i].view_as(ref) - ref.float()).abs().amax(), ref.abs().amax().float()))
        for i, (name, ref) in enumerate(want_grads.items())
    }
    return ProbeReport(lengths, tuple(logits_leak), grad_leak, probe_tolerance(), calls, time.perf_counter() - began)


def _reduce_over(
    cp_mesh: DeviceMesh | None, per_doc: torch.Tensor, shares: torch.Tensor | None, calls: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Over the CP group: the largest per-document difference, the summed gradient shares, the fewest calls."""
    if cp_mesh is None or cp_mesh.size() == 1:
        return per_doc, shares, calls
    group = cp_mesh.get_group()
    dist.all_reduce(per_doc, op=dist.ReduceOp.MAX, group=group)
    if shares is not None:
        dist.all_reduce(shares, group=group)
    fewest = torch.tensor([calls], device=device)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=group)
    return per_doc, shares, int(fewest.item())


def _likely_cause(model: Any, report: ProbeReport, route: str) -> str:
    if report.attention_calls == 0 and route != "eager":
        return (
            "the model's attention never reached the CP attention function (0 calls): its attention modules "
            "compute attention themselves"
        )
    blockers = packing_blockers(model, route)
    if blockers:
        return "; ".join(b.describe() for b in blockers)
    return (
        "no token mixer outside attention was recognised: look for code that uses the row index instead of "
        "each document's position_ids (an arange over the row, cache_position), or a mixing layer of a new kind"
    )


def verify_packing_isolation(
    model: Any,
    cp_mesh: DeviceMesh | None = None,
    *,
    options: CPOptions | None = None,
    attention_scope: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    route: str = "hf_interface",
    seq_len: int | None = None,
) -> ProbeReport:
    """Collective: refuse ``model`` if packed documents influence each other (see :func:`run_packing_probe`).

    Call it before training, on every rank of the CP group, with the model on its device and not yet sharded.
    Arguments as :func:`run_packing_probe`; ``route`` (``model.attention``) says whether attention must reach the
    CP function (``eager``: never, cp=1 only) and what the refusal suggests.

    Raises:
        PackingLeakError: on every rank, naming the model class, the leak, its most likely cause and the options.
    """
    report = run_packing_probe(model, cp_mesh, options=options, attention_scope=attention_scope, seq_len=seq_len)
    reached = report.attention_calls > 0 or route == "eager"  # the eager route never calls CP attention (cp=1)
    if reached and report.leak <= report.tolerance:
        logger.info(
            "packing-isolation probe passed: %s, %d documents (%s tokens), largest difference %.2g (tolerance %.2g), "
            "%d attention calls, %.2f s",
            model_name(model),
            len(report.doc_lengths),
            "+".join(map(str, report.doc_lengths)),
            report.leak,
            report.tolerance,
            report.attention_calls,
            report.seconds,
        )
        return report
    docs = ", ".join(f"{n} tokens: {leak:.2g}" for n, leak in zip(report.doc_lengths, report.logits_leak))
    worst = max(report.grad_leak.items(), key=lambda kv: kv[1], default=("-", 0.0))
    raise PackingLeakError(
        f"{model_name(model)} leaks between packed documents: the packing-isolation probe (cp={_cp_size(cp_mesh)}, "
        f"float32) finds each document's logits differ from the document run alone in eager attention by up to "
        f"{max(report.logits_leak):.3g} relative (per document: {docs}; gradient of {worst[0]}: {worst[1]:.3g}); "
        f"rounding accounts for {report.tolerance:.2g}. Most likely cause: {_likely_cause(model, report, route)}. "
        "Options: train a model whose only token mixing is attention through transformers' attention interface; "
        "or, knowing that documents will leak, model.verify_packing=false (API: do not call "
        "verify_packing_isolation)"
    )


def _cp_size(cp_mesh: DeviceMesh | None) -> int:
    """The CP size of ``cp_mesh`` (``None``: 1)."""
    return cp_mesh.size() if cp_mesh is not None else 1

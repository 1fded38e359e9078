"""Planner: what each layout and K/V exchange would cost, before renting a cluster.

Library: :func:`plan_rows` evaluates every layout x exchange for a packed row with
the same shard plans, exchange plans and cost model the runtime uses (one cost
model, not two). Command line::

    python -m nemo_automodel.components.distributed.blockdiag_cp.plan --cp 8 --seq-len 131072 \\
        --doc-lens 30000,2000,1500 [--heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --device cuda] \\
        [--window 4096] [--ranks-per-node 4]
    python -m nemo_automodel.recipes.plan --cp 8 --seq-len 131072 \\
        --data train.jsonl [--data-format text|chat|instruction] [--text-field text] \\
        [--tokenizer /local/hf_tokenizer_dir] [--rows 8]

``--data`` (through :mod:`nemo_automodel.recipes.plan`, which has the same options) builds the fine-tuning
recipe's own packed rows: the same reading, formatting
(chat template, EOS after every document), tokenization and packing function
(:func:`nemo_automodel.components.datasets.loader.prepare_data`, the recipe's defaults for
packing algorithm and seed), so the plan describes the rows the recipe would train on.

Figures per layout and exchange (per CP rank, one attention layer, forward + backward):
K/V tokens and bytes received (max and mean over ranks; ``ulysses``: K/V rows for the
rank's heads, and every byte of its two all-to-alls, q/k/v and the output), the lower bound
(needed keys living on other ranks), the balance (max/mean attention work) and
the predicted step time relative to the best combination. Next to the four single paths it prints every
heads x sequence hybrid ``ulysses+P (h x s)`` (``1 < h < cp``, ``cp % h == 0``) with its received bytes
split per part (head all-to-alls / sequence exchange). ``--ranks-per-node N`` places CP ranks
``[k N, (k + 1) N)`` on node ``k``: groups that span nodes pay the inter-node link. ``--window W`` plans
sliding-window layers (transformers' ``sliding_window``): a rank then needs, and
the needed-only exchanges receive, only the keys within ``W`` of its rows.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nemo_automodel.components.distributed.blockdiag_cp import cost
from nemo_automodel.components.distributed.blockdiag_cp.exchange import compute_kv_plan
from nemo_automodel.components.distributed.blockdiag_cp.layout import (
    LAYOUTS,
    DocRuns,
    balance,
    doc_runs_from_lengths,
    make_shard_plan,
)

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class PlanRow:
    """One layout x exchange of one packed row."""

    layout: str
    path: str
    balance: float
    recv_max: int
    recv_mean: float
    bytes_max: int
    bound_max: int
    bound_mean: float
    step_s: float
    auto_pick: bool
    head_bytes_max: int = 0
    sequence_bytes_max: int = 0


def plan_rows(
    runs: DocRuns,
    cp: int,
    shape: cost.Shape,
    machine: cost.Machine,
    layouts: Iterable[str] = LAYOUTS,
    window: int | None = None,
    nodes: cost.Nodes = None,
) -> list[PlanRow]:
    """Every layout x exchange (the hybrids' factorizations too) for one row padded to a multiple of ``2 * cp``.

    ``nodes``: the node of every CP rank (``None``: one node). The ``auto`` mark is the runtime's pick.
    """
    runs = runs.padded_to(runs.total_len + (-runs.total_len) % (2 * cp))
    layouts = tuple(layouts)
    # `layout=auto` + `kv_exchange=auto` is one combination: the runtime's layout pick (judged on full-causal
    # layers), then that layout's exchange pick for the calls of `window`; one `<-` row, not one per layout
    auto_layout = cost.choose_layout(runs, cp, shape, machine).layout if set(layouts) == set(LAYOUTS) else None
    rows = []
    for layout in layouts:
        shard = make_shard_plan(runs, cp, layout)
        kv = compute_kv_plan(shard, window)
        segments = shard.windowed_segments(window)
        bounds = [seg.remote_kv_tokens for seg in segments]
        work_balance = balance([seg.attention_work for seg in segments])  # windows change the work, too
        auto = cost.choose_auto(shard, kv, shape, machine, window=window, nodes=nodes)[0].label
        costs = cost.choose(shard, kv, shape, machine, window=window, nodes=nodes, degrees=cost.hybrid_degrees(cp))[2]
        for c in costs:
            rows.append(
                PlanRow(
                    layout=layout,
                    path=c.label,
                    balance=work_balance,
                    recv_max=max(c.recv_tokens),
                    recv_mean=statistics.fmean(c.recv_tokens),
                    bytes_max=max(c.recv_bytes),
                    bound_max=max(bounds),
                    bound_mean=statistics.fmean(bounds),
                    step_s=c.step_s,
                    auto_pick=c.label == auto and layout == (auto_layout or layout),
                    head_bytes_max=max(c.head_bytes, default=0),
                    sequence_bytes_max=max(c.sequence_bytes, default=0),
                )
            )
    return rows


def format_table(rows: list[PlanRow]) -> str:
    """A markdown table; ``step`` is relative to the best row."""
    best = min(r.step_s for r in rows)
    lines = [
        "| layout | kv_exchange | balance | KV recv/rank max | mean | MiB recv max | heads / sequence MiB "
        "| lower bound max | mean | predicted step | relative | auto |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        parts = f"{r.head_bytes_max / 2**20:.1f} / {r.sequence_bytes_max / 2**20:.1f}" if "+" in r.path else ""
        lines.append(
            f"| {r.layout} | {r.path} | {r.balance:.3f} | {r.recv_max} | {r.recv_mean:.0f} | "
            f"{r.bytes_max / 2**20:.1f} | {parts} | {r.bound_max} | {r.bound_mean:.0f} | {r.step_s * 1e3:.3g} ms | "
            f"{r.step_s / best:.2f}x | {'<-' if r.auto_pick else ''} |"
        )
    return "\n".join(lines)


# The attention shape without a model: a typical large model's (Llama-3-8B-like).
_DEFAULT_SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"}
_CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def model_attention_shape(model_dir: str) -> dict[str, int | str]:
    """Heads, KV heads, head dim and dtype from a HF model dir's ``config.json`` (a multimodal one's text part).

    Raises:
        ValueError: no readable ``config.json``, or one without ``num_attention_heads``.
    """
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model {model_dir}: cannot read {path} ({exc}); pass a local HF model directory") from None
    config = config.get("text_config") or config
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"--model {model_dir}: {path} has no num_attention_heads; pass --heads/--kv-heads/--head-dim")
    shape: dict[str, int | str] = {
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
    }
    dtype = _CONFIG_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")))
    if dtype is not None:
        shape["dtype"] = dtype
    return shape


def _fill_shape(args: argparse.Namespace) -> str:
    """Fill ``args``' unset shape fields: explicit flags > ``--model`` (or ``--tokenizer``'s model) > defaults.

    Returns:
        Where the shape came from, for the header line.
    """
    model = args.model
    if model is None and args.tokenizer and os.path.isfile(os.path.join(args.tokenizer, "config.json")):
        model = args.tokenizer  # a model dir given as the tokenizer: plan with that model's shape
    from_model = model_attention_shape(model) if model else {}
    given = [name for name in _DEFAULT_SHAPE if getattr(args, name) is not None]
    for name, default in _DEFAULT_SHAPE.items():
        if getattr(args, name) is None:
            setattr(args, name, from_model.get(name, default))
    if not model:
        return "defaults" if not given else f"--{', --'.join(n.replace('_', '-') for n in given)}, else defaults"
    overridden = f"; {', '.join('--' + n.replace('_', '-') for n in given)} given" if given else ""
    return f"{os.path.join(model, 'config.json')}{overridden}"


def _positive_int(text: str) -> int:
    """``argparse`` type: an integer >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _doc_lengths(text: str) -> list[int]:
    """``argparse`` type: comma-separated positive document lengths."""
    parts = [x for x in text.split(",") if x.strip()]
    if not parts or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers (document lengths)")
    return [int(x) for x in parts]


def _average(tables: list[list[PlanRow]]) -> list[PlanRow]:
    """Row-wise mean over several packed rows (auto marks the one combination chosen most often)."""
    picks = [sum(r.auto_pick for r in group) for group in zip(*tables)]
    most = max(range(len(picks)), key=lambda i: (picks[i], -i))  # ties: the first (contiguous, then halo)
    out = []
    for group in zip(*tables):
        first = group[0]  # the same layout and path in every table
        out.append(
            PlanRow(
                layout=first.layout,
                path=first.path,
                balance=statistics.fmean(r.balance for r in group),
                recv_max=max(r.recv_max for r in group),
                recv_mean=statistics.fmean(r.recv_mean for r in group),
                bytes_max=max(r.bytes_max for r in group),
                bound_max=max(r.bound_max for r in group),
                bound_mean=statistics.fmean(r.bound_mean for r in group),
                step_s=statistics.fmean(r.step_s for r in group),
                auto_pick=len(out) == most,
                head_bytes_max=max(r.head_bytes_max for r in group),
                sequence_bytes_max=max(r.sequence_bytes_max for r in group),
            )
        )
    return out


# The recipe-side adapter of ``--data``: (parsed arguments) -> document lengths of each packed row.
RowsFromData = Callable[[argparse.Namespace], list[list[int]]]


def main(argv: list[str] | None = None, *, rows_from_data: RowsFromData | None = None) -> None:
    """The command line; ``--data`` needs ``rows_from_data`` (the recipe's: :mod:`nemo_automodel.recipes.plan`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=_positive_int, required=True, help="CP size")
    parser.add_argument("--seq-len", type=_positive_int, required=True, help="packed row length")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--doc-lens", type=_doc_lengths, help="comma-separated document lengths of one packed row")
    source.add_argument("--data", help="the recipe's data: a json/jsonl/parquet/arrow file, a directory or a glob")
    parser.add_argument(
        "--data-format", default="text", choices=("text", "chat", "instruction"), help="as the recipe's data=..."
    )
    parser.add_argument("--text-field", default="text", help="the text field of --data-format text")
    parser.add_argument("--tokenizer", help="local Hugging Face tokenizer dir (default: bytes)")
    parser.add_argument("--rows", type=_positive_int, default=8, help="packed rows to evaluate from --data")
    parser.add_argument(
        "--model",
        help="local HF model dir: heads, KV heads, head dim and dtype from its config.json (default: --tokenizer's "
        "dir when it has a config.json; else 32/8 heads of 128, bf16); --heads/--kv-heads/--head-dim/--dtype win",
    )
    parser.add_argument("--heads", type=_positive_int)
    parser.add_argument("--kv-heads", type=_positive_int)
    parser.add_argument("--head-dim", type=_positive_int)
    parser.add_argument("--dtype", choices=sorted(_DTYPE_BYTES))
    parser.add_argument("--device", default="cuda", choices=sorted(cost.MACHINES))
    parser.add_argument("--window", type=_positive_int, help="sliding window of the layers to plan (default: full)")
    parser.add_argument(
        "--ranks-per-node",
        type=_positive_int,
        help="CP ranks per node, consecutive (default: all on one node); groups spanning nodes pay its link",
    )
    args = parser.parse_args(argv)
    try:
        source = _fill_shape(args)
    except ValueError as exc:
        parser.error(str(exc))
    shape = cost.Shape(args.heads, args.kv_heads, args.head_dim, _DTYPE_BYTES[args.dtype])
    machine = cost.MACHINES[args.device]
    if args.doc_lens:
        if sum(args.doc_lens) > args.seq_len:
            parser.error(f"--doc-lens add up to {sum(args.doc_lens)} tokens, more than --seq-len {args.seq_len}")
        packed = [args.doc_lens]
    else:
        if rows_from_data is None:
            parser.error("--data reads the recipe's data: run python -m nemo_automodel.recipes.plan")
        if not os.path.exists(args.data) and not glob.glob(args.data):
            parser.error(f"--data {args.data}: no such file")
        try:
            packed = rows_from_data(args)
        except ValueError as exc:
            parser.error(str(exc))
    nodes = tuple(r // args.ranks_per_node for r in range(args.cp)) if args.ranks_per_node else None
    tables = [
        plan_rows(doc_runs_from_lengths(row, args.seq_len), args.cp, shape, machine, window=args.window, nodes=nodes)
        for row in packed
    ]
    print(
        f"cp={args.cp} seq_len={args.seq_len} rows={len(tables)} docs/row={statistics.fmean(map(len, packed)):.1f} "
        f"heads={args.heads}/{args.kv_heads} head_dim={args.head_dim} dtype={args.dtype} device={args.device} "
        f"window={args.window or 'full'} ranks/node={args.ranks_per_node or args.cp} (shape: {source})"
    )
    print(format_table(_average(tables)))


if __name__ == "__main__":
    main()

"""Packed-sequence fine-tuning with block-diagonal context parallelism.

``main`` runs once in the launching process (the Hydra app): it validates the
config and either becomes the worker (torchrun / Slurm / a single local rank) or
starts ``dp * cp`` local workers. ``worker_main`` joins the process group and
calls ``train``, which reads top to bottom: data, model, optimizer, resume, loop
(with validation), final checkpoint, HF export, summary.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from nemo_automodel.components.checkpoint.adapter import ADAPTER_DIR, BASE_MODEL_FILE, LOAD_OPTIONS, SAVE_OPTIONS
from nemo_automodel.components.checkpoint.adapter import check_resume as check_adapter_resume
from nemo_automodel.components.checkpoint.adapter import save_outputs as save_adapter_outputs
from nemo_automodel.components.checkpoint.best import BEST_DIR, read_best, write_best
from nemo_automodel.components.checkpoint.dcp import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    newest_intact,
    read_trainer_state,
    save_checkpoint,
)
from nemo_automodel.components.checkpoint.hf_export import (
    export_config,
    export_dtype,
    export_hf,
    exported_at,
    record_export,
)
from nemo_automodel.components.checkpoint.resume import (
    apply_optim_settings,
    check_resume_step,
    compare_fingerprints,
    run_fingerprint,
)
from nemo_automodel.components.config.errors import InputError, input_errors, report_input_error
from nemo_automodel.components.config.schema import (
    FinetuneConfig,
    to_finetune_config,
    to_plain_dict,
)
from nemo_automodel.components.datasets.formats import answer_only
from nemo_automodel.components.datasets.loader import PackedData, RowSchedule, load_data, rows_for_rank
from nemo_automodel.components.datasets.tokenizer import HFTokenizer, build_tokenizer
from nemo_automodel.components.distributed.cpu_memory import set_malloc_thresholds
from nemo_automodel.components.distributed.parallel import (
    Topology,
    build_meshes,
    check_shared_run_dir,
    init_process_group,
    omp_num_threads,
    resolve_topology,
    set_threads,
    shard_model,
    training_device,
)
from nemo_automodel.components.launcher.env import detect_launch, is_secondary_rank
from nemo_automodel.components.launcher.local import free_port, launch_local_workers
from nemo_automodel.components.launcher.run_lock import RunDirInUseError, hold_run_dir
from nemo_automodel.components.models.causal_lm import (
    build_causal_lm,
    model_shape,
    pretrained_dtype,
    probe_packing_at_start,
)
from nemo_automodel.components.training.failure import propagate_failures
from nemo_automodel.components.training.metrics import LOG_FILE, MetricsWriter, StepMetrics, configure_logging
from nemo_automodel.components.training.optim import build_optimizer, build_scheduler
from nemo_automodel.components.training.preemption import (
    EXIT_PREEMPTED,
    PreemptionFlag,
    clear_preempted_marker,
    report_preempted,
)
from nemo_automodel.components.training.rng import seed_everything
from nemo_automodel.components.training.step import (
    StepSetup,
    attention_shape,
    bf16_autocast,
    cp_options,
    train_step,
    validate,
)
from nemo_automodel.recipes.checks import check_attn_backend, check_paths, check_run_dir
from nemo_automodel.recipes.lora import LoraRun, check_quantize, start_lora

logger = logging.getLogger("nemo_automodel.finetune")


def main(cfg: DictConfig, run_dir: Path) -> int:
    """Validate ``cfg`` and run the job from the launching process; return its exit code.

    A config or path error prints its message (its traceback goes to the run dir's log only) and
    returns :data:`EXIT_INPUT_ERROR` before any process starts.
    """
    show = not is_secondary_rank()  # under torchrun/srun every rank validates; rank 0 speaks
    try:
        config = to_finetune_config(cfg)  # unknown keys and values fail here, before any process starts
        check_paths(config)
        omp_num_threads(os.environ.get("OMP_NUM_THREADS"))  # a malformed value fails here, not in every worker
        if show:
            check_run_dir(config, run_dir)
    except ValueError as exc:
        return report_input_error(exc, show)
    try:  # rank 0's launching process holds the run dir for the whole run: a second run there fails here
        with hold_run_dir(run_dir) if show else contextlib.nullcontext():
            return _launch(config, run_dir)
    except RunDirInUseError as exc:
        return report_input_error(exc, show)


def _launch(config: FinetuneConfig, run_dir: Path) -> int:
    """Become the worker (torchrun / Slurm / one local rank) or start the local workers; return the exit code."""
    launch = detect_launch(master_port=config.dist.master_port)
    payload = to_plain_dict(config)
    if launch.mode != "local":  # torchrun / srun: this process is one of the workers
        return worker_main(payload, str(run_dir))
    world = (config.dist.dp_size or 1) * config.cp.size
    clear_preempted_marker(run_dir)
    if world == 1:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(config.dist.master_port or free_port()))
        return worker_main(payload, str(run_dir))
    return launch_local_workers(world, local_worker, (payload, str(run_dir)), config.dist, run_dir)


def local_worker(payload: dict[str, Any], run_dir: str) -> int:
    """``elastic_launch`` entry point: :func:`worker_main`, exiting with its code unless it is 0.

    The elastic agent reads return values only from successful workers; a preempted
    worker must exit with :data:`EXIT_PREEMPTED` so the agent sees it leave.
    """
    code = worker_main(payload, run_dir)
    if code:
        exit_now(code)
    return code


def exit_now(code: int) -> NoReturn:
    """Flush and close every log, then end this worker process at once with ``code``.

    The work is done (checkpoint written and renamed, metrics and TensorBoard closed, process group
    destroyed), but the interpreter's own finalization then spent 12-17 s in C++ destructors
    (measured after Ctrl-C on a loaded 2-core machine, no Python frame on the stack) before the
    launcher saw the worker leave; ``os._exit`` skips it, after the ``atexit`` handlers (without them
    multiprocessing's resource tracker warns about leaked semaphores).
    """
    run_exit_functions = getattr(atexit, "_run_exitfuncs", None)  # private: guarded
    if run_exit_functions is not None:
        run_exit_functions()  # atexit handlers (logging's flush, multiprocessing's semaphore cleanup) are quick
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_main(payload: dict[str, Any], run_dir: str) -> int:
    """One rank: check the topology, join the process group, train, leave; return the exit code."""
    config = to_finetune_config(payload)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        topology = resolve_topology(world, rank, local_rank, config.cp.size, config.dist.dp_size)  # no collective
    except ValueError as exc:
        return report_input_error(exc, rank == 0)
    device = training_device(local_rank)
    threads = set_threads(config.dist.threads, int(os.environ.get("LOCAL_WORLD_SIZE", world)), device)
    malloc = set_malloc_thresholds(config.dist.cpu_malloc_threshold_kib) if device.type == "cpu" else None
    init_process_group(device, config.dist.pg_timeout_s)
    try:
        with propagate_failures(rank, world):  # a failure here is named on every rank, not just a broken collective
            shared = [run_dir]
            dist.broadcast_object_list(shared, src=0)  # under torchrun every rank's Hydra made its own dir: rank 0's
            try:
                return train(config, Path(shared[0]), topology, device, threads, malloc)
            except InputError as exc:  # every rank raises it (config checks, rank 0's data outcome): rank 0 says it
                return report_input_error(exc, topology.is_main)
    finally:
        dist.destroy_process_group()


def train(
    config: FinetuneConfig,
    run_dir: Path,
    topology: Topology,
    device: torch.device,
    threads: str | None = None,
    malloc: str | None = None,
) -> int:
    """Collective: the training job on an initialized process group; return 0 or :data:`EXIT_PREEMPTED`.

    ``threads``, ``malloc``: how :func:`worker_main` set this process's threads and glibc's malloc thresholds, to
    log (callers that set them themselves, like the test pools, pass nothing).

    Raises:
        InputError: on every rank, for a config, path or data problem found while setting up.
    """
    configure_logging(topology.rank, run_dir)
    if threads is not None:
        logger.info("threads: %s", threads)
    if malloc is not None:
        logger.info("CPU malloc: %s", malloc)
    trainer = config.trainer
    seed_everything(trainer.seed)
    with input_errors():
        check_attn_backend(config, device)  # an explicit kernel that cannot run here: refused before training
        check_quantize(config.peft, device)  # QLoRA without CUDA or bitsandbytes: refused before loading anything
    meshes = build_meshes(topology, device, config.dist.pg_timeout_s)
    if topology.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _save_resolved_config(config, run_dir)  # early, so a run that fails while loading still has it
    check_shared_run_dir(run_dir, topology.rank)  # checkpoints need one run dir on every node

    with input_errors():
        tokenizer = build_tokenizer(config.tokenizer, config.model.pretrained_path)
        # the job's c10d store (no public accessor; failure.py reads it the same way): rank 0 posts the data there
        data = load_data(config.data, tokenizer, topology.is_main, dist.distributed_c10d._get_default_store())
        model = build_causal_lm(
            config.model, tokenizer.vocab_size, trainer.seed, trainer.activation_checkpointing, config.data.seq_len
        )
    dataset = data.train
    schedule = RowSchedule(len(dataset), topology.dp, trainer.grad_accum, config.data.seed)
    hf_config = model.config
    if topology.is_main:  # again, now with what trains: the loaded model's shape, the tokenizer actually used
        _save_resolved_config(config, run_dir, hf_config, tokenizer)
    model = model.to(device)
    with input_errors():  # every rank of a CP group measures the same leak: all refuse together
        probe_packing_at_start(model, config.model, meshes.cp, cp_options(config.cp, None), config.data.seq_len)
    lora: LoraRun | None = None
    if config.peft.method == "lora":  # after the probe: it checks the base model's own attention
        with input_errors():
            lora = start_lora(config, model, tokenizer, run_dir, topology.rank)
    model = shard_model(model, meshes.dp_cp)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, trainer.max_steps)
    _log_setup(config, topology, device, data, model, run_dir)
    validation = None if data.validation is None else rows_for_rank(data.validation, topology.dp, topology.dp_rank)

    ckpt_root = run_dir / "checkpoints"
    fingerprint = run_fingerprint(config, dataset, topology.dp)
    start_step = _resume(config, fingerprint, ckpt_root, model, optimizer, scheduler, topology, schedule, lora)
    best = read_best(run_dir) if trainer.keep_best else None

    def save(step: int, root: Path = ckpt_root, keep: int = trainer.keep_checkpoints) -> Path:
        state = TrainerState(
            step,
            step * schedule.rows_per_step,
            scheduler.state_dict(),
            topology.world,
            topology.dp,
            topology.cp,
            fingerprint,
        )
        path = save_checkpoint(
            root,
            state,
            model,
            optimizer,
            keep,
            topology.rank,
            options=SAVE_OPTIONS if lora else None,  # LoRA: the adapters and their optimizer state only
            records={BASE_MODEL_FILE: lora.base.record()} if lora else None,
        )
        logger.info("checkpoint saved: %s", path)
        return path

    setup = StepSetup(
        meshes=meshes,
        device=device,
        cp=config.cp,
        attention=config.model.attention,
        pad_id=tokenizer.pad_id,
        grad_clip=config.optim.grad_clip,
        bf16=trainer.bf16,
        on_nonfinite=trainer.on_nonfinite,
        # the step's frozen CP options: every batch builder snapshots them (no process-wide knobs)
        options=cp_options(config.cp, attention_shape(hf_config, bf16_autocast(trainer.bf16, device))),
    )
    writer = MetricsWriter(run_dir, topology.is_main, start_step, trainer.max_steps, trainer.log_every)
    outputs = _Outputs(run_dir, latest_checkpoint(ckpt_root), best)
    group = meshes.dp_cp.get_group()
    # installed until the export is written: a signal in any phase ends with a checkpoint (preemption.py)
    preemption = PreemptionFlag().install()

    def stop(step: int, checkpoint: Path, pending: str) -> int:
        if topology.is_main:
            report_preempted(run_dir, step, checkpoint, preemption.signal_name, pending)
        writer.summary(f"preempted after step {step} of {trainer.max_steps}", outputs.places(), outputs.best)
        return EXIT_PREEMPTED

    try:
        for step in range(start_step, trainer.max_steps):
            rows = [dataset.row(schedule.row_index(step, m, topology.dp_rank)) for m in range(trainer.grad_accum)]
            lr = scheduler.get_last_lr()[0]
            began = time.perf_counter()
            result = train_step(
                model,
                optimizer,
                scheduler,
                rows,
                setup,
                step + 1,
                check_cp=step == start_step,
                preempt=preemption.is_set,  # agreed over every rank in the step's all-reduce
            )
            elapsed = time.perf_counter() - began
            done = step + 1
            due = trainer.val_every and done % trainer.val_every == 0
            val = (
                validate(model, validation, setup, stop=preemption.is_set)
                if validation and (due or done == trainer.max_steps)
                else None
            )
            interrupted = val is not None and val.interrupted
            if interrupted:
                logger.warning("validation after step %d cut short by a signal: not recorded", done)
                val = None
            writer.log(
                StepMetrics(
                    step=done,
                    loss=result.loss,
                    lr=lr,
                    grad_norm=result.grad_norm,
                    tokens=result.tokens,
                    loss_tokens=result.loss_tokens,
                    tokens_per_s=result.tokens / elapsed,
                    step_time_s=elapsed,
                    kv_path=result.kv_path,
                    kv_tokens_received=result.kv_tokens_received if result.kv_path else None,
                    skipped=result.skipped,
                    val_loss=None if val is None else val.loss,
                    val_ppl=None if val is None else val.ppl,
                )
            )
            saved_best = val is not None and trainer.keep_best and (outputs.best is None or val.loss < outputs.best[1])
            if saved_best:
                outputs.best = (done, val.loss)
                path = save(done, run_dir / BEST_DIR, 1)
                if topology.is_main:
                    write_best(run_dir, done, val.loss, path)
            periodic = bool(trainer.ckpt_every) and done % trainer.ckpt_every == 0 and done < trainer.max_steps
            if periodic:
                outputs.checkpoint = save(done)
            # a signal during validation or a save arrived after the step's all-reduce: agree on it here
            late = (interrupted or saved_best or periodic) and preemption.agreed(group, device)
            if done < trainer.max_steps and (result.preempted or late):
                if not periodic:
                    outputs.checkpoint = save(done)
                return stop(done, outputs.checkpoint, f"steps {done + 1}-{trainer.max_steps}")

        if start_step < trainer.max_steps:
            outputs.checkpoint = save(trainer.max_steps)
            if preemption.agreed(group, device):  # a signal up to the end of the final save: export on requeue
                return stop(trainer.max_steps, outputs.checkpoint, "the HF export" if trainer.export_hf else "nothing")
        export_due = trainer.export_hf and not exported_at(run_dir, trainer.max_steps)
        merged = None
        if lora is not None:  # adapter/ in PEFT format; with an export due, the merged weights for hf/
            outputs.adapter, merged = save_adapter_outputs(
                model, lora.peft_model, hf_config, lora.base, run_dir / ADAPTER_DIR, topology.rank, export_due
            )
        if export_due:
            outputs.export = _export(config, model, hf_config, tokenizer, run_dir / "hf", topology, merged)
            if topology.is_main:
                record_export(run_dir, trainer.max_steps, outputs.export)
            if preemption.agreed(group, device):  # the run is complete: the requeued run says so and stops
                return stop(trainer.max_steps, outputs.checkpoint, "nothing")
        elif trainer.export_hf:
            outputs.export = run_dir / "hf"
    finally:
        preemption.uninstall()
        writer.close()
    if start_step >= trainer.max_steps:
        outcome = f"already complete at step {start_step}; raise trainer.max_steps to continue"
    else:
        outcome = f"finished {trainer.max_steps} steps"
    writer.summary(outcome, outputs.places(), outputs.best)
    return 0


def _save_resolved_config(config: FinetuneConfig, run_dir: Path, hf_config: Any = None, tokenizer: Any = None) -> None:
    """``resolved_config.yaml``: the validated config; with ``hf_config``, the model's real shape and tokenizer."""
    plain = to_plain_dict(config)
    if hf_config is not None and config.model.pretrained_path is not None:
        plain["model"].update(model_shape(hf_config))  # the checkpoint's shape, not the unused size fields
    if isinstance(tokenizer, HFTokenizer) and config.tokenizer.name_or_path is None:
        plain["tokenizer"]["name_or_path"] = tokenizer.name  # the model's own tokenizer
    OmegaConf.save(OmegaConf.create(plain), run_dir / "resolved_config.yaml")


@dataclass
class _Outputs:
    """Where a run's outputs are, for the end-of-run summary (``best``: ``(step, validation loss)``)."""

    run_dir: Path
    checkpoint: Path | None
    best: tuple[int, float] | None
    export: Path | None = None
    adapter: Path | None = None

    def places(self) -> dict[str, Path | None]:
        tensorboard = self.run_dir / "tensorboard"
        best = latest_checkpoint(self.run_dir / BEST_DIR) if self.best is not None else None
        return {
            "run dir": self.run_dir,
            "metrics": self.run_dir / "metrics.jsonl",
            "log": self.run_dir / LOG_FILE,
            "checkpoint": self.checkpoint,
            "best checkpoint": best,
            "LoRA adapter": self.adapter,
            "HF export": self.export,
            "tensorboard": tensorboard if tensorboard.is_dir() else None,
        }


def _resume(
    config: FinetuneConfig,
    fingerprint: dict[str, Any],
    ckpt_root: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    topology: Topology,
    schedule: RowSchedule,
    lora: LoraRun | None,
) -> int:
    """Load the newest intact checkpoint when ``trainer.resume=auto``; return the step to continue from.

    Changed optimizer settings are applied and logged, changed dp/cp logged; other changes are refused.

    Raises:
        InputError: ``trainer.max_steps`` is below the checkpoint's step (nothing to train, and its export
            would not be the model asked for), or a setting changed that changes what the run trains on, or
            a checkpoint of the other kind (LoRA vs full) or of another LoRA base.
    """
    trainer = config.trainer
    path = newest_intact(ckpt_root, topology.rank) if trainer.resume == "auto" else None
    if path is None:
        return 0
    recorded = read_trainer_state(path)
    check_resume_step(trainer.max_steps, path, recorded.step)
    with input_errors():  # a checkpoint of the other kind (LoRA vs full), or of another LoRA base
        check_adapter_resume(path, lora.base if lora else None)
    changes = compare_fingerprints(recorded.fingerprint, fingerprint, path, recorded.step)
    state = load_checkpoint(path, model, optimizer, topology.rank, options=LOAD_OPTIONS if lora else None)
    scheduler.load_state_dict(state.scheduler)
    apply_optim_settings(optimizer, scheduler, config.optim)
    for change in changes:
        logger.info("resume: %s", change)
    if state.rows_consumed != state.step * schedule.rows_per_step:
        logger.warning(
            "resuming with a different dp * grad_accum (%d rows/step now, %d before): the data order "
            "differs from the uninterrupted run",
            schedule.rows_per_step,
            state.rows_consumed // state.step,
        )
    if state.step == trainer.max_steps:
        logger.info(
            "the run is already complete at step %d (%s); raise trainer.max_steps to continue", state.step, path
        )
    else:
        logger.info("resumed from %s (step %d)", path, state.step)
    return state.step


def _log_setup(
    config: FinetuneConfig,
    topology: Topology,
    device: torch.device,
    data: PackedData,
    model: torch.nn.Module,
    run_dir: Path,
) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    dataset = data.train
    label_tokens = int((dataset.labels != -100).sum())
    fill = float((dataset.seq_ids > 0).float().mean())
    logger.info("run dir: %s", run_dir)
    logger.info(
        "world %d = dp %d x cp %d on %s; gradients: FSDP2 over dp x cp (SUM, loss / global label count)",
        topology.world,
        topology.dp,
        topology.cp,
        device,
    )
    if topology.cp > 1:
        logger.info(
            "block-diagonal CP: cp=%d attn_backend=%s kv_exchange=%s layout=%s overlap=%s, attention via %s",
            topology.cp,
            config.cp.attn_backend,
            config.cp.kv_exchange,
            config.cp.layout,
            config.cp.overlap,
            config.model.attention,
        )
    logger.info(
        "data: %s, %d packed rows of %d tokens (%.1f%% filled, %d label tokens: %s, %s); %s",
        config.data.source,
        len(dataset),
        config.data.seq_len,
        100 * fill,
        label_tokens,
        "answers only" if answer_only(config.data) else "all tokens",
        config.data.packing_algorithm,
        data.summary,
    )
    if data.validation is not None:
        logger.info(
            "validation: %d packed rows, %d label tokens; evaluated %s",
            len(data.validation),
            int((data.validation.labels != -100).sum()),
            f"every {config.trainer.val_every} steps and after the last"
            if config.trainer.val_every
            else "after the last step",
        )
    logger.info(
        "model: %s, %.2fM parameters; global batch %d rows/step; %d steps",
        config.model.pretrained_path or "Llama from config",
        n_params / 1e6,
        topology.dp * config.trainer.grad_accum,
        config.trainer.max_steps,
    )


def _export(
    config: FinetuneConfig,
    model: torch.nn.Module,
    hf_config: Any,
    tokenizer: Any,
    out_dir: Path,
    topology: Topology,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path | None:
    """Collective: the HF export (model in its dtype, inference config, tokenizer); rank 0 returns its path.

    ``weights``: the full weights to write instead of ``model``'s (LoRA: merged on rank 0, ``{}`` elsewhere).
    """
    pretrained = config.model.pretrained_path
    dtype = export_dtype(config.trainer.export_dtype, pretrained_dtype(pretrained) if pretrained else None)
    out_config = export_config(hf_config, dtype, tokenizer.eos_id, tokenizer.pad_id, built=pretrained is None)
    path = export_hf(model, out_config, out_dir, topology.rank, dtype, weights)
    if path is not None:
        if isinstance(tokenizer, HFTokenizer):
            tokenizer.save_pretrained(path)
        logger.info("HF export (%s): %s", str(dtype).removeprefix("torch."), path)
    return path

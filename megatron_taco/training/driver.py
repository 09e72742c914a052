"""The driver shared by every model and by fine-tuning: ``main(spec)`` parses and checks the
flags, plans the resume (training/configure.py), and ``run(cfg, spec)`` does one run:

    process groups -> agree on the plan -> tokenizer -> spec.build -> engine
        -> load what the plan names -> Trainer.train -> plots -> teardown

``pretrain_taco.py``, ``pretrain_sas.py`` and ``taco-finetune`` are ``main(SPEC)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import random
import sys

import numpy as np

from megatron_taco.arguments import program_name
from megatron_taco.checkpoint.layout import TrainingState, last_complete_checkpoint
from megatron_taco.checkpoint.ownership import SaveLock, save_lock, set_aside
from megatron_taco.checkpoint.plan import FALLBACK, RESUME
from megatron_taco.errors import ConfigError, RunError
from megatron_taco.runtime.faults import hook_point
from megatron_taco.runtime.launcher import launcher_rank, launcher_world_size
from megatron_taco.training.configure import build_parser, configs_from_args, resume_request
from megatron_taco.training.optim import optimizer_implementation
from megatron_taco.training.resilience.exit import ExitMonitor
from megatron_taco.training.resilience.peers import (
    PeerFailure,
    PeerWatch,
    abort_process_groups,
    describe_peer_failure,
    gather_peers,
    is_peer_failure,
)
from megatron_taco.training.spec import BuildContext, ModelSpec, RunConfigs

logger = logging.getLogger("megatron_taco.driver")


def main(spec: ModelSpec, argv: list[str] | None = None) -> int:
    """Every driver's command line: exit 0, 2 for a ConfigError, 1 for a RunError (a failed
    save, a diverged loss, a dead peer), each one line without a traceback."""
    # First thing: parsing the flags and verifying the checkpoint behind --load can take
    # minutes, and a rank whose launcher dies meanwhile must not be left behind.
    monitor = ExitMonitor(program=program_name(spec.prog))
    monitor.tie_to_launcher()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        args = build_parser(spec).parse_args(argv)
        if spec.run is not None:
            return spec.run(spec, args, monitor)
        # --save is locked before any checkpoint in it (or in --load) is read: a second run
        # on it is "in use", not a verdict on files the first is writing.
        with lock_save(getattr(args, "save", None), args, monitor) as lock:
            cfg = configs_from_args(
                spec, args, world_size=launcher_world_size(), device_type=accelerator_name()
            )
            # Errors found later (e.g. ranks disagreeing on the checkpoint) are reported the
            # same way, after run() has torn the process groups down.
            return run(cfg, spec, monitor=monitor, lock=lock)
    except (ConfigError, RunError) as e:
        print(f"{program_name(spec.prog)}: error: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1
    finally:
        monitor.uninstall()


def accelerator_name() -> str:
    from megatron_taco.training.engine import accelerator_name

    return accelerator_name()


def lock_save(save: str | None, args, monitor: ExitMonitor):
    """save_lock of --save, held by global rank 0 from before any checkpoint in it is read
    to the end of the run. A --save that does not exist yet holds none: nothing is created
    before the flags are checked, and run() takes the lock then."""
    if save is None or not os.path.isdir(save):
        return contextlib.nullcontext(None)
    flock_local = bool(getattr(args, "save_lock_flock_local", False))
    return save_lock(save, launcher_rank(), monitor.exit_actions, flock_local=flock_local)


def run(
    cfg: RunConfigs,
    spec: ModelSpec,
    monitor: ExitMonitor | None = None,
    *,
    keep_process_group: bool = False,
    lock: SaveLock | None = None,
) -> int:
    """One run, from process groups to teardown. ``keep_process_group`` leaves the default
    group up for the next run of a sweep in the same processes (only this run's tensor/data
    parallel groups are destroyed). ``lock``: the save lock when the caller took it (else
    it is taken here, by global rank 0)."""
    # Before the heavy imports: a signal or a dead launcher during start-up ends the rank.
    own_monitor = monitor is None
    monitor = monitor or ExitMonitor()
    monitor.install(cfg.exit)
    monitor.phase = "start-up"
    try:
        # Rank 0 holds --save for the run; a second run on it stops before its rendezvous.
        held_lock = (
            contextlib.nullcontext(lock)
            if lock is not None
            else save_lock(
                cfg.checkpoint.save,
                launcher_rank(),
                monitor.exit_actions,
                flock_local=cfg.checkpoint.save_lock_flock_local,
            )
        )
        with monitor.answering_errors(), held_lock as held:
            if held is not None:
                _set_aside(cfg, spec)
            return _run(cfg, spec, monitor, keep_process_group)
    finally:
        if own_monitor:
            monitor.uninstall()


def _set_aside(cfg: RunConfigs, spec: ModelSpec) -> None:
    """--override-existing-checkpoints, by the holder of the save lock before any save."""
    if not cfg.checkpoint.override_existing_checkpoints:
        return
    stores = tuple(d for _, d in spec.stores(cfg)) if cfg.plan.starts_fresh else ()
    aside = set_aside(cfg.checkpoint.save, stores)
    if aside is not None:
        logger.warning(
            "--override-existing-checkpoints: the previous run's checkpoints and stores were "
            "moved to %s",
            aside,
        )


def _run(cfg: RunConfigs, spec: ModelSpec, monitor: ExitMonitor, keep_process_group: bool) -> int:
    # Heavy imports after validation: --help and config errors stay fast.
    import deepspeed  # noqa: F401  (creates DeepSpeed's logger, tuned below)

    from megatron_taco.training.engine import apply_numerics, destroy_distributed, release_engine

    apply_numerics(cfg.training)  # before any CUDA work, the model's included
    # DeepSpeed's INFO output (config dumps, per-step notes) drowns the training log.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    session = _Session(cfg, spec, monitor)
    try:
        session.start()
        session.build()
        session.train()
        return 0
    except Exception as error:
        if not session.peers or not is_peer_failure(error):
            raise
        timeout = cfg.parallel.distributed_timeout_minutes
        rank = session.parallel.rank
        raise PeerFailure(describe_peer_failure(error, rank, session.peers, timeout)) from None
    finally:
        session.close()
        release_engine(session.engine)
        if keep_process_group:
            if session.parallel is not None:
                session.parallel.destroy()
        else:
            destroy_distributed(session.parallel)


class _Session:
    """One run's state between the driver's steps (each reads in one screen)."""

    def __init__(self, cfg: RunConfigs, spec: ModelSpec, monitor: ExitMonitor) -> None:
        self.cfg, self.spec, self.monitor = cfg, spec, monitor
        self.parallel = self.engine = self.logger = self.peer_watch = None
        self.peers: list = []

    def start(self) -> None:
        """Process groups, the plan agreed on, seeds, the tokenizer (copied into --save)."""
        import torch

        from megatron_taco.checkpoint.rendezvous import agree_on_load, forget_node_results
        from megatron_taco.data.tokenizer import (
            load_config_tokenizer,
            save_tokenizer_copy,
            saved_tokenizer_record,
        )
        from megatron_taco.training.engine import init_distributed

        cfg = self.cfg
        hook_point("before_rendezvous", launcher_rank())
        self.monitor.phase = "the rendezvous"
        self.parallel = init_distributed(
            cfg.parallel.tensor_model_parallel_size,
            timeout=cfg.parallel.distributed_timeout,
            file_timeout=cfg.parallel.filesystem_timeout,
        )
        self.peers = gather_peers()
        if torch.distributed.get_backend() == "nccl":
            self.peer_watch = PeerWatch(self.peers, self.parallel.rank, abort_process_groups)
            self.peer_watch.start()
        forget_node_results("load")  # every rank of this node read it before the rendezvous
        agree_on_load(cfg.plan)
        if self.parallel.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        elif cfg.plan.warning is not None:
            logger.warning(cfg.plan.warning)
        self.rng_tracker = _seed_everything(cfg.data.seed, self.parallel)
        self.tokenizer = load_config_tokenizer(cfg.data)
        # --save holds the tokenizer, so that its checkpoints load, export and fine-tune
        # after the original file moved
        self.tokenizer_meta = saved_tokenizer_record(self.tokenizer)
        if self.parallel.rank == 0 and cfg.checkpoint.save is not None:
            save_tokenizer_copy(cfg.checkpoint.save, self.tokenizer, self.tokenizer_meta)

    def build(self) -> None:
        """The spec's parts, the engine, and what the plan loads into it."""
        from megatron_taco.checkpoint.load import execute_plan
        from megatron_taco.training.engine import (
            count_parameters,
            initialize_engine,
            norm_implementations,
        )

        cfg = self.cfg
        ctx = BuildContext(
            configs=cfg,
            model_config=cfg.model.with_vocab_size(self.tokenizer.vocab_size),
            parallel=self.parallel,
            rng_tracker=self.rng_tracker,
            tokenizer=self.tokenizer,
            seed=cfg.data.seed,
        )
        self.monitor.phase = "data and model set-up"
        hook_point("before_build", self.parallel.rank)
        self.parts = parts = self.spec.build(ctx)
        if cfg.monitor.exit_on_collapse and parts.valid_dataset is None:
            raise ConfigError(
                f"--exit-on-collapse: --split {cfg.data.split} leaves no validation documents "
                "in --data-path: nothing would watch the encoder"
            )
        if cfg.training.train_iters is None:  # --train-epochs: now that an epoch is known
            steps = parts.samples_per_epoch // cfg.deepspeed.global_batch_size
            training = cfg.training.with_train_iters(cfg.training.train_epochs * steps)
            self.cfg = cfg = dataclasses.replace(cfg, training=training)
        self.parameters = count_parameters(parts.model, self.parallel)
        self.norms = norm_implementations(parts.model)
        self.engine = initialize_engine(parts.model, cfg.training, cfg.deepspeed, self.parallel)
        request = resume_request(cfg, self.spec)
        self.state, self.plan = execute_plan(
            self.engine.model_engine, cfg.plan, request, self.parallel, self.rng_tracker
        )
        resumed = self.plan.action in (RESUME, FALLBACK)
        if resumed and (not self.plan.restore_optimizer or self.engine.scheduler.units_changed):
            _keep_lr_schedule(self.engine, self.state)

    def train(self) -> None:
        from megatron_taco.training.loop import Trainer
        from megatron_taco.training.observability.monitor import LearningMonitor
        from megatron_taco.training.observability.tracking import WandbRunState, saved_run_id

        cfg, state = self.cfg, self.state
        wandb_run_id = saved_run_id(state.callback_states)
        tracker = _open_wandb(cfg, wandb_run_id) if self.parallel.rank == 0 else None
        self.logger = _training_logger(cfg, state, tracker, self.parallel.rank)
        self.logger.print(_banner(self))
        # The W&B run id travels in the checkpoints, also through runs without W&B.
        wandb = (
            [WandbRunState(tracker, wandb_run_id)]
            if cfg.training.wandb_project or wandb_run_id
            else []
        )
        parts = dataclasses.replace(self.parts, callbacks=[*self.parts.callbacks, *wandb])
        trainer = Trainer(
            self.engine,
            self.parallel,
            cfg.training,
            parts,
            self.logger,
            checkpoint=cfg.checkpoint,
            seed=cfg.data.seed,
            num_workers=cfg.data.num_workers,
            rng_tracker=self.rng_tracker,
            checkpoint_metadata={
                "model": self.spec.name,
                "configs": cfg.as_dict(),
                "optimizer": optimizer_implementation(),
                "tokenizer": self.tokenizer_meta,
                **parts.metadata,
            },
            exit_monitor=self.monitor,
            learning_monitor=LearningMonitor(
                cfg.monitor,
                cfg.training.warmup_iters,
                self.logger.print,
                saves=cfg.checkpoint.save is not None,
            ),
        )
        # For the line of a rank that abandons a save (a sweep's runs share the monitor).
        save = cfg.checkpoint.save
        self.monitor.last_complete = (
            None if save is None else functools.partial(last_complete_checkpoint, save)
        )
        trainer.train(state)
        self.monitor.phase = "teardown"
        if self.parallel.rank == 0:
            _plot(cfg.training.metrics_path(save), self.logger, state.iteration)
        self.logger.close()
        import torch

        if torch.distributed.is_initialized():
            from megatron_taco.parallel import comm

            comm.barrier()

    def close(self) -> None:
        if self.peer_watch is not None:
            self.peer_watch.stop()
        if self.logger is not None:
            self.logger.close()


def _seed_everything(seed: int, parallel):
    from deepspeed.accelerator import get_accelerator

    from megatron_taco.parallel.random import model_parallel_seed

    # Our data pipeline uses explicit generators; the global ones are seeded (and
    # checkpointed) for any library code that draws from them.
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002
    # The tracker's stream lives on the device DeepSpeed puts the model on (the one set from
    # LOCAL_RANK), not wherever a GPU happens to be visible.
    device = get_accelerator().current_device_name()
    return model_parallel_seed(seed, parallel, device=device)


def _keep_lr_schedule(engine, state: TrainingState) -> None:
    # Without the optimizer DeepSpeed restores its step counters but not the LR scheduler:
    # continue the schedule at the checkpoint's optimizer step instead of restarting it (a
    # sample-based one at the consumed samples, skipped steps' included).
    me = engine.model_engine
    engine.scheduler.resume_at(me.global_steps - me.skipped_steps, state.consumed_samples)


def _open_wandb(cfg: RunConfigs, run_id: str | None):
    """Rank 0's W&B run (--wandb-project), or None."""
    t = cfg.training
    if t.wandb_project is None:
        return None
    from megatron_taco.training.observability.tracking import WandbRun

    return WandbRun(
        project=t.wandb_project,
        name=t.wandb_exp_name,
        save_dir=t.wandb_dir(cfg.checkpoint.save),
        entity=t.wandb_entity,
        mode=t.wandb_mode,
        config=cfg.as_dict(),
        run_id=run_id,
    )


def _training_logger(cfg: RunConfigs, state: TrainingState, tracker, rank: int):
    from megatron_taco.training.observability.log import TrainingLogger

    t = cfg.training
    return TrainingLogger(
        rank=rank,
        train_iters=t.train_iters,
        start_iteration=state.iteration,
        tensorboard_dir=t.tensorboard_dir,
        metrics_file=t.metrics_path(cfg.checkpoint.save),
        progress_bar=t.progress_bar,
        tracker=tracker,
    )


def _plot(metrics_file: str | None, train_logger, iteration: int) -> None:
    """The loss- and learning-curve PNGs beside the metrics file (rank 0, at the end)."""
    from megatron_taco.training.observability.plots import plot_learning_curves, plot_loss_curves

    if metrics_file is None or not os.path.isfile(metrics_file):
        return
    for name, plot in (("loss_curve", plot_loss_curves), ("learning_curve", plot_learning_curves)):
        try:
            png = plot(metrics_file)
        except ModuleNotFoundError as e:  # matplotlib: optional where only training runs
            what = name.replace("_", " ")
            train_logger.print(f" no {what} plot: {e} ({metrics_file} has the values)")
            return
        if png is not None:
            train_logger.print(f" {name.replace('_', ' ')}s: {png}")
            train_logger.image(name, png, iteration)


def accumulation_note(ds) -> str | None:
    """The banner's note for a run whose micro-batches' gradients DeepSpeed sums in half
    precision (ZeRO-0 bf16/fp16: it accumulates in fp32 only with ZeRO 1-3), else None."""
    if ds.zero_stage != 0 or ds.precision == "fp32" or ds.grad_accum_steps == 1:
        return None
    return (
        f"ZeRO-0 {ds.precision} sums the gradients of the {ds.grad_accum_steps} micro-batches "
        f"in {ds.precision} (DeepSpeed accumulates in fp32 only with ZeRO 1-3, e.g. "
        "ds_configs/zero1_bf16.json)"
    )


def _banner(session: _Session) -> str:
    cfg, spec, parts = session.cfg, session.spec, session.parts
    t, ds, m = cfg.training, cfg.deepspeed, cfg.model
    tp = cfg.parallel.tensor_model_parallel_size
    lines = [
        "=" * 78,
        f"megatron_taco: {parts.title or f'{spec.name} pretraining'}",
        f"  world size {cfg.world_size} = tensor parallel {tp} x data parallel "
        f"{cfg.data_parallel_size}  (accelerator: {cfg.device_type})",
        f"  DeepSpeed: {ds.source} | ZeRO stage {ds.zero_stage} | precision {ds.precision} | "
        f"TF32 {'on' if t.tf32 else 'off'}{' | deterministic' if t.deterministic else ''}",
        *(f"  note: {note}" for note in [accumulation_note(ds)] if note),
        f"  global batch {ds.global_batch_size} = micro-batch {t.micro_batch_size} x "
        f"grad accumulation {ds.grad_accum_steps} x data parallel {cfg.data_parallel_size}; "
        f"seq length {cfg.data.seq_length}",
        f"  model: {spec.name}{f' ({m.model_size})' if m.model_size else ''}, "
        f"{m.num_layers} layers, {session.parameters:,} parameters",
        *(f"  {line}" for line in parts.banner),
        f"  LayerNorm: {', '.join(session.norms) or 'none'}",
        f"  optimizer: {session.engine.optimizer_impl}; lr {t.lr:g} -> {t.min_lr:g}, "
        f"{t.describe_schedule()}; weight decay {t.weight_decay:g}; clip grad {t.clip_grad:g}",
    ]
    if parts.samples_per_epoch:
        steps = parts.samples_per_epoch // ds.global_batch_size
        whole, tail = divmod(t.train_samples(cfg.data_parallel_size), parts.samples_per_epoch)
        # --train-iters rarely ends on an epoch boundary: say how much of the last one runs.
        partial = f" ({whole} whole + {tail / parts.samples_per_epoch:.2f})" if tail else ""
        lines.append(
            f"  epochs: {whole + tail / parts.samples_per_epoch:.4g}{partial} of "
            f"{parts.samples_per_epoch:,} samples ({steps} iterations each)"
        )
    if parts.paper_flops is not None:
        per_step = parts.paper_flops(ds.global_batch_size, 1)
        lines.append(
            f"  train FLOPs (ELECTRA's convention): {per_step:.4g} per iteration, "
            f"{parts.paper_flops(ds.global_batch_size, t.train_iters):.4g} for "
            f"--train-iters {t.train_iters}"
        )
    state, plan = session.state, session.plan
    resumed = plan.note + (
        f" ({state.consumed_samples} samples consumed)" if plan.action in (RESUME, FALLBACK) else ""
    )
    lines += [f"  train iterations {t.train_iters}; {resumed}", "=" * 78]
    return "\n".join(lines)

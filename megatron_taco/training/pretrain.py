"""The pretraining driver shared by every model: flags, checks before any process group,
distributed set-up, engine, checkpoint loading, logging, the training loop and teardown.

A model plugs in through a ``ModelSpec``: its config class (presets + flags), its task
config groups (e.g. TACO's masking), cross-checks, and ``build(ctx) -> ModelParts`` (model,
collator, datasets, FLOPs, callbacks, banner lines). ``pretrain_taco.py`` and
``pretrain_sas.py`` are ``spec.main()``.

Every flag is checked (including the DeepSpeed JSON and the existence of the data,
tokenizer and JSON files) before any process group is created, so a typo fails at once on
every rank instead of after a rendezvous.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_taco.arguments import (
    ConfigError,
    add_dataclass_args,
    dataclass_from_args,
    program_name,
    set_parser_defaults,
)
from megatron_taco.data.config import DataConfig
from megatron_taco.data.samples import parse_split
from megatron_taco.parallel.config import ParallelConfig, check_world_size
from megatron_taco.training.callbacks import Callback
from megatron_taco.training.checkpointing import (
    TRACKER_FILENAME,
    CheckpointConfig,
    LoadChoice,
    RunError,
    last_complete_checkpoint,
    prepare_checkpoints,
    resumes_save,
    set_aside,
)
from megatron_taco.training.config import (
    DeepSpeedSettings,
    TrainingConfig,
    resolve_deepspeed_config,
)
from megatron_taco.training.consolidate import check_resume_layout, saved_checkpoint
from megatron_taco.training.monitor import LearningMonitorConfig
from megatron_taco.training.optim import optimizer_implementation
from megatron_taco.training.rendezvous import agree_on_load, forget_node_results, once_per_node
from megatron_taco.training.save_lock import SaveLock, save_lock
from megatron_taco.training.signals import (
    ExitConfig,
    ExitMonitor,
    PeerFailure,
    PeerWatch,
    abort_process_groups,
    describe_peer_failure,
    gather_peers,
    hook_point,
    is_peer_failure,
    launcher_rank,
)

logger = logging.getLogger("megatron_taco.pretrain")


@dataclass(frozen=True)
class PretrainConfigs:
    parallel: ParallelConfig
    model: Any  # the spec's model config (a PresetConfig dataclass)
    # DataConfig for pretraining; any config with seed, the tokenizer flags (tokenizer_type,
    # tokenizer_model, vocab_file), num_workers and seq_length for other recipes
    # (fine-tuning reads a benchmark's files instead).
    data: Any
    task: dict[str, Any]  # the spec's other config groups by name (e.g. "masking")
    training: TrainingConfig
    deepspeed: DeepSpeedSettings
    world_size: int
    device_type: str
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # The checkpoint --load restores, chosen and verified before any process group existed.
    load: LoadChoice | None = None
    exit: ExitConfig = field(default_factory=ExitConfig)
    monitor: LearningMonitorConfig = field(default_factory=LearningMonitorConfig)

    @property
    def load_iteration(self) -> int | None:
        return None if self.load is None else self.load.iteration

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.parallel.tensor_model_parallel_size

    def as_dict(self) -> dict[str, Any]:
        return {
            "parallel": dataclasses.asdict(self.parallel),
            "model": dataclasses.asdict(self.model),
            "data": dataclasses.asdict(self.data),
            **{name: dataclasses.asdict(cfg) for name, cfg in self.task.items()},
            "training": dataclasses.asdict(self.training),
            "checkpoint": dataclasses.asdict(self.checkpoint),
            "exit": dataclasses.asdict(self.exit),
            "monitor": dataclasses.asdict(self.monitor),
            "deepspeed": self.deepspeed.config,
        }


@dataclass(frozen=True)
class BuildContext:
    """What a spec's build() gets once the process groups exist."""

    configs: PretrainConfigs
    model_config: Any  # with the tokenizer's vocabulary size
    parallel: Any  # ParallelState
    rng_tracker: Any  # RNGTracker
    tokenizer: Any  # data.tokenizer.Tokenizer
    seed: int


@dataclass
class ModelParts:
    """What a spec builds for a run."""

    model: Any  # nn.Module: forward(batch) -> dict with a scalar "loss"
    collate_fn: Callable[[list], dict]
    train_dataset: Any
    valid_dataset: Any = None
    test_dataset: Any = None
    tokens_per_sample: int = 0
    train_flops: Callable[[int], float] | None = None  # hardware-honest FLOPs of n samples
    paper_flops: Callable[[int, int], float] | None = None  # (global batch, steps), ELECTRA's way
    samples_per_epoch: int | None = None
    callbacks: list[Callback] = field(default_factory=list)
    banner: list[str] = field(default_factory=list)  # model-specific start-up lines
    title: str | None = None  # the banner's first line (default "<spec name> pretraining")
    metadata: dict[str, Any] = field(default_factory=dict)  # extra metadata.json entries
    # What the weights start from when --load holds no checkpoint of this run yet (fine-tuning:
    # the pretrained encoder build() loaded); None: a fresh initialisation, which --load
    # without a checkpoint warns about.
    initialised_from: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str  # "TACO"
    prog: str  # "pretrain_taco.py"
    description: str
    model_config: type  # a PresetConfig dataclass with add_args/from_args/validate_parallel
    task_configs: tuple[tuple[str, type, str], ...]  # (name, dataclass, argparse title)
    build: Callable[[BuildContext], ModelParts]
    # Cross-checks of the configs, run before any process group exists.
    check: Callable[[PretrainConfigs], None] = lambda cfg: None
    has_epochs: bool = False  # trains real epochs over fixed instances (--train-epochs)
    # The "model" names a --load checkpoint may carry (metadata.json); default: ``name``.
    loads: tuple[str, ...] = ()
    # (flag, directory) of the stores outside the checkpoints that a run writes and its
    # checkpoints need (SAS: the replacement store): a fresh run refuses one that holds
    # another run's data, or moves it aside with --override-existing-checkpoints.
    stores: Callable[[PretrainConfigs], tuple[tuple[str, str], ...]] = lambda cfg: ()

    @property
    def loadable_models(self) -> tuple[str, ...]:
        return self.loads or (self.name,)

    def build_parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(
            prog=program_name(self.prog), description=self.description, allow_abbrev=False
        )
        add_dataclass_args(parser, ParallelConfig, "parallelism")
        self.model_config.add_args(parser)
        add_dataclass_args(parser, DataConfig, "data")
        for _name, cls, title in self.task_configs:
            add_dataclass_args(parser, cls, title)
        TrainingConfig.add_args(parser)
        add_dataclass_args(parser, CheckpointConfig, "checkpoints")
        add_dataclass_args(parser, ExitConfig, "preemption, time limits and failures")
        add_dataclass_args(parser, LearningMonitorConfig, "learning monitor")
        add_launcher_compat_args(parser)
        # --lr: the model size's (models/*/config.py DEFAULT_LR); --seq-length: the model's
        # position table (a preset's own, e.g. tiny's 64); both resolved in flag_configs.
        set_parser_defaults(
            parser,
            {"lr": None, "seq_length": None},
            {
                "lr": self.model_config.default_lr_help(),
                "seq_length": "the model's --max-position-embeddings, its preset's unless given",
            },
        )
        return parser

    def flag_configs(self, args: argparse.Namespace, *, world_size: int, device_type: str):
        """The configs of the flags, cross-checked against each other, the world size (the
        batch layout) and the DeepSpeed JSON, the only file read: (parallel, model, data,
        task, training, checkpoint, exit, monitor, deepspeed). Every documented launch command is
        checked with it (tests/unit/test_documented_commands.py)."""
        parallel = dataclass_from_args(ParallelConfig, args)
        model = self.model_config.from_args(args)
        if getattr(args, "lr", None) is None:
            args = argparse.Namespace(**{**vars(args), "lr": model.default_lr()})
        if getattr(args, "seq_length", None) is None:
            args = argparse.Namespace(**{**vars(args), "seq_length": model.max_position_embeddings})
        data = dataclass_from_args(DataConfig, args)
        task = {name: dataclass_from_args(cls, args) for name, cls, _ in self.task_configs}
        tp = parallel.tensor_model_parallel_size
        check_world_size(world_size, tp)
        training = TrainingConfig.from_args(args).resolve_length(world_size // tp)
        checkpoint = dataclass_from_args(CheckpointConfig, args)
        exit_config = dataclass_from_args(ExitConfig, args)
        monitor = dataclass_from_args(LearningMonitorConfig, args)
        model.validate_parallel(tp)
        if monitor.exit_on_collapse and (
            training.eval_iters == 0 or not parse_split(data.split)[1]
        ):
            raise ConfigError(
                "--exit-on-collapse: needs a validation to watch the encoder with (--eval-iters "
                f"{training.eval_iters}, --split {data.split}): give --eval-iters > 0 and a "
                "validation part in --split"
            )
        if data.seq_length > model.max_position_embeddings:
            raise ConfigError(
                f"--seq-length: {data.seq_length} exceeds --max-position-embeddings "
                f"{model.max_position_embeddings} (positions are 0..seq_length-1)"
            )
        if training.train_epochs is not None and not self.has_epochs:
            raise ConfigError(
                f"--train-epochs: {self.name} trains a number of iterations; give --train-iters"
            )
        deepspeed = resolve_deepspeed_config(training, world_size // tp, device_type=device_type)
        return parallel, model, data, task, training, checkpoint, exit_config, monitor, deepspeed

    def configs_from_args(
        self, args: argparse.Namespace, *, world_size: int, device_type: str
    ) -> PretrainConfigs:
        """Build and cross-check every config; reads the DeepSpeed JSON, checks that the
        data, tokenizer and JSON files exist and the datasets open, creates and test-writes
        --save, and verifies the checkpoint --load restores. No process-group work."""
        parallel, model, data, task, training, checkpoint, exit_config, monitor, deepspeed = (
            self.flag_configs(args, world_size=world_size, device_type=device_type)
        )
        tp = parallel.tensor_model_parallel_size
        data.validate_files()
        _open_datasets(data)
        # Verified once per node (it reads every byte of the checkpoint); a checkpoint of
        # another model is named before anything else about it.
        load = prepare_checkpoints(
            training,
            checkpoint,
            tp_size=tp,
            ds_config=deepspeed.config,
            zero_stage=deepspeed.zero_stage,
            models=self.loadable_models,
            once=verify_once_per_node,
        )
        configs = PretrainConfigs(
            parallel=parallel,
            model=model,
            data=data,
            task=task,
            training=training,
            deepspeed=deepspeed,
            world_size=world_size,
            device_type=device_type,
            checkpoint=checkpoint,
            load=load,
            exit=exit_config,
            monitor=monitor,
        )
        check_resume(configs, None if load is None else load.iteration)
        check_own_stores(configs, self.stores(configs))
        self.check(configs)
        return configs

    def parse_configs(self, argv: list[str] | None = None) -> PretrainConfigs:
        from megatron_taco.training.engine import accelerator_name, launcher_world_size

        args = self.build_parser().parse_args(argv)
        return self.configs_from_args(
            args, world_size=launcher_world_size(), device_type=accelerator_name()
        )

    def main(self, argv: list[str] | None = None) -> int:
        # First thing: parsing the flags and verifying the checkpoint behind --load can take
        # minutes, and a rank whose launcher dies meanwhile must not be left behind.
        monitor = ExitMonitor(program=program_name(self.prog))
        monitor.tie_to_launcher()
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        from megatron_taco.training.engine import accelerator_name, launcher_world_size

        try:
            args = self.build_parser().parse_args(argv)
            # --save is locked before any checkpoint in it (or in --load) is read: a second
            # run on it is "in use", not a verdict on files the first is writing.
            with lock_save(args, monitor) as lock:
                cfg = self.configs_from_args(
                    args, world_size=launcher_world_size(), device_type=accelerator_name()
                )
                # Errors found later (e.g. ranks disagreeing on the checkpoint) are reported
                # the same way, after pretrain() has torn the process groups down.
                return pretrain(cfg, self, monitor=monitor, lock=lock)
        except ConfigError as e:
            print(f"{program_name(self.prog)}: error: {e}", file=sys.stderr)
            return 2
        except RunError as e:  # a failed save, a diverged loss: one line, no traceback
            print(f"{program_name(self.prog)}: error: {e}", file=sys.stderr)
            return 1
        except PeerFailure as e:  # another rank died or hung: one line, no traceback
            print(f"{program_name(self.prog)}: error: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            monitor.uninstall()


def starts_fresh(cfg: PretrainConfigs) -> bool:
    """Whether the run restores no checkpoint's training state (nothing to resume)."""
    return cfg.load is None or cfg.training.finetune


def check_own_stores(cfg: PretrainConfigs, stores: tuple[tuple[str, str], ...]) -> None:
    """A fresh run would overwrite another run's store data (and un-commit what that run's
    checkpoints need): refused, as a --save holding checkpoints is (check_own_save). Not
    when --load names --save: a requeued run that died before its first checkpoint rewrites
    its own data, which no checkpoint needs."""
    own = not starts_fresh(cfg) or resumes_save(cfg.training)
    if own or cfg.checkpoint.override_existing_checkpoints:
        return
    for flag, directory in stores:
        if os.path.isdir(directory) and os.listdir(directory):
            raise ConfigError(
                f"{flag}: {directory} holds another run's data, which this run (it resumes "
                "no checkpoint) would overwrite: pass the --load of the run that wrote it to "
                "resume that run, or --override-existing-checkpoints to move it aside and "
                "start anew"
            )


def _set_aside(cfg: PretrainConfigs, spec: ModelSpec) -> None:
    """--override-existing-checkpoints, by the holder of the save lock before any save."""
    if not cfg.checkpoint.override_existing_checkpoints:
        return
    stores = tuple(d for _, d in spec.stores(cfg)) if starts_fresh(cfg) else ()
    aside = set_aside(cfg.training.save, stores)
    if aside is not None:
        logger.warning("--override-existing-checkpoints: the previous run's checkpoints and "
                       "stores were moved to %s", aside)  # fmt: skip


def lock_save(args: argparse.Namespace, monitor: ExitMonitor):
    """save_lock of the flags' --save, held by global rank 0 from before any checkpoint in
    it is read to the end of the run. A --save that does not exist yet holds none: nothing
    is created before the flags are checked, and pretrain() takes the lock then."""
    save = getattr(args, "save", None)
    if save is None or not os.path.isdir(save):
        return contextlib.nullcontext(None)
    return save_lock(save, launcher_rank(), monitor.exit_actions,
                     flock_local=bool(getattr(args, "save_lock_flock_local", False)))  # fmt: skip


def verify_once_per_node(choose: Callable[[], LoadChoice | None]) -> LoadChoice | None:
    """prepare_checkpoints' ``once``: the --load verification, by one rank per node."""
    return once_per_node("load", choose, _encode_choice, _decode_choice)


def _encode_choice(choice: LoadChoice | None):
    return None if choice is None else [choice.iteration, choice.checksum]


def _decode_choice(value) -> LoadChoice | None:
    return None if value is None else LoadChoice(*value)


def _open_datasets(data: DataConfig) -> None:
    """Open every --data-path dataset once: a truncated or corrupt .idx/.bin is one line now
    instead of a traceback after the rendezvous."""
    from megatron_taco.data.indexed_dataset import IndexedDataset, IndexedDatasetError

    for prefix in data.prefixes:
        try:
            IndexedDataset(prefix)
        except IndexedDatasetError as e:
            raise ConfigError(f"--data-path: {e}") from None


def add_launcher_compat_args(parser: argparse.ArgumentParser) -> None:
    ds = parser.add_argument_group("DeepSpeed launcher compatibility")
    # DeepSpeed's own spelling of --deepspeed-config; both fill the same field.
    ds.add_argument(
        "--deepspeed_config",
        dest="deepspeed_config",
        default=argparse.SUPPRESS,
        help="Same as --deepspeed-config.",
    )
    ds.add_argument(
        "--deepspeed",
        action="store_true",
        help="Accepted for DeepSpeed compatibility; DeepSpeed is always used.",
    )
    # The deepspeed launcher passes --local_rank; the rank is read from LOCAL_RANK instead.
    ds.add_argument(
        "--local_rank",
        "--local-rank",
        dest="local_rank",
        type=int,
        default=None,
        help=argparse.SUPPRESS,
    )


def accumulation_note(ds) -> str | None:
    """The banner's note for a run whose micro-batches' gradients DeepSpeed sums in half
    precision (ZeRO-0 bf16/fp16: it accumulates in fp32 only with ZeRO 1-3), else None."""
    if ds.zero_stage != 0 or ds.precision == "fp32" or ds.grad_accum_steps == 1:
        return None
    return (f"ZeRO-0 {ds.precision} sums the gradients of the {ds.grad_accum_steps} micro-batches "
            f"in {ds.precision} (DeepSpeed accumulates in fp32 only with ZeRO 1-3, e.g. "
            "ds_configs/zero1_bf16.json)")  # fmt: skip


def _banner(
    cfg: PretrainConfigs,
    spec: ModelSpec,
    parts: ModelParts,
    *,
    parameters: int,
    norms: list[str],
    optimizer: str,
    resumed: str,
) -> str:
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
        f"{m.num_layers} layers, {parameters:,} parameters",
        *(f"  {line}" for line in parts.banner),
        f"  LayerNorm: {', '.join(norms) or 'none'}",
        f"  optimizer: {optimizer}; lr {t.lr:g} -> {t.min_lr:g}, {t.describe_schedule()}; "
        f"weight decay {t.weight_decay:g}; clip grad {t.clip_grad:g}",
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
    lines += [f"  train iterations {t.train_iters}; {resumed}", "=" * 78]
    return "\n".join(lines)


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


def check_resume(cfg: PretrainConfigs, iteration: int | None) -> None:
    """check_resume_layout at this run's layout and Adam implementation, and
    check_resume_tokenizer, for ``iteration`` of --load: the checkpoint verified before the
    rendezvous and one --load-fallback picks after it alike."""
    check_resume_layout(cfg.training, world_size=cfg.world_size,
                        tp_size=cfg.parallel.tensor_model_parallel_size,
                        zero_stage=cfg.deepspeed.zero_stage, precision=cfg.deepspeed.precision,
                        iteration=iteration, optimizer=optimizer_implementation())  # fmt: skip
    check_resume_tokenizer(cfg, iteration)


def check_resume_tokenizer(cfg: PretrainConfigs, iteration: int | None) -> None:
    """The checkpoint --load restores (``iteration``, else the tracker's) was trained with
    the tokenizer this run reads, by content: its embedding rows are that tokenizer's ids,
    and another vocabulary of the same size would load without an error. Also with
    --finetune, which keeps the embeddings too."""
    from megatron_taco.data.tokenizer import WORDPIECE_TYPES, check_checkpoint_tokenizer

    found = None if cfg.training.load is None else saved_checkpoint(cfg.training, iteration)
    if found is None:
        return
    iter_dir, meta = found
    record = meta.get("tokenizer")
    if not isinstance(record, dict):
        return
    # the copy in the checkpoint's --save, else the file its configs name (as readers look)
    data = (meta.get("configs") or {}).get("data") or {}
    named = data.get("vocab_file" if record.get("type") in WORDPIECE_TYPES else "tokenizer_model")
    copy = record.get("file")
    copy = os.path.join(cfg.training.load, *copy.split("/")) if isinstance(copy, str) else None
    recorded = next((f for f in (copy, named) if f and os.path.isfile(f)), None)
    check_checkpoint_tokenizer(cfg.data, record, iter_dir, recorded)


def _open_wandb(cfg: PretrainConfigs, run_id: str | None):
    """Rank 0's W&B run (--wandb-project), or None."""
    t = cfg.training
    if t.wandb_project is None:
        return None
    from megatron_taco.training.tracking import WandbRun

    return WandbRun(project=t.wandb_project, name=t.wandb_exp_name, save_dir=t.resolved_wandb_dir,
                    entity=t.wandb_entity, mode=t.wandb_mode, config=cfg.as_dict(),
                    run_id=run_id)  # fmt: skip


def _keep_lr_schedule(engine, state) -> None:
    # Without the optimizer DeepSpeed restores its step counters but not the LR scheduler:
    # continue the schedule at the checkpoint's optimizer step instead of restarting it (a
    # sample-based one at the consumed samples, skipped steps' included).
    ds = engine.engine
    engine.scheduler.resume_at(ds.global_steps - ds.skipped_steps, state.consumed_samples)


def _load(engine, cfg: PretrainConfigs, spec: ModelSpec, parts: ModelParts, parallel, rng_tracker):
    from megatron_taco.training.checkpointing import TrainingState, load_fitting_checkpoint

    t = cfg.training
    fresh = f"starting from {parts.initialised_from or 'scratch'}"
    if t.load is None or cfg.load is None:
        # No tracker when the ranks verified --load: every rank starts from scratch, even
        # if one appeared since.
        if t.load is not None and parallel.rank == 0 and parts.initialised_from is None:
            logger.warning(
                "--load %s: no %s found, training from scratch", t.load, TRACKER_FILENAME
            )
        return TrainingState(), fresh

    def check_layout(iteration: int) -> None:  # of a fallback chosen now
        check_resume(cfg, iteration)

    loaded = load_fitting_checkpoint(
        engine.engine,
        t.load,
        parallel,
        rng_tracker,
        ckpt_step=cfg.load.iteration,
        fallback=cfg.checkpoint.load_fallback,
        models=spec.loadable_models,
        check=check_layout,
        load_optim=not t.no_load_optim,
        load_rng=not t.no_load_rng,
        finetune=t.finetune,
    )
    if loaded is None:
        return TrainingState(), fresh
    if t.finetune:
        return loaded, f"fine-tuning from {t.load}"
    if t.no_load_optim or engine.scheduler.units_changed:
        _keep_lr_schedule(engine, loaded)
    return loaded, (
        f"resumed from {t.load} at iteration {loaded.iteration} "
        f"({loaded.consumed_samples} samples consumed)"
    )


def pretrain(
    cfg: PretrainConfigs,
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
                cfg.training.save,
                launcher_rank(),
                monitor.exit_actions,
                flock_local=cfg.checkpoint.save_lock_flock_local,
            )  # fmt: skip
        )
        with monitor.answering_errors(), held_lock as held:
            if held is not None:
                _set_aside(cfg, spec)
            return _pretrain(cfg, spec, monitor, keep_process_group)
    finally:
        if own_monitor:
            monitor.uninstall()


def _pretrain(
    cfg: PretrainConfigs, spec: ModelSpec, monitor: ExitMonitor, keep_process_group: bool
) -> int:
    # Heavy imports after validation: --help and config errors stay fast.
    import deepspeed  # noqa: F401  (creates DeepSpeed's logger, tuned below)
    import torch

    from megatron_taco.data.tokenizer import (
        load_config_tokenizer,
        save_tokenizer_copy,
        saved_tokenizer_record,
    )
    from megatron_taco.parallel import comm
    from megatron_taco.training.engine import (
        apply_numerics,
        count_parameters,
        destroy_distributed,
        init_distributed,
        initialize_engine,
        norm_implementations,
        release_engine,
    )
    from megatron_taco.training.logging import TrainingLogger
    from megatron_taco.training.loop import PretrainTask, Trainer
    from megatron_taco.training.monitor import LearningMonitor
    from megatron_taco.training.plots import plot_learning_curves, plot_loss_curves
    from megatron_taco.training.tracking import WandbRunState, saved_run_id

    apply_numerics(cfg.training)  # before any CUDA work, the model's included
    # DeepSpeed's INFO output (config dumps, per-step notes) drowns the training log.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    t = cfg.training
    parallel = train_logger = peer_watch = engine = None
    peers = []
    try:
        hook_point("before_rendezvous", launcher_rank())
        monitor.phase = "the rendezvous"
        parallel = init_distributed(
            cfg.parallel.tensor_model_parallel_size,
            timeout=cfg.exit.distributed_timeout,
            file_timeout=cfg.exit.filesystem_timeout,
        )
        peers = gather_peers()
        if torch.distributed.get_backend() == "nccl":
            peer_watch = PeerWatch(peers, parallel.rank, abort_process_groups).start()
        forget_node_results("load")  # every rank of this node read it before the rendezvous
        agree_on_load(cfg.load, t.load)
        if parallel.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        seed = cfg.data.seed
        rng_tracker = _seed_everything(seed, parallel)
        tokenizer = load_config_tokenizer(cfg.data)
        # --save holds the tokenizer, so that its checkpoints load, export and fine-tune
        # after the original file moved
        tokenizer_meta = saved_tokenizer_record(tokenizer)
        if parallel.rank == 0 and t.save is not None:
            save_tokenizer_copy(t.save, tokenizer, tokenizer_meta)
        ctx = BuildContext(
            configs=cfg,
            model_config=cfg.model.with_vocab_size(tokenizer.vocab_size),
            parallel=parallel,
            rng_tracker=rng_tracker,
            tokenizer=tokenizer,
            seed=seed,
        )
        monitor.phase = "data and model set-up"
        hook_point("before_build", parallel.rank)
        parts = spec.build(ctx)
        if cfg.monitor.exit_on_collapse and parts.valid_dataset is None:
            raise ConfigError(
                f"--exit-on-collapse: --split {cfg.data.split} leaves no validation documents "
                "in --data-path: nothing would watch the encoder"
            )
        if t.train_iters is None:  # --train-epochs: now that an epoch's size is known
            steps = parts.samples_per_epoch // cfg.deepspeed.global_batch_size
            t = t.with_train_iters(t.train_epochs * steps)
            cfg = dataclasses.replace(cfg, training=t)
        parameters = count_parameters(parts.model, parallel)
        norms = norm_implementations(parts.model)
        engine = initialize_engine(parts.model, t, cfg.deepspeed, parallel)
        state, resumed = _load(engine, cfg, spec, parts, parallel, rng_tracker)
        wandb_run_id = saved_run_id(state.callback_states)
        tracker = _open_wandb(cfg, wandb_run_id) if parallel.rank == 0 else None
        train_logger = TrainingLogger(
            rank=parallel.rank,
            train_iters=t.train_iters,
            start_iteration=state.iteration,
            tensorboard_dir=t.tensorboard_dir,
            metrics_file=t.resolved_metrics_file,
            progress_bar=t.progress_bar,
            tracker=tracker,
        )
        train_logger.print(
            _banner(
                cfg,
                spec,
                parts,
                parameters=parameters,
                norms=norms,
                optimizer=engine.optimizer_impl,
                resumed=resumed,
            )
        )
        task = PretrainTask(
            model=parts.model,
            collate_fn=parts.collate_fn,
            train_dataset=parts.train_dataset,
            valid_dataset=parts.valid_dataset,
            test_dataset=parts.test_dataset,
            tokens_per_sample=parts.tokens_per_sample,
            train_flops=parts.train_flops,
            samples_per_epoch=parts.samples_per_epoch,
            callbacks=[
                *parts.callbacks,
                # The W&B run id travels in the checkpoints, also through runs without W&B.
                *(
                    [WandbRunState(tracker, wandb_run_id)]
                    if t.wandb_project or wandb_run_id
                    else []
                ),
            ],
        )
        trainer = Trainer(
            engine,
            parallel,
            t,
            task,
            train_logger,
            seed=seed,
            num_workers=cfg.data.num_workers,
            rng_tracker=rng_tracker,
            checkpoint_metadata={
                "model": spec.name,
                "configs": cfg.as_dict(),
                "optimizer": optimizer_implementation(),
                "tokenizer": tokenizer_meta,
                **parts.metadata,
            },
            save_retain=cfg.checkpoint.save_retain,
            exit_monitor=monitor,
            learning_monitor=LearningMonitor(
                cfg.monitor, t.warmup_iters, train_logger.print, saves=t.save is not None
            ),
        )
        # For the line of a rank that abandons a save (a sweep's runs share the monitor).
        monitor.last_complete = (
            None if t.save is None else functools.partial(last_complete_checkpoint, t.save)
        )
        trainer.train(state)
        monitor.phase = "teardown"
        metrics_file = t.resolved_metrics_file
        if parallel.rank == 0 and metrics_file is not None and os.path.isfile(metrics_file):
            for name, plot in (("loss_curve", plot_loss_curves), ("learning_curve", plot_learning_curves)):  # fmt: skip
                try:
                    png = plot(metrics_file)
                except ModuleNotFoundError as e:  # matplotlib: optional where only training runs
                    train_logger.print(f" no {name.replace('_', ' ')} plot: {e} ({metrics_file} has the values)")  # fmt: skip
                    break
                if png is not None:
                    train_logger.print(f" {name.replace('_', ' ')}s: {png}")
                    train_logger.image(name, png, state.iteration)
        train_logger.close()
        if torch.distributed.is_initialized():
            comm.barrier()
        return 0
    except Exception as error:
        if not peers or not is_peer_failure(error):
            raise
        timeout = cfg.exit.distributed_timeout_minutes
        raise PeerFailure(describe_peer_failure(error, parallel.rank, peers, timeout)) from None
    finally:
        if peer_watch is not None:
            peer_watch.stop()
        if train_logger is not None:
            train_logger.close()
        release_engine(engine)
        if keep_process_group:
            if parallel is not None:
                parallel.destroy()
        else:
            destroy_distributed(parallel)

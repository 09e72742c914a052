"""Flags -> RunConfigs, every check before any process group.

Every flag is checked (including the DeepSpeed JSON and the existence of the data,
tokenizer and JSON files), and what the run does with --load and --save is planned
(checkpoint.plan.plan_resume), before any process group is created, so a typo or a
checkpoint that cannot be resumed fails at once on every rank instead of after a rendezvous.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_taco.arguments import (
    add_dataclass_args,
    dataclass_from_args,
    program_name,
    set_parser_defaults,
)
from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.checkpoint.plan import ResumePlan, ResumeRequest, RunLayout, plan_resume
from megatron_taco.checkpoint.rendezvous import verify_once_per_node
from megatron_taco.data.config import DataConfig
from megatron_taco.data.samples import parse_split
from megatron_taco.errors import ConfigError
from megatron_taco.parallel.config import ParallelConfig, check_world_size
from megatron_taco.training.config import TrainingConfig
from megatron_taco.training.deepspeed_config import resolve_deepspeed_config
from megatron_taco.training.observability.monitor import LearningMonitorConfig
from megatron_taco.training.optim import optimizer_implementation
from megatron_taco.training.resilience.exit import ExitConfig
from megatron_taco.training.spec import ModelSpec, RunConfigs, recipe_groups


def build_parser(spec: ModelSpec) -> argparse.ArgumentParser:
    """The spec's parser: its own (fine-tuning) or pretraining's."""
    if spec.parser is not None:
        return spec.parser(spec)
    parser = argparse.ArgumentParser(
        prog=program_name(spec.prog), description=spec.description, allow_abbrev=False
    )
    add_dataclass_args(parser, ParallelConfig, "parallelism")
    spec.model_config.add_args(parser)
    add_dataclass_args(parser, DataConfig, "data")
    for _name, cls, title in recipe_groups(spec.recipe_config):
        add_dataclass_args(parser, cls, title)
    add_dataclass_args(parser, TrainingConfig, "training")
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
            "lr": spec.model_config.default_lr_help(),
            "seq_length": "the model's --max-position-embeddings, its preset's unless given",
        },
    )
    return parser


def recipe_from_args(spec: ModelSpec, args: argparse.Namespace):
    if spec.recipe_config is None:
        return None
    groups = {
        name: dataclass_from_args(cls, args) for name, cls, _ in recipe_groups(spec.recipe_config)
    }
    return spec.recipe_config(**groups)


def flag_configs(spec: ModelSpec, args: argparse.Namespace, *, world_size: int, device_type: str):
    """The configs of the flags, cross-checked against each other, the world size (the
    batch layout) and the DeepSpeed JSON, the only file read. Every documented launch
    command is checked with it (tests/unit/test_documented_commands.py)."""
    parallel = dataclass_from_args(ParallelConfig, args)
    model = spec.model_config.from_args(args)
    if getattr(args, "lr", None) is None:
        args = argparse.Namespace(**{**vars(args), "lr": model.default_lr()})
    if getattr(args, "seq_length", None) is None:
        args = argparse.Namespace(**{**vars(args), "seq_length": model.max_position_embeddings})
    data = dataclass_from_args(DataConfig, args)
    recipe = recipe_from_args(spec, args)
    tp = parallel.tensor_model_parallel_size
    check_world_size(world_size, tp)
    training = dataclass_from_args(TrainingConfig, args).resolve_length(world_size // tp)
    checkpoint = dataclass_from_args(CheckpointConfig, args)
    monitor = dataclass_from_args(LearningMonitorConfig, args)
    model.validate_parallel(tp)
    if monitor.exit_on_collapse and (training.eval_iters == 0 or not parse_split(data.split)[1]):
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
    if training.train_epochs is not None and not spec.has_epochs:
        raise ConfigError(
            f"--train-epochs: {spec.name} trains a number of iterations; give --train-iters"
        )
    return RunConfigs(
        parallel=parallel,
        model=model,
        data=data,
        recipe=recipe,
        training=training,
        checkpoint=checkpoint,
        deepspeed=resolve_deepspeed_config(training, world_size // tp, device_type=device_type),
        world_size=world_size,
        device_type=device_type,
        exit=dataclass_from_args(ExitConfig, args),
        monitor=monitor,
    )


def configs_from_args(
    spec: ModelSpec, args: argparse.Namespace, *, world_size: int, device_type: str
) -> RunConfigs:
    """Build and cross-check every config; reads the DeepSpeed JSON, checks that the
    data, tokenizer and JSON files exist and the datasets open, and plans the resume (which
    creates and test-writes --save and verifies the checkpoint --load restores). No
    process-group work."""
    if spec.configure is not None:
        return spec.configure(spec, args, world_size=world_size, device_type=device_type)
    cfg = flag_configs(spec, args, world_size=world_size, device_type=device_type)
    cfg.data.validate_files()
    _open_datasets(cfg.data)
    spec.check(cfg)
    return dataclasses.replace(cfg, plan=plan_run(cfg, spec))


def resume_request(cfg: RunConfigs, spec: ModelSpec, *, tokenizer=None) -> ResumeRequest:
    """What plan_resume needs to know of this run: its layout, the model names it loads,
    its tokenizer (``cfg.data`` unless given), its stores and the recipe's checks."""
    ds = cfg.deepspeed
    return ResumeRequest(
        checkpoint=cfg.checkpoint,
        layout=RunLayout(
            world_size=cfg.world_size,
            tp_size=cfg.parallel.tensor_model_parallel_size,
            zero_stage=ds.zero_stage,
            precision=ds.precision,
            optimizer=optimizer_implementation(),
            ds_config=ds.config,
            deepspeed_config=cfg.training.deepspeed_config,
        ),
        models=spec.loadable_models,
        tokenizer=cfg.data if tokenizer is None else tokenizer,
        checks=spec.resume_checks(cfg),
        stores=spec.stores(cfg),
    )


def plan_run(cfg: RunConfigs, spec: ModelSpec) -> ResumePlan:
    # Verified once per node (it reads every byte of the checkpoint); a checkpoint of
    # another model is named before anything else about it.
    return plan_resume(resume_request(cfg, spec), once=verify_once_per_node)


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

"""How a model (or fine-tuning) plugs into the driver: pure data.

A ``ModelSpec`` names its model config class (presets + flags), its recipe config (the
config groups only it has, e.g. TACO's masking), cross-checks, and ``build(ctx) ->
ModelParts`` (model, collator, datasets, FLOPs, callbacks, banner lines). The driver
(training/driver.py) turns flags into ``RunConfigs`` (training/configure.py), builds the
parts once the process groups exist and runs the loop; it knows no model.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.checkpoint.plan import Check, ResumePlan
from megatron_taco.parallel.config import ParallelConfig
from megatron_taco.training.callbacks import Callback
from megatron_taco.training.config import TrainingConfig
from megatron_taco.training.deepspeed_config import DeepSpeedSettings
from megatron_taco.training.observability.monitor import LearningMonitorConfig
from megatron_taco.training.resilience.exit import ExitConfig


@dataclass(frozen=True)
class RunConfigs:
    """Every config of one run, checked against each other before any process group."""

    parallel: ParallelConfig
    model: Any  # the spec's model config (a PresetConfig dataclass)
    # DataConfig for pretraining; any config with seed, the tokenizer flags (tokenizer_type,
    # tokenizer_model, vocab_file), num_workers and seq_length for other recipes
    # (fine-tuning reads a benchmark's files instead).
    data: Any
    recipe: Any  # the spec's recipe config (recipe_groups), None when it has none
    training: TrainingConfig
    checkpoint: CheckpointConfig
    deepspeed: DeepSpeedSettings
    world_size: int
    device_type: str
    exit: ExitConfig = field(default_factory=ExitConfig)
    monitor: LearningMonitorConfig = field(default_factory=LearningMonitorConfig)
    # What the run does with --load / --save, decided before any process group existed.
    plan: ResumePlan | None = None

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.parallel.tensor_model_parallel_size

    def as_dict(self) -> dict[str, Any]:
        """The configs by group, as checkpoints' metadata.json and W&B record them."""
        groups = {} if self.recipe is None else dataclasses.asdict(self.recipe)
        return {
            "parallel": dataclasses.asdict(self.parallel),
            "model": dataclasses.asdict(self.model),
            "data": dataclasses.asdict(self.data),
            **groups,
            "training": dataclasses.asdict(self.training),
            "checkpoint": dataclasses.asdict(self.checkpoint),
            "exit": dataclasses.asdict(self.exit),
            "monitor": dataclasses.asdict(self.monitor),
            "deepspeed": self.deepspeed.config,
        }


def recipe_groups(recipe_config: type | None) -> list[tuple[str, type, str]]:
    """(field, config dataclass, argparse title) of each group of a recipe config: a frozen
    dataclass whose fields are config dataclasses, each titled by its metadata's "title"."""
    if recipe_config is None:
        return []
    hints = typing.get_type_hints(recipe_config)
    return [
        (f.name, hints[f.name], f.metadata.get("title", f.name))
        for f in dataclasses.fields(recipe_config)
    ]


def group(title: str) -> Any:
    """A recipe config's field holding one config group (a frozen dataclass of flags)."""
    return field(metadata={"title": title})


@dataclass(frozen=True)
class BuildContext:
    """What a spec's build() gets once the process groups exist."""

    configs: RunConfigs
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


def _no_check(cfg: RunConfigs) -> None:
    return None


def _nothing(cfg: RunConfigs) -> tuple:
    return ()


@dataclass(frozen=True)
class ModelSpec:
    name: str  # "TACO"
    prog: str  # "pretrain_taco.py"
    description: str
    model_config: type | None  # a PresetConfig dataclass; None: taken from a checkpoint
    recipe_config: type | None  # a dataclass of config groups (recipe_groups), or None
    build: Callable[[BuildContext], ModelParts]
    # Cross-checks of the configs, run before any process group exists.
    check: Callable[[RunConfigs], None] = _no_check
    has_epochs: bool = False  # trains real epochs over fixed instances (--train-epochs)
    # The "model" names a --load checkpoint may carry (metadata.json); default: ``name``.
    loads: tuple[str, ...] = ()
    # (flag, directory) of the stores outside the checkpoints that a run writes and its
    # checkpoints need (SAS: the replacement store): a fresh run refuses one that holds
    # another run's data, or moves it aside with --override-existing-checkpoints.
    stores: Callable[[RunConfigs], tuple[tuple[str, str], ...]] = _nothing
    # The recipe's own checks of a checkpoint it would resume (SAS: the store's origin),
    # run by checkpoint.plan.plan_resume with the others.
    resume_checks: Callable[[RunConfigs], tuple[Check, ...]] = _nothing
    # Flags -> configs, when the recipe's differ from pretraining's (fine-tuning reads the
    # model from a checkpoint): (spec) -> parser, (spec, args, world size, device) -> configs.
    parser: Callable[[ModelSpec], argparse.ArgumentParser] | None = None
    configure: Callable[..., RunConfigs] | None = None
    # What main() runs once the flags are parsed, when it is not one pretraining run
    # (fine-tuning: a sweep of runs): (spec, args, monitor) -> exit code.
    run: Callable[..., int] | None = None

    @property
    def loadable_models(self) -> tuple[str, ...]:
        return self.loads or (self.name,)

"""Fine-tuning's flags and configs: the pretrained checkpoint (--load, planned as a read by
checkpoint.plan_resume), the task's data, and the run's own --output, whose checkpoints/
resume an interrupted run through the same plan as pretraining's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from dataclasses import dataclass

from megatron_taco.arguments import (
    add_dataclass_args,
    dataclass_from_args,
    option,
    program_name,
    require,
    set_parser_defaults,
)
from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.checkpoint.plan import (
    ResumeRequest,
    find_checkpoint,
    plan_resume,
    with_initialisation,
)
from megatron_taco.checkpoint.rendezvous import verify_once_per_node
from megatron_taco.data.tokenizer import (
    WORDPIECE_TYPES,
    check_tokenizer_options,
    tokenizer_file,
    tokenizer_type_option,
    vocab_file_option,
)
from megatron_taco.errors import ConfigError
from megatron_taco.parallel.config import ParallelConfig, check_world_size
from megatron_taco.recipes.finetune_output import CHECKPOINTS, claim_output, run_record
from megatron_taco.recipes.registry import checkpoint_model_config, checkpoint_tokenizer
from megatron_taco.recipes.sweep import SweepConfig
from megatron_taco.tasks import TASKS
from megatron_taco.training.config import TrainingConfig
from megatron_taco.training.configure import add_launcher_compat_args, plan_run
from megatron_taco.training.deepspeed_config import resolve_deepspeed_config
from megatron_taco.training.resilience.exit import ExitConfig
from megatron_taco.training.spec import ModelSpec, RunConfigs, group

PRETRAINED = "pretrained"  # once_per_node's name for the --load verification


@dataclass(frozen=True)
class PretrainedCheckpoint:
    """The verified checkpoint --load names (recorded in the run's metadata)."""

    load: str
    iteration: int
    model: str  # "TACO" | "SAS", from its metadata.json
    model_size: str | None = None


@dataclass(frozen=True)
class FinetuneConfig:
    load: str | None = option(
        None,
        "Pretrained checkpoint directory (a --save of pretrain_taco.py or pretrain_sas.py; any "
        "tensor-parallel size and ZeRO stage, ZeRO-3 through DeepSpeed's zero_to_fp32). The "
        "model kind and its configuration are read from its metadata.json.",
        flag="--load",
    )
    ckpt_step: int | None = option(
        None, "Iteration of --load to fine-tune (default: the latest).", flag="--ckpt-step"
    )
    output: str | None = option(
        None,
        "Directory of this run: results.json, metrics.jsonl, tensorboard/, the PNG and "
        "checkpoints/. A new directory, or the one of an interrupted run with the same "
        "settings, which then resumes.",
        flag="--output",
    )
    random_init: bool = option(
        False,
        "Build --load's architecture but keep its random initialisation instead of the "
        "pretrained weights: the baseline that shows what pretraining bought.",
        flag="--random-init",
    )
    classifier_dropout: float | None = option(
        None,
        "Dropout before the task head (default: the encoder's hidden dropout).",
        flag="--classifier-dropout",
    )
    epoch_selection: str = option(
        "best",
        "Which epoch's dev scores the run reports: the best by the task's main metric (the "
        "SAS paper's protocol for small tasks) or the last.",
        flag="--epoch-selection",
        choices=("best", "last"),
    )
    save_every_epoch: bool = option(
        True,
        "Save a checkpoint after every epoch's evaluation, so an interrupted run resumes at "
        "the last epoch boundary (besides --save-interval and exit signals).",
        flag="--save-every-epoch",
    )

    def __post_init__(self) -> None:
        cls = FinetuneConfig
        require(bool(self.load), cls, "load", "the pretrained checkpoint directory is required")
        require(bool(self.output), cls, "output", "the run's output directory is required")
        if self.classifier_dropout is not None:
            require(
                0 <= self.classifier_dropout < 1,
                cls,
                "classifier_dropout",
                f"must be in [0, 1), got {self.classifier_dropout}",
            )


@dataclass(frozen=True)
class TaskDataConfig:
    task: str = option(
        None,
        f"Downstream task: one of {', '.join(TASKS)}; several separated by commas, or glue "
        "(every GLUE task), run one after the other.",
        flag="--task",
    )
    data_dir: str = option(
        None,
        "The task's data as its benchmark distributes it (GLUE: the task's folder, e.g. "
        "glue_data/MNLI, or Hugging Face datasets splits; SQuAD: the folder with its JSON "
        "files; RACE: the folder with train/dev/test).",
        flag="--data-dir",
    )
    seq_length: int | None = option(
        None,
        "Tokens per sequence including [CLS]/[SEP] (default: 128 for GLUE, 384 for SQuAD, "
        "512 for RACE; capped at the model's position table, which an explicit value may not "
        "exceed).",
        flag="--seq-length",
    )
    doc_stride: int = option(128, "SQuAD: tokens between context windows.", flag="--doc-stride")
    max_query_length: int = option(64, "SQuAD: question tokens kept.", flag="--max-query-length")
    max_answer_length: int = option(
        30, "SQuAD: longest answer span decoded, in tokens.", flag="--max-answer-length"
    )
    n_best_size: int = option(20, "SQuAD: start/end candidates decoded.", flag="--n-best-size")
    tokenizer_model: str | None = option(
        None,
        "Sentencepiece model (default: the copy of the tokenizer in --load's checkpoint "
        "directory, or the file its metadata.json names); must be the one it was trained with.",
        flag="--tokenizer-model",
    )
    tokenizer_type: str | None = tokenizer_type_option(
        None, help="Tokenizer kind (default: the pretrained checkpoint's)"
    )
    vocab_file: str | None = vocab_file_option(
        "WordPiece vocab.txt of a BertWordPiece checkpoint (default: as --tokenizer-model's)"
    )
    pad_to_seq_length: bool = option(
        False,
        "Pad every batch to --seq-length, as before dynamic padding (default: to the batch's "
        "longest example, rounded up to a multiple of 8).",
        flag="--pad-to-seq-length",
    )
    group_by_length: bool = option(
        False,
        "Training batches of examples of similar length (runs of 50 global batches, or a "
        "quarter of the epoch's if fewer, sorted by length; the batches then shuffled), so "
        "that dynamic padding pads little.",
        flag="--group-by-length",
    )
    predict_test: bool = option(
        False,
        "GLUE: also predict the task's test split(s) with the chosen epoch's model and write "
        "the GLUE server's files to OUTPUT/submission/ (CoLA.tsv, ..., MNLI-m.tsv, "
        "MNLI-mm.tsv and AX.tsv from the diagnostic set, which MNLI's model predicts).",
        flag="--predict-test",
    )
    seed: int = option(1234, "Seed of the head's init, shuffling and dropout.", flag="--seed")
    num_workers: int = option(1, "DataLoader worker processes per rank.", flag="--num-workers")

    def __post_init__(self) -> None:
        cls = TaskDataConfig
        require(
            self.task in TASKS, cls, "task", f"unknown task {self.task!r}; one of {sorted(TASKS)}"
        )
        require(bool(self.data_dir), cls, "data_dir", "the task's data directory is required")
        if self.seq_length is not None:
            require(self.seq_length >= 8, cls, "seq_length", f"must be >= 8, got {self.seq_length}")
        for name in ("doc_stride", "max_query_length", "max_answer_length", "n_best_size"):
            require(getattr(self, name) >= 1, cls, name, f"must be >= 1, got {getattr(self, name)}")
        require(self.num_workers >= 0, cls, "num_workers", "must be >= 0")
        # the type is settled from the checkpoint when not given (configs_from_args)
        check_tokenizer_options(self, required=False)
        require(
            not (self.tokenizer_model and self.vocab_file),
            cls,
            "vocab_file",
            "give --tokenizer-model or --vocab-file, not both",
        )
        if self.predict_test:
            require(
                bool(TASKS[self.task].test_splits),
                cls,
                "predict_test",
                f"task {self.task} has no test split to submit (GLUE tasks only; SQuAD's dev "
                "predictions and v2.0 null odds are written by every run)",
            )

    @property
    def info(self):
        return TASKS[self.task]


@dataclass(frozen=True)
class FinetuneRecipe:
    """Fine-tuning's own config groups: the run's flags and the pretrained checkpoint."""

    finetune: FinetuneConfig = group("fine-tuning")
    pretrained: PretrainedCheckpoint = group("pretrained checkpoint")


def _checkpoint_tokenizer_data(data: TaskDataConfig, info) -> TaskDataConfig:
    """``data`` with the tokenizer flags resolved against the pretrained checkpoint: the file
    given (checked to be the checkpoint's) or the checkpoint's own copy, and its type."""
    flag = "--vocab-file" if data.vocab_file else "--tokenizer-model"
    path, kind = checkpoint_tokenizer(info, data.vocab_file or data.tokenizer_model, flag)
    if data.tokenizer_type not in (None, kind):
        raise ConfigError(
            f"--tokenizer-type: {data.tokenizer_type}, but {info.iter_dir} was trained with {kind}"
        )
    path = os.path.abspath(path)
    wordpiece = kind in WORDPIECE_TYPES
    return dataclasses.replace(
        data,
        tokenizer_type=kind,
        tokenizer_model=None if wordpiece else path,
        vocab_file=path if wordpiece else None,
    )


DEFAULT_SEQ_LENGTH = {"span": 384, "multiple_choice": 512}


# TrainingConfig fields this recipe sets itself (under --output) or does not use.
_OWN_TRAINING_FIELDS = (
    "train_iters",
    "train_epochs",
    "total_train_samples",
    "lr_warmup_samples",
    "lr_decay_samples",
    "tensorboard_dir",
    "metrics_file",
    "eval_iters",
    "eval_interval",
)
# CheckpointConfig fields this recipe sets itself: --save/--load are OUTPUT/checkpoints,
# and --load/--ckpt-step name the pretrained checkpoint (FinetuneConfig). --no-load-optim and
# --no-load-rng stay: the ways on that plan_resume names for resuming OUTPUT/checkpoints at
# another world size.
_OWN_CHECKPOINT_FIELDS = ("save", "load", "ckpt_step", "finetune")
# Fine-tuning defaults (the SAS paper's Table 6 where it gives one).
_DEFAULTS = {
    "train_epochs": 3,
    "micro_batch_size": 32,
    "lr": 1e-4,
    "lr_warmup_fraction": 0.1,
    "weight_decay": 0.0,
    "log_interval": 10,
}


def output_paths(output: str) -> dict[str, str]:
    return {
        "tensorboard_dir": os.path.join(output, "tensorboard"),
        "metrics_file": os.path.join(output, "metrics.jsonl"),
    }


def finetune_parser(spec: ModelSpec) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program_name(spec.prog), description=spec.description, allow_abbrev=False
    )
    add_dataclass_args(parser, FinetuneConfig, "fine-tuning")
    add_dataclass_args(parser, TaskDataConfig, "task data")
    add_dataclass_args(parser, ParallelConfig, "parallelism")
    add_dataclass_args(parser, TrainingConfig, "training", exclude=_OWN_TRAINING_FIELDS)
    parser.add_argument(
        "--epochs",
        "--train-epochs",
        dest="train_epochs",
        type=int,
        help="Passes over the training set.",
    )
    add_dataclass_args(parser, CheckpointConfig, "checkpoints", exclude=_OWN_CHECKPOINT_FIELDS)
    add_dataclass_args(parser, ExitConfig, "preemption, time limits and failures")
    add_launcher_compat_args(parser)
    add_dataclass_args(parser, SweepConfig, "protocols and sweeps")
    set_parser_defaults(parser, _DEFAULTS)
    return parser


def finetune_configs(
    spec: ModelSpec, args: argparse.Namespace, *, world_size: int, device_type: str
) -> RunConfigs:
    """The model kind and configuration come from the pretrained checkpoint, not flags."""
    ft = dataclass_from_args(FinetuneConfig, args)
    data = dataclass_from_args(TaskDataConfig, args)
    parallel = dataclass_from_args(ParallelConfig, args)
    tp = parallel.tensor_model_parallel_size
    check_world_size(world_size, tp)
    # The pretrained checkpoint, verified (it reads every byte: one rank per node).
    request = ResumeRequest(CheckpointConfig(load=ft.load, ckpt_step=ft.ckpt_step), required=True)
    source = plan_resume(request, once=functools.partial(verify_once_per_node, name=PRETRAINED))
    info = find_checkpoint(ft.load, source.iteration, verify=False)
    data = _checkpoint_tokenizer_data(data, info)
    kind, model = checkpoint_model_config(info, tokenizer_file(data))
    pretrained = PretrainedCheckpoint(
        load=os.path.abspath(ft.load),
        iteration=info.iteration,
        model=kind.name,
        model_size=model.model_size,
    )
    model.validate_parallel(tp)
    data = dataclasses.replace(data, seq_length=_seq_length(data, model))
    if not os.path.isdir(data.data_dir):
        raise ConfigError(f"--data-dir: {data.data_dir} is not a directory")
    training = dataclass_from_args(
        TrainingConfig,
        args,
        train_epochs=args.train_epochs,
        eval_iters=0,
        **output_paths(ft.output),
    )
    checkpoints = os.path.join(ft.output, CHECKPOINTS)
    checkpoint = dataclass_from_args(CheckpointConfig, args, save=checkpoints, load=checkpoints)
    if checkpoint.save_retain is None:  # only the newest is needed to resume
        checkpoint = dataclasses.replace(checkpoint, save_retain=1)
    cfg = RunConfigs(
        parallel=parallel,
        model=model,
        data=data,
        recipe=FinetuneRecipe(ft, pretrained),
        training=training,
        checkpoint=checkpoint,
        deepspeed=resolve_deepspeed_config(training, world_size // tp, device_type=device_type),
        world_size=world_size,
        device_type=device_type,
        exit=dataclass_from_args(ExitConfig, args),
    )
    # Checked before plan_resume creates OUTPUT/checkpoints in it; run.json is written by
    # for_run, once the task's files have passed too.
    claim_output(ft.output, run_record(cfg), write=False)
    plan = plan_run(cfg, spec)
    what = (
        f"a random initialisation (--random-init) of {kind.name}, the architecture"
        if ft.random_init
        else f"the pretrained {kind.name} encoder"
    )
    return dataclasses.replace(cfg, plan=with_initialisation(plan, source, f"starting from {what}"))


def _seq_length(data: TaskDataConfig, model) -> int:
    # The default is capped at the model's positions (a tiny model has 64); an explicit
    # --seq-length beyond them is an error.
    default = min(DEFAULT_SEQ_LENGTH.get(data.info.kind, 128), model.max_position_embeddings)
    seq = data.seq_length or default
    if seq > model.max_position_embeddings:
        raise ConfigError(
            f"--seq-length: {seq} exceeds the pretrained model's position table "
            f"({model.max_position_embeddings})"
        )
    return seq

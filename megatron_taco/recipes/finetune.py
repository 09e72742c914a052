"""Fine-tune a pretrained TACO or SAS checkpoint on a downstream task, on the pretraining
driver (training/pretrain.py): the same launchers, tensor/data parallelism, ZeRO stages,
checkpoints, exact resume, preemption handling and logs.

    taco-finetune --load ckpt/sas_small --task cola --data-dir glue_data/CoLA \\
        --output runs/cola --lr 1e-4 --epochs 20 --global-batch-size 32

What it adds to the driver is a recipe: the encoder of the checkpoint --load names (any
layout: its tp shards are merged and re-split for this run's tp size), a task head
(models/finetune.py), the task's features (tasks/), and the DevEvaluation callback that
scores every dev split after each epoch and writes OUTPUT/results.json. OUTPUT holds
everything of the run: results.json, metrics.jsonl, tensorboard/, the PNG, checkpoints/
(to resume an interrupted run: start the same command again).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from megatron_taco.arguments import (
    ConfigError,
    add_dataclass_args,
    dataclass_from_args,
    option,
    require,
    set_parser_defaults,
)
from megatron_taco.data.tokenizer import (
    WORDPIECE_TYPES,
    check_tokenizer_options,
    load_config_tokenizer,
    tokenizer_file,
    tokenizer_type_option,
    vocab_file_option,
)
from megatron_taco.parallel.config import ParallelConfig, check_world_size
from megatron_taco.tasks import TASKS
from megatron_taco.training.checkpointing import CheckpointConfig, prepare_checkpoints
from megatron_taco.training.config import TrainingConfig, resolve_deepspeed_config
from megatron_taco.training.pretrain import (
    BuildContext,
    ModelParts,
    ModelSpec,
    PretrainConfigs,
    add_launcher_compat_args,
    check_resume_tokenizer,
    verify_once_per_node,
)
from megatron_taco.training.signals import ExitConfig


@dataclass(frozen=True)
class PretrainedCheckpoint:
    """The verified checkpoint --load names (recorded in the run's metadata)."""

    load: str
    iteration: int
    model: str  # "TACO" | "SAS", from its metadata.json
    model_size: str | None = None


PRETRAINED = "pretrained"  # once_per_node's name for the --load verification
RUN_FILE = "run.json"  # what OUTPUT was started with: a restart must match it
CHECKPOINTS = "checkpoints"


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
        from megatron_taco.tasks import TASKS

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
        from megatron_taco.tasks import TASKS

        return TASKS[self.task]


def _checkpoint_tokenizer_data(data: TaskDataConfig, info) -> TaskDataConfig:
    """``data`` with the tokenizer flags resolved against the pretrained checkpoint: the file
    given (checked to be the checkpoint's) or the checkpoint's own copy, and its type."""
    from megatron_taco.recipes.registry import checkpoint_tokenizer

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
    "save",
    "load",
    "ckpt_step",
    "finetune",
    "no_load_optim",
    "no_load_rng",
    "tensorboard_dir",
    "metrics_file",
    "eval_iters",
    "eval_interval",
)
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
        "save": os.path.join(output, CHECKPOINTS),
        "load": os.path.join(output, CHECKPOINTS),
        "tensorboard_dir": os.path.join(output, "tensorboard"),
        "metrics_file": os.path.join(output, "metrics.jsonl"),
    }


@dataclass(frozen=True)
class FinetuneSpec(ModelSpec):
    """The fine-tuning recipe: its flags, and the model kind and configuration taken from
    the pretrained checkpoint instead of flags."""

    def build_parser(self) -> argparse.ArgumentParser:
        from megatron_taco.arguments import program_name

        parser = argparse.ArgumentParser(
            prog=program_name(self.prog), description=self.description, allow_abbrev=False
        )
        add_dataclass_args(parser, FinetuneConfig, "fine-tuning")
        add_dataclass_args(parser, TaskDataConfig, "task data")
        add_dataclass_args(parser, ParallelConfig, "parallelism")
        TrainingConfig.add_args(parser, exclude=_OWN_TRAINING_FIELDS)
        parser.add_argument(
            "--epochs",
            "--train-epochs",
            dest="train_epochs",
            type=int,
            help="Passes over the training set.",
        )
        add_dataclass_args(parser, CheckpointConfig, "checkpoints")
        add_dataclass_args(parser, ExitConfig, "preemption, time limits and failures")
        add_launcher_compat_args(parser)
        from megatron_taco.recipes.sweep import SweepConfig

        add_dataclass_args(parser, SweepConfig, "protocols and sweeps")
        set_parser_defaults(parser, _DEFAULTS)
        return parser

    def configs_from_args(
        self, args: argparse.Namespace, *, world_size: int, device_type: str
    ) -> PretrainConfigs:
        from megatron_taco.recipes.registry import checkpoint_model_config, load_error
        from megatron_taco.training.consolidate import CheckpointError, find_checkpoint
        from megatron_taco.training.rendezvous import once_per_node

        ft = dataclass_from_args(FinetuneConfig, args)
        data = dataclass_from_args(TaskDataConfig, args)
        parallel = dataclass_from_args(ParallelConfig, args)
        tp = parallel.tensor_model_parallel_size
        check_world_size(world_size, tp)

        def verify() -> int:
            # Reads every byte of the pretrained checkpoint: one rank per node does it.
            try:
                return find_checkpoint(ft.load, ft.ckpt_step).iteration
            except CheckpointError as e:
                raise load_error(e) from None

        iteration = once_per_node(PRETRAINED, verify)
        try:
            info = find_checkpoint(ft.load, iteration, verify=False)
            data = _checkpoint_tokenizer_data(data, info)
            kind, model = checkpoint_model_config(info, tokenizer_file(data))
        except CheckpointError as e:
            raise load_error(e) from None
        pretrained = PretrainedCheckpoint(
            load=os.path.abspath(ft.load),
            iteration=info.iteration,
            model=kind.name,
            model_size=model.model_size,
        )
        model.validate_parallel(tp)
        # The default is capped at the model's positions (a tiny model has 64); an explicit
        # --seq-length beyond them is an error.
        default_seq = min(
            DEFAULT_SEQ_LENGTH.get(data.info.kind, 128), model.max_position_embeddings
        )
        seq = data.seq_length or default_seq
        if seq > model.max_position_embeddings:
            raise ConfigError(
                f"--seq-length: {seq} exceeds the pretrained model's position table "
                f"({model.max_position_embeddings})"
            )
        data = dataclasses.replace(data, seq_length=seq)
        if not os.path.isdir(data.data_dir):
            raise ConfigError(f"--data-dir: {data.data_dir} is not a directory")
        training = dataclass_from_args(
            TrainingConfig,
            args,
            train_epochs=args.train_epochs,
            eval_iters=0,
            bf16=bool(getattr(args, "bf16", False)),
            fp16=bool(getattr(args, "fp16", False)),
            **output_paths(ft.output),
        )
        checkpoint = dataclass_from_args(CheckpointConfig, args)
        if checkpoint.save_retain is None:  # only the newest is needed to resume
            checkpoint = dataclasses.replace(checkpoint, save_retain=1)
        exit_config = dataclass_from_args(ExitConfig, args)
        deepspeed = resolve_deepspeed_config(training, world_size // tp, device_type=device_type)
        cfg = PretrainConfigs(
            parallel=parallel,
            model=model,
            data=data,
            task={"finetune": ft, "pretrained": pretrained},
            training=training,
            deepspeed=deepspeed,
            world_size=world_size,
            device_type=device_type,
            checkpoint=checkpoint,
            load=None,
            exit=exit_config,
        )
        # Checked before prepare_checkpoints creates OUTPUT/checkpoints in it; run.json is
        # written by for_run, once the task's files have passed too.
        claim_output(ft.output, run_record(cfg), write=False)
        load = prepare_checkpoints(
            training, checkpoint, tp_size=tp, ds_config=deepspeed.config,
            zero_stage=deepspeed.zero_stage, models=self.loadable_models,
            once=verify_once_per_node,
        )  # fmt: skip
        if load is not None:  # resuming this --output: its checkpoint's tokenizer is this one
            check_resume_tokenizer(cfg, load.iteration)
        return dataclasses.replace(cfg, load=load)

    def main(self, argv: list[str] | None = None) -> int:
        import logging
        import sys

        from megatron_taco.arguments import program_name
        from megatron_taco.recipes.sweep import run_sweep, sweep_from_args
        from megatron_taco.training.checkpointing import RunError
        from megatron_taco.training.engine import accelerator_name, launcher_world_size
        from megatron_taco.training.pretrain import pretrain
        from megatron_taco.training.signals import ExitMonitor, PeerFailure

        # First thing, as pretraining: a rank whose launcher dies is never left behind.
        monitor = ExitMonitor()
        monitor.tie_to_launcher()
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        prog = program_name(self.prog)
        try:
            args = self.build_parser().parse_args(argv)
            sweep = sweep_from_args(args)
            if sweep.is_sweep or "," in (args.task or "") or args.task == "glue":
                return run_sweep(self, args, sweep, monitor)
            cfg = self.configs_from_args(
                args, world_size=launcher_world_size(), device_type=accelerator_name()
            )
            return pretrain(cfg, self.for_run(cfg), monitor=monitor)
        except ConfigError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        except (RunError, PeerFailure) as e:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            monitor.uninstall()

    def load_features(self, cfg: PretrainConfigs):
        return load_task_data(cfg.data)

    def for_run(self, cfg: PretrainConfigs, task_data=None) -> FinetuneSpec:
        """This spec with the task's features read and checked now, before any process
        group exists (a bad file is one line, not a failure after the rendezvous); a sweep
        passes the features it already built for another run of the same task."""
        if task_data is None:
            task_data = self.load_features(cfg)
        if task_data.info.kind == "classification" and task_data.info.num_labels < 2:
            raise ConfigError(
                f"--data-dir: {cfg.data.data_dir} gives task {task_data.info.name} "
                f"{task_data.info.num_labels} label(s); classification needs at least 2"
            )
        gbs, n = cfg.deepspeed.global_batch_size, len(task_data.train)
        if n < gbs:
            raise ConfigError(
                f"--global-batch-size: {gbs} is more than the {n} training examples of "
                f"{cfg.data.data_dir}"
            )
        if cfg.data.predict_test:
            check_test_predictable(cfg.task["finetune"].output)
        # Claimed only now, once the task data has been checked too: a refused command
        # leaves --output as it found it.
        claim_output(cfg.task["finetune"].output, run_record(cfg), write=True)
        return dataclasses.replace(self, build=lambda ctx: build_finetune(ctx, task_data))


def check_test_predictable(output: str) -> None:
    """--predict-test given to a run in --output that chose an epoch without it: a resumed
    run cannot go back to that epoch's model, so unless a later epoch overtakes it the run
    would end without the test files, silently (a finished run at once). Refused, unless a
    later epoch is sure to be the chosen one (--epoch-selection last, not finished)."""
    from megatron_taco.recipes.finetune_eval import RESULTS_FILE
    from megatron_taco.recipes.sweep import read_result

    path = os.path.join(output, RESULTS_FILE)
    if not os.path.isfile(path):
        return
    results, _ = read_result(path)  # unreadable: the run rewrites it
    if not results or results.get("chosen_epoch") is None:
        return
    if results.get("selection") == "last" and not results["finished"]:
        return
    chosen, written = results["chosen_epoch"], (results.get("submission") or {}).get("epoch")
    if written != chosen:
        raise ConfigError(
            f"--predict-test: {output} chose epoch {chosen} before --predict-test was given, "
            "and a resumed run cannot go back to that epoch's model; fine-tune into a new "
            "--output with --predict-test to submit"
        )


def run_record(cfg: PretrainConfigs) -> dict[str, Any]:
    """What makes a run this run (run.json): a later command with --output resumes it only
    if it records the same."""
    ft = cfg.task["finetune"]
    return {
        "pretrained": dataclasses.asdict(cfg.task["pretrained"]),
        # Where the run lives, how many workers read its data and whether it also predicts
        # the test split do not change the run.
        "finetune": {k: v for k, v in dataclasses.asdict(ft).items() if k != "output"},
        "data": {
            k: v
            for k, v in dataclasses.asdict(cfg.data).items()
            if k not in ("num_workers", "predict_test")
        },
        "training": dataclasses.asdict(cfg.training),
        "deepspeed": {"zero_stage": cfg.deepspeed.zero_stage, "precision": cfg.deepspeed.precision},
        "tensor_model_parallel_size": cfg.parallel.tensor_model_parallel_size,
    }


def claim_output(output: str, run: dict[str, Any], *, write: bool) -> None:
    """A new --output, or the same run again (it resumes); anything else is refused. Every
    rank checks, rank 0 writes run.json: its half-written file has a hidden name, and the
    listing is taken before run.json is read, so a rank checking while rank 0 renames it
    into place sees either no run.json or the whole of it. An empty checkpoints/ is what a
    refused command may have left (the save directory is test-written before the task's
    files are read), so it does not make --output foreign."""
    tmp_prefix = f".{RUN_FILE}.tmp."
    try:
        names = [n for n in os.listdir(output) if not n.startswith(tmp_prefix)]
    except FileNotFoundError:
        names = []
    except OSError as e:
        raise ConfigError(f"--output: {output} cannot be listed ({e.strerror or e})") from None
    save = os.path.join(output, CHECKPOINTS)
    # Another rank's write test (check_save_dir) may be in there right now.
    if (
        CHECKPOINTS in names
        and os.path.isdir(save)
        and all(n.startswith(".write_test.") for n in os.listdir(save))
    ):
        names.remove(CHECKPOINTS)
    path = os.path.join(output, RUN_FILE)
    if RUN_FILE in names:
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--output: {path} is unreadable ({e})") from None
        saved, now = _by_content(saved), _by_content(json.loads(json.dumps(run)))
        if saved != now:
            diff = _first_difference(saved, now)
            raise ConfigError(
                f"--output: {output} holds a run with other settings ({diff}); give a new "
                "--output, or the same flags to resume it"
            )
        return
    if names:
        raise ConfigError(f"--output: {output} exists, is not empty and holds no {RUN_FILE}")
    if not write or int(os.environ.get("RANK", "0")) != 0:
        return  # rank 0 writes it; the others only check
    os.makedirs(output, exist_ok=True)
    tmp = os.path.join(output, f"{tmp_prefix}{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(run, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def _by_content(run: Any) -> Any:
    """A run record without its tokenizer's path: the same tokenizer at another path (the
    pretrained checkpoint's copy, or the original) resumes the run. Its content is checked
    against the pretrained checkpoint (checkpoint_tokenizer) and, once the run has saved,
    against its own checkpoint (check_resume_tokenizer)."""
    data = run.get("data") if isinstance(run, dict) else None
    if not isinstance(data, dict):
        return run
    paths = ("tokenizer_model", "vocab_file")
    return {**run, "data": {k: v for k, v in data.items() if k not in paths}}


def _first_difference(a: Any, b: Any, where: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{where}.{key}".lstrip("."))
    return f"{where}: {a!r} before, {b!r} now"


def load_task_data(data: TaskDataConfig):
    from megatron_taco.tasks import TaskDataError, load_task

    info = data.info
    test = info.test_splits if data.predict_test else ()
    try:
        return load_task(
            data.task,
            data.data_dir,
            load_config_tokenizer(data),
            seq_length=data.seq_length,
            doc_stride=data.doc_stride,
            max_query_length=data.max_query_length,
            max_answer_length=data.max_answer_length,
            n_best_size=data.n_best_size,
            splits=("train", *info.dev_splits, *test),
        )
    except TaskDataError as e:
        raise ConfigError(f"--data-dir: {e}") from None


# --group-by-length sorts the examples of each run of this many global batches by length,
# or of a quarter of the epoch's batches when that is fewer (transformers'
# get_length_grouped_indices: "50 or the number to get 4 megabatches, whichever is smaller").
LENGTH_GROUP_BATCHES = 50


class EpochShuffled:
    """The training stream of a fine-tuning run: epoch e visits ``per_epoch`` examples of
    ``base`` in its own seeded order (a permutation of ALL examples, so the remainder that
    does not fill a global batch differs from epoch to epoch).

    With ``lengths`` (--group-by-length), the epoch's examples are taken in runs of
    LENGTH_GROUP_BATCHES global batches (a quarter of the epoch's, if fewer), each run sorted
    by length (longest first) and cut into global batches, and the epoch's global batches
    are then shuffled: a batch (and each
    micro-batch in it) holds examples of similar length, so dynamic padding pads little,
    while which examples meet and in what order still changes every epoch. Like the plain
    order it is a function of (seed, epoch, position) only, so a resumed run reads what the
    uninterrupted one read."""

    def __init__(
        self,
        base,
        per_epoch: int,
        epochs: int,
        seed: int,
        *,
        lengths=None,
        global_batch_size: int | None = None,
    ) -> None:
        from megatron_taco.data.epochs import EpochPermutation

        if not 1 <= per_epoch <= len(base):
            raise ValueError(f"per_epoch {per_epoch} must be in [1, {len(base)}]")
        if lengths is not None and (not global_batch_size or per_epoch % global_batch_size):
            raise ValueError(
                f"per_epoch {per_epoch} must be a multiple of the global batch size "
                f"{global_batch_size} to group by length"
            )
        self.base, self.per_epoch, self.epochs, self.seed = base, per_epoch, epochs, seed
        self.permutation = EpochPermutation(len(base), seed)
        self.lengths, self.batch = lengths, global_batch_size
        self._order: tuple[int, Any] | None = None  # (epoch, its example order), per worker

    def __len__(self) -> int:
        return self.per_epoch * self.epochs

    def epoch_order(self, epoch: int):
        """int64 [per_epoch]: the examples of ``epoch`` in the order they are read."""
        import numpy as np

        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        order = self.permutation(epoch, np.arange(self.per_epoch))
        if self.lengths is not None:
            batches = self.per_epoch // self.batch
            group = max(1, min(LENGTH_GROUP_BATCHES, batches // 4)) * self.batch
            runs = [order[i : i + group] for i in range(0, self.per_epoch, group)]
            # Stable: examples of one length keep their shuffled order.
            order = np.concatenate(
                [r[np.argsort(-self.lengths[r], kind="stable")] for r in runs]
            ).reshape(-1, self.batch)
            shuffle = np.random.default_rng([self.seed, epoch, 0x1E6]).permutation(len(order))
            order = order[shuffle].reshape(-1)
        self._order = (epoch, order)
        return order

    def __getitem__(self, g: int) -> dict[str, Any]:
        epoch, j = divmod(int(g), self.per_epoch)
        if self.lengths is None:
            return self.base[int(self.permutation(epoch, j))]
        return self.base[int(self.epoch_order(epoch)[j])]


def load_pretrained_encoder(model, cfg: PretrainConfigs, parallel) -> str:
    """Copy the pretrained encoder's weights into ``model.encoder``; returns a banner line."""
    from megatron_taco.models.finetune import encoder_state_from_pretraining
    from megatron_taco.recipes.registry import read_checkpoint
    from megatron_taco.training.consolidate import find_checkpoint

    ref = cfg.task["pretrained"]
    # Verified before the rendezvous already.
    info = find_checkpoint(ref.load, ref.iteration, verify=False)
    # ZeRO 1-2 keep the fp32 master weights in the optimizer files: read them, so a bf16
    # run is fine-tuned from its exact weights rather than their bf16 rounding.
    masters = info.zero_stage > 0 and info.precision != "fp32"
    states, config, _ = read_checkpoint(info, tokenizer_model=tokenizer_file(cfg.data),
                                        optimizer=masters)  # fmt: skip
    full = encoder_state_from_pretraining(ref.model, states.full_state_dict())
    load_encoder_state(model, ref.model, config, full, parallel, where=info.iter_dir)
    return f"encoder: {ref.model} from {info.iter_dir}"


def load_encoder_state(model, kind: str, config, full: dict, parallel, where: str = "") -> None:
    """Full (tp-merged, unpadded) encoder tensors -> this rank's slices at this run's tp size
    (vocabulary padding re-added), copied into ``model.encoder``."""
    from megatron_taco.models.finetune import build_encoder
    from megatron_taco.training.consolidate import ModelLayout

    def build(p, vocab_size):
        c = dataclasses.replace(
            config.with_vocab_size(vocab_size), hidden_dropout=0.0, attention_dropout=0.0
        )
        return build_encoder(kind, c, p)

    part = ModelLayout(build, parallel.tp_size, config.vocab_size).split(full)[parallel.tp_rank]
    own = model.encoder.state_dict()
    missing = sorted(set(own) - set(part))
    if missing:
        raise ConfigError(f"--load: {where} holds no {missing[0]} for the encoder")
    for name, tensor in part.items():
        own[name].copy_(tensor.to(own[name].dtype))


def finetune_collate(dynamic: bool):
    """The tasks' collator, its batches carrying what TaskModel's forward needs on the host
    (whether any token is padding), so that the forward reads nothing back from the GPU."""
    from megatron_taco.models.common.host import WithHost
    from megatron_taco.models.finetune import TaskModel
    from megatron_taco.tasks.base import Collate

    return WithHost(Collate(dynamic=dynamic), TaskModel.host_layout)


def build_finetune(ctx: BuildContext, task_data) -> ModelParts:
    from megatron_taco.models.finetune import TaskModel
    from megatron_taco.recipes.finetune_eval import DevEvaluation
    from megatron_taco.tasks.base import row_lengths
    from megatron_taco.training.rendezvous import forget_node_results

    # Every rank of this node read the verification's result before the rendezvous.
    forget_node_results(PRETRAINED)
    cfg = ctx.configs
    ft, data, info = cfg.task["finetune"], cfg.data, task_data.info
    gbs = cfg.deepspeed.global_batch_size
    n = len(task_data.train)
    per_epoch = n - n % gbs
    if per_epoch == 0:
        raise ConfigError(f"--global-batch-size {gbs}: the training set has only {n} examples")
    epochs = cfg.training.train_epochs or -(-cfg.training.train_iters * gbs // per_epoch)
    model = TaskModel(
        cfg.task["pretrained"].model,
        ctx.model_config,
        ctx.parallel,
        ctx.rng_tracker,
        task_kind=info.kind,
        num_labels=info.num_labels,
        classifier_dropout=ft.classifier_dropout,
    )
    source = (
        "encoder: random initialisation (--random-init)"
        if ft.random_init
        else load_pretrained_encoder(model, cfg, ctx.parallel)
    )
    collate = finetune_collate(dynamic=not data.pad_to_seq_length)
    evaluation = DevEvaluation(
        task_data,
        output=ft.output,
        selection=ft.epoch_selection,
        save_every_epoch=ft.save_every_epoch,
        micro_batch_size=cfg.training.micro_batch_size,
        summary=_run_summary(cfg, task_data),
        collate_fn=collate,
    )
    stats = task_data.stats
    lengths = row_lengths(task_data.train) if data.group_by_length else None
    train = EpochShuffled(task_data.train, per_epoch, epochs, data.seed, lengths=lengths,
                          global_batch_size=gbs)  # fmt: skip
    rows_per_sample = info.num_labels if info.kind == "multiple_choice" else 1

    def train_flops(samples: int) -> float:
        forwards = -(-samples // cfg.training.micro_batch_size)
        return model.train_flops(samples * rows_per_sample, data.seq_length, forwards)

    return ModelParts(
        model=model,
        collate_fn=collate,
        train_dataset=train,
        # Padded positions per sample; with dynamic padding a batch has fewer, and a
        # tokens/s from --seq-length would overstate it: only samples/s is logged then.
        tokens_per_sample=0 if not data.pad_to_seq_length else data.seq_length * rows_per_sample,
        train_flops=None if not data.pad_to_seq_length else train_flops,
        samples_per_epoch=per_epoch,
        callbacks=[evaluation],
        title=f"fine-tuning {cfg.task['pretrained'].model} on {info.name}",
        banner=[
            source,
            f"task {info.name} ({info.kind}, {info.num_labels} outputs) from {data.data_dir}: "
            f"{n:,} training features ({per_epoch:,} per epoch), dev "
            + ", ".join(f"{s} {len(d):,}" for s, d in task_data.dev.items())
            + "".join(
                f"; {count:,} {split} truncated"
                for split, count in (stats.get("truncated") or {}).items()
                if count
            ),
            f"selection: {ft.epoch_selection} epoch by {info.main_metric}",
            *(
                [
                    f"test: {', '.join(f'{s} {len(d):,}' for s, d in task_data.test.items())} "
                    f"-> {ft.output}/submission/ (the chosen epoch's)"
                ]
                if task_data.test
                else []
            ),  # fmt: skip
        ],
        # The labels too: a custom task's are read from its train.tsv, which export_hf.py
        # (id2label) does not have.
        metadata={
            "task": info.name,
            "labels": list(info.labels),
            "pretrained": dataclasses.asdict(cfg.task["pretrained"]),
        },  # fmt: skip
        # OUTPUT/checkpoints is empty until the first save: not a run "from scratch".
        initialised_from="a random initialisation"
        if ft.random_init
        else f"the pretrained {cfg.task['pretrained'].model} encoder",
    )


def _run_summary(cfg: PretrainConfigs, task_data) -> dict[str, Any]:
    ft, t, data = cfg.task["finetune"], cfg.training, cfg.data
    return {
        "task": task_data.info.name,
        "pretrained": {
            **dataclasses.asdict(cfg.task["pretrained"]),
            "random_init": ft.random_init,
        },  # fmt: skip
        "hyperparameters": {
            "lr": t.lr,
            "global_batch_size": cfg.deepspeed.global_batch_size,
            "micro_batch_size": t.micro_batch_size,
            "epochs": t.train_epochs,
            "warmup_fraction": t.lr_warmup_fraction,
            "lr_decay_style": t.lr_decay_style,
            "weight_decay": t.weight_decay,
            "layerwise_lr_decay": t.layerwise_lr_decay,
            "adam_eps": t.adam_eps,
            "adam_betas": [t.adam_beta1, t.adam_beta2],
            "clip_grad": t.clip_grad,
            "seed": data.seed,
            "seq_length": data.seq_length,
            "group_by_length": data.group_by_length,
            "pad_to_seq_length": data.pad_to_seq_length,
            "classifier_dropout": ft.classifier_dropout,
            "hidden_dropout": cfg.model.hidden_dropout,
            "zero_stage": cfg.deepspeed.zero_stage,
            "precision": cfg.deepspeed.precision,
            "tensor_model_parallel_size": cfg.parallel.tensor_model_parallel_size,
            "data_parallel_size": cfg.data_parallel_size,
        },
        "data": {k: v for k, v in task_data.stats.items() if _jsonable(v)},
    }


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


SPEC = FinetuneSpec(
    name="finetune",
    prog="finetune.py",
    description="Fine-tune a pretrained TACO or SAS checkpoint on a GLUE, SQuAD or RACE task.",
    model_config=object,  # from the checkpoint, not from flags
    task_configs=(),
    build=lambda ctx: (_ for _ in ()).throw(RuntimeError("use SPEC.for_run(cfg)")),
    has_epochs=True,
)

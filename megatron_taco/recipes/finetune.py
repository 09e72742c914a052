"""Fine-tune a pretrained TACO or SAS checkpoint on a downstream task, on the pretraining
driver (training/driver.py): the same launchers, tensor/data parallelism, ZeRO stages,
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
from typing import Any

import numpy as np

from megatron_taco.arguments import dataclass_from_args
from megatron_taco.checkpoint.plan import find_checkpoint
from megatron_taco.checkpoint.rendezvous import forget_node_results
from megatron_taco.checkpoint.reshard import ModelLayout
from megatron_taco.data.epochs import EpochPermutation
from megatron_taco.data.tokenizer import load_config_tokenizer, tokenizer_file
from megatron_taco.errors import ConfigError
from megatron_taco.models.common.host import WithHost
from megatron_taco.models.finetune import TaskModel, build_encoder, encoder_state_from_pretraining
from megatron_taco.recipes.finetune_config import (
    PRETRAINED,
    TaskDataConfig,
    finetune_configs,
    finetune_parser,
)
from megatron_taco.recipes.finetune_eval import RESULTS_FILE, DevEvaluation
from megatron_taco.recipes.finetune_output import check_test_predictable, claim_output, run_record
from megatron_taco.recipes.registry import model_size_of, read_checkpoint
from megatron_taco.recipes.sweep import (
    SAS_DROPOUT,
    SweepConfig,
    check_fixed_settings,
    expand_tasks,
    plan_runs,
    run_namespace,
)
from megatron_taco.recipes.sweep_summary import read_result, write_plan, write_summary
from megatron_taco.runtime.launcher import launcher_world_size
from megatron_taco.tasks import TaskDataError, load_task
from megatron_taco.tasks.base import Collate, row_lengths
from megatron_taco.training import driver
from megatron_taco.training.configure import build_parser, configs_from_args
from megatron_taco.training.engine import accelerator_name, destroy_distributed, release_memory
from megatron_taco.training.observability.log import run_log
from megatron_taco.training.spec import BuildContext, ModelParts, ModelSpec, RunConfigs


def load_task_data(data: TaskDataConfig):
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


# Global batches that --group-by-length sorts together, or a quarter of the epoch's when that
# is fewer (transformers' get_length_grouped_indices: "50 or the number to get 4 megabatches,
# whichever is smaller").
LENGTH_GROUP_BATCHES = 50


class EpochShuffled:
    """The training stream of a fine-tuning run: epoch e visits ``per_epoch`` examples of
    ``base`` in its own seeded order (a permutation of ALL examples, so the remainder that
    does not fill a global batch differs from epoch to epoch).

    With ``lengths`` (--group-by-length), the epoch's examples are taken in runs of
    LENGTH_GROUP_BATCHES global batches (a quarter of the epoch's, if fewer), each run sorted
    by length (longest first) and cut into global batches, and the epoch's global batches
    are then shuffled: a batch (and each micro-batch in it) holds examples of similar length,
    so dynamic padding pads little, while which examples meet and in what order still changes
    every epoch. Like the plain order it is a function of (seed, epoch, position) only, so a
    resumed run reads what the uninterrupted one read."""

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


def load_pretrained_encoder(model, cfg: RunConfigs, parallel) -> str:
    """Copy the pretrained encoder's weights into ``model.encoder``; returns a banner line."""
    ref = cfg.recipe.pretrained
    # Verified before the rendezvous already.
    info = find_checkpoint(ref.load, ref.iteration, verify=False)
    # ZeRO 1-2 keep the fp32 master weights in the optimizer files: read them, so a bf16
    # run is fine-tuned from its exact weights rather than their bf16 rounding.
    masters = info.zero_stage > 0 and info.precision != "fp32"
    states, config, _ = read_checkpoint(
        info, tokenizer_model=tokenizer_file(cfg.data), optimizer=masters
    )
    full = encoder_state_from_pretraining(ref.model, states.full_state_dict())
    load_encoder_state(model, ref.model, config, full, parallel, where=info.iter_dir)
    return f"encoder: {ref.model} from {info.iter_dir}"


def load_encoder_state(model, kind: str, config, full: dict, parallel, where: str = "") -> None:
    """Full (tp-merged, unpadded) encoder tensors -> this rank's slices at this run's tp size
    (vocabulary padding re-added), copied into ``model.encoder``."""

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
    return WithHost(Collate(dynamic=dynamic), TaskModel.host_layout)


def build_finetune(ctx: BuildContext, task_data) -> ModelParts:
    # Every rank of this node read the verification's result before the rendezvous.
    forget_node_results(PRETRAINED)
    cfg = ctx.configs
    ft, data, info = cfg.recipe.finetune, cfg.data, task_data.info
    gbs = cfg.deepspeed.global_batch_size
    n = len(task_data.train)
    per_epoch = n - n % gbs
    if per_epoch == 0:
        raise ConfigError(f"--global-batch-size {gbs}: the training set has only {n} examples")
    epochs = cfg.training.train_epochs or -(-cfg.training.train_iters * gbs // per_epoch)
    model = TaskModel(
        cfg.recipe.pretrained.model,
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
    lengths = row_lengths(task_data.train) if data.group_by_length else None
    train = EpochShuffled(
        task_data.train, per_epoch, epochs, data.seed, lengths=lengths, global_batch_size=gbs
    )
    rows_per_sample = info.num_labels if info.kind == "multiple_choice" else 1

    def train_flops(samples: int) -> float:
        forwards = -(-samples // cfg.training.micro_batch_size)
        return model.train_flops(samples * rows_per_sample, data.seq_length, forwards)

    def sizes(splits: dict) -> str:
        return ", ".join(f"{s} {len(d):,}" for s, d in splits.items())

    truncated = (task_data.stats.get("truncated") or {}).items()
    test = [f"test: {sizes(task_data.test)} -> {ft.output}/submission/ (the chosen epoch's)"]
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
        title=f"fine-tuning {cfg.recipe.pretrained.model} on {info.name}",
        banner=[
            source,
            f"task {info.name} ({info.kind}, {info.num_labels} outputs) from {data.data_dir}: "
            f"{n:,} training features ({per_epoch:,} per epoch), dev {sizes(task_data.dev)}"
            + "".join(f"; {count:,} {split} truncated" for split, count in truncated if count),
            f"selection: {ft.epoch_selection} epoch by {info.main_metric}",
            *(test if task_data.test else []),
        ],
        # The labels too: a custom task's are read from its train.tsv, which export_hf.py
        # (id2label) does not have.
        metadata={
            "task": info.name,
            "labels": list(info.labels),
            "pretrained": dataclasses.asdict(cfg.recipe.pretrained),
        },
    )


def _run_summary(cfg: RunConfigs, task_data) -> dict[str, Any]:
    ft, t, data = cfg.recipe.finetune, cfg.training, cfg.data
    return {
        "task": task_data.info.name,
        "pretrained": {
            **dataclasses.asdict(cfg.recipe.pretrained),
            "random_init": ft.random_init,
        },
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


def for_run(spec: ModelSpec, cfg: RunConfigs, task_data=None) -> ModelSpec:
    """``spec`` with the task's features read and checked now, before any process group
    exists (a bad file is one line, not a failure after the rendezvous); a sweep passes the
    features it already built for another run of the same task."""
    if task_data is None:
        task_data = load_task_data(cfg.data)
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
        check_test_predictable(cfg.recipe.finetune.output)
    # Claimed only now, once the task data has been checked too: a refused command leaves
    # --output as it found it.
    claim_output(cfg.recipe.finetune.output, run_record(cfg), write=True)
    return dataclasses.replace(spec, build=lambda ctx: build_finetune(ctx, task_data))


def run_finetuning(spec: ModelSpec, args, monitor) -> int:
    """taco-finetune after its flags are parsed: one run, or a protocol's sweep of runs."""
    sweep = dataclass_from_args(SweepConfig, args)
    if sweep.is_sweep or "," in (args.task or "") or args.task == "glue":
        return run_sweep(spec, args, sweep, monitor)
    cfg = configs_from_args(
        spec, args, world_size=launcher_world_size(), device_type=driver.accelerator_name()
    )
    return driver.run(cfg, for_run(spec, cfg), monitor=monitor)


def run_sweep(spec, args: argparse.Namespace, sweep: SweepConfig, monitor=None) -> int:
    """Every run of this shard that has not finished, in one set of processes (one process
    group for all of them), then the summary. Stops at the first run that is interrupted
    (an exit signal, a time limit): starting the command again continues from it."""
    root = args.output
    if not root:
        raise ConfigError("--output: the sweep's directory is required")
    tasks = expand_tasks(args.task or "")
    runs = plan_runs(sweep, tasks, args, model_size_of(args.load, args.ckpt_step))
    fixed = check_fixed_settings(sweep.protocol, runs, args, build_parser(spec))
    mine = runs[sweep.sweep_shard :: sweep.sweep_shards]
    world, device = launcher_world_size(), accelerator_name()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        write_plan(root, sweep.protocol, runs)
        if fixed:
            run_log().info(fixed)
    features: dict[tuple, Any] = {}  # one tokenisation per task for all its runs
    status, dropout_checked = 0, sweep.protocol != "sas"
    try:
        for i, run in enumerate(mine):
            if _finished(run.directory(root)):
                if getattr(args, "predict_test", False) and rank0:
                    _warn_unsubmitted(run.directory(root))
                continue
            dp = world // args.tensor_model_parallel_size
            cfg = configs_from_args(
                spec, run_namespace(args, run, root, dp), world_size=world, device_type=device
            )
            if not dropout_checked and rank0:
                _warn_encoder_dropout(cfg.model)
                dropout_checked = True
            key = (cfg.data.task, cfg.data.data_dir, cfg.data.seq_length, tokenizer_file(cfg.data))
            if key not in features:
                features = {key: load_task_data(cfg.data)}  # keep one task's at a time
            if rank0:
                run_log().info(f"sweep: run {i + 1}/{len(mine)}: {run.directory(root)}")
            status = driver.run(
                cfg, for_run(spec, cfg, features[key]), monitor=monitor, keep_process_group=True
            )
            release_memory()  # the run's engine, model and optimizer, before the next
            if status != 0 or not _finished(run.directory(root)):
                run_log().info(f"sweep: stopped at {run.directory(root)} (not finished)")
                break
    finally:
        destroy_distributed(None)
    if rank0:
        run_log().info(write_summary(root, sweep.protocol))
    return status


def _finished(directory: str) -> bool:
    """Whether a run's results.json says finished; an unreadable one stops the sweep (it
    would otherwise rerun, or skip, a run whose state nobody knows)."""
    path = os.path.join(directory, RESULTS_FILE)
    if not os.path.isfile(path):
        return False
    result, problem = read_result(path)
    if result is None:
        raise ConfigError(f"{problem}; fix or remove it to run {directory} again")
    return bool(result["finished"])


def _warn_unsubmitted(directory: str) -> None:
    """A finished run is not run again: one that finished without --predict-test has no
    test files for OUTPUT/submission/, and the sweep says so rather than submit less."""
    result, _ = read_result(os.path.join(directory, RESULTS_FILE))
    if result is not None and not result.get("submission"):
        run_log().warning(
            f"sweep: warning: --predict-test: {directory} finished without it, so its test "
            "files are not submitted (remove the directory to run it again)",
        )


def _warn_encoder_dropout(model) -> None:
    dropouts = (getattr(model, "hidden_dropout", None), getattr(model, "attention_dropout", None))
    if any(d is not None and d != SAS_DROPOUT for d in dropouts):
        run_log().warning(
            f"sweep: warning: --protocol sas: the encoder keeps its checkpoint's dropout "
            f"(hidden {dropouts[0]}, attention {dropouts[1]}), not Table 6's {SAS_DROPOUT} "
            "(fine-tuning has no flag for it; the head's dropout is 0.1)",
        )


def _unbound_build(ctx: BuildContext) -> ModelParts:
    raise RuntimeError("fine-tuning builds through for_run(spec, cfg), which reads the task")


SPEC = ModelSpec(
    name="finetune",
    prog="finetune.py",
    description="Fine-tune a pretrained TACO or SAS checkpoint on a GLUE, SQuAD or RACE task.",
    model_config=None,  # from the checkpoint, not from flags
    recipe_config=None,
    build=_unbound_build,
    has_epochs=True,
    parser=finetune_parser,
    configure=finetune_configs,
    run=run_finetuning,
)

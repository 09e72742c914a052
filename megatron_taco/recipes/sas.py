"""Pretrain SAS (MLM + lambda * RTD, one encoder) on DeepSpeed (taco-pretrain-sas, pretrain_sas.py).

    deepspeed --num_gpus 8 pretrain_sas.py --model-size small \\
        --data-path data/wiki_text_sentence --tokenizer-model tok.model --seq-length 128 \\
        --micro-batch-size 64 --global-batch-size 512 --train-iters 250000 --lr 1e-3 \\
        --lr-warmup-iters 10000 --deepspeed-config ds_configs/zero1_bf16.json \\
        --save ckpt --load ckpt --save-interval 5000 --tensorboard-dir tb

SAS^c: ``--rtd-weight-final 50`` (constant lambda). SAS^DA: ``--disentangled-attention``.
Training runs in real epochs over a fixed set of instances (data/epochs.py); lambda steps
once per epoch and reaches its final value at the last whole epoch (a partial last epoch
from --train-iters keeps it). The run itself is the generic driver (training/driver.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from megatron_taco.arguments import option, require
from megatron_taco.data.bert_dataset import (
    build_train_valid_test_datasets,
    train_samples_per_dataset,
)
from megatron_taco.data.blending import dataset_passes
from megatron_taco.data.epochs import InstanceEpochDataset
from megatron_taco.data.replacement_store import StoreLayout
from megatron_taco.data.sas_collator import (
    ReplacementConfig,
    SasCollator,
    cold_start_probs,
    make_cold_start,
)
from megatron_taco.errors import ConfigError
from megatron_taco.models.common.host import WithHost
from megatron_taco.models.flops import sas_encoder_shape, sas_train_flops, sas_train_flops_executed
from megatron_taco.models.sas.config import SasConfig
from megatron_taco.models.sas.model import SasForPretraining
from megatron_taco.parallel import comm
from megatron_taco.recipes.sas_augmentation import (
    SelfAugmentation,
    SelfAugmentationConfig,
    StoreSource,
    check_store_origin,
    store_origin,
)
from megatron_taco.training.callbacks import Callback
from megatron_taco.training.spec import BuildContext, ModelParts, ModelSpec, RunConfigs, group

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RtdScheduleConfig:
    rtd_weight: float = option(
        50.0, "RTD loss weight lambda in the first epoch (paper: 50).", flag="--rtd-weight"
    )
    rtd_weight_final: float = option(
        200.0,
        "Lambda in the last whole epoch (and a partial epoch after it), linear per epoch in "
        "between (paper's SAS: 200; SAS^c: set it equal to --rtd-weight for a constant lambda).",
        flag="--rtd-weight-final",
    )
    rtd_weight_warmup_iters: int = option(
        0,
        "A departure from the paper, off by default (ELECTRA's authors' advice for a "
        "discriminator that learns nothing): lambda 0 for the run's first N iterations, the "
        "per-epoch schedule after.",
        flag="--rtd-weight-warmup-iters",
    )

    def __post_init__(self) -> None:
        for name in ("rtd_weight", "rtd_weight_final"):
            value = getattr(self, name)
            require(value >= 0, type(self), name, f"must be >= 0, got {value}")
        warmup = self.rtd_weight_warmup_iters
        require(
            isinstance(warmup, int) and warmup >= 0,
            type(self),
            "rtd_weight_warmup_iters",
            f"must be an integer >= 0, got {warmup!r}",
        )

    def weight(self, epoch: int, whole_epochs: int) -> float:
        """lambda of 0-based ``epoch`` in a run of ``whole_epochs`` whole epochs (and maybe a
        part of one more): 50, 87.5, 125, 162.5, 200 over 5 epochs by default, the final
        value held after the last whole epoch; one whole epoch (or none) keeps the first."""
        if whole_epochs <= 1:
            return float(self.rtd_weight)
        step = (self.rtd_weight_final - self.rtd_weight) / (whole_epochs - 1)
        return self.rtd_weight + step * min(epoch, whole_epochs - 1)

    def describe(self, epochs: Fraction) -> str:
        """The per-epoch values of a run of ``epochs`` (maybe fractional) epochs, for the
        banner."""
        whole, count = math.floor(epochs), max(math.ceil(epochs), 1)
        values = [f"{self.weight(e, whole):g}" for e in range(count)]
        if count > 8:
            values = [*values[:3], "...", *values[-2:]]
        tail = epochs - whole
        note = f" (epoch {count} is {float(tail):.2f} of an epoch)" if tail > 0 else ""
        if self.rtd_weight_warmup_iters:
            note += f"; 0 for the first {self.rtd_weight_warmup_iters} iterations"
        return f"lambda per epoch {', '.join(values)}{note}"


class RtdWeightSchedule(Callback):
    """Sets the model's lambda at the start of every epoch (also of a resumed one) and says
    so in the log."""

    name = "rtd_weight_schedule"

    def __init__(self, model, config: RtdScheduleConfig, whole_epochs: int) -> None:
        self.model, self.config, self.whole_epochs = model, config, whole_epochs
        self.epoch_weight = config.rtd_weight

    def on_epoch_start(self, trainer, state, epoch: int) -> None:
        self.epoch_weight = self.config.weight(epoch, self.whole_epochs)
        self.model.set_rtd_weight(self.epoch_weight)
        warm = self.config.rtd_weight_warmup_iters
        note = f" (0 until iteration {warm})" if state.iteration < warm else ""
        trainer.logger.print(
            f" epoch {epoch + 1}/{trainer.num_epochs()}: lambda {self.epoch_weight:g}{note}"
        )

    def on_step_start(self, trainer, state) -> None:
        # The warm-up is a function of the iteration alone, so a resume needs no state.
        warming = state.iteration < self.config.rtd_weight_warmup_iters
        self.model.set_rtd_weight(0.0 if warming else self.epoch_weight)


COLD_START_NOTES = {
    "mask": " (the reference release: [MASK] at S in epoch 1)",
    "mlm": " (the reference release: BERT's 80/10/10 masked LM at S in epoch 1, no RTD loss)",
}


@dataclasses.dataclass(frozen=True)
class SasRecipe:
    """SAS's own config groups: the replaced tokens, lambda's schedule, self-augmentation."""

    replacement: ReplacementConfig = group("replaced tokens")
    rtd_schedule: RtdScheduleConfig = group("RTD loss weight")
    self_augmentation: SelfAugmentationConfig = group("self-augmentation")


def check_sas(cfg: RunConfigs) -> None:
    """Before any process group: the cold-start files exist, the store has a home."""
    augmentation = cfg.recipe.self_augmentation
    if augmentation.self_augmentation and augmentation.store_dir(cfg.checkpoint.save) is None:
        raise ConfigError(
            "--replacement-store: self-augmentation keeps the sampled tokens on disk between "
            "epochs; give --save (the store goes under it) or --replacement-store DIR, or "
            "--no-self-augmentation"
        )
    store, save = augmentation.replacement_store, cfg.checkpoint.save
    if store is not None and save is not None:
        root = os.path.realpath(store)
        if os.path.realpath(save) == root or os.path.realpath(save).startswith(root + os.sep):
            # --override-existing-checkpoints would move the whole --save aside with it.
            raise ConfigError(
                f"--replacement-store: {store} is or holds --save {save}: give the store a "
                "directory of its own (default: replacement_store under --save)"
            )
    replacement = cfg.recipe.replacement
    if not augmentation.self_augmentation:
        # Both would be read in every epoch or never: refuse rather than train something else.
        if replacement.cold_start in COLD_START_NOTES:
            raise ConfigError(
                f"--cold-start {replacement.cold_start}: [MASK] at S is for the first epoch "
                "only; with --no-self-augmentation every epoch would read it (mlm: BERT with "
                "no RTD loss; mask: a trivial RTD task); use unigram or uniform, or drop "
                "--no-self-augmentation"
            )
        if replacement.stored_mask_share:
            raise ConfigError(
                "--stored-mask-share: applies to the epochs that read the self-augmentation "
                "store, and --no-self-augmentation reads none"
            )
    warmup, iters = cfg.recipe.rtd_schedule.rtd_weight_warmup_iters, cfg.training.train_iters
    if warmup and iters is not None and warmup >= iters:
        raise ConfigError(
            f"--rtd-weight-warmup-iters: {warmup} >= --train-iters {iters}: lambda would be 0 "
            "for the whole run (no RTD loss)"
        )
    if replacement.cold_start == "unigram":
        from megatron_taco.data.indexed_dataset import unigram_path

        missing = [
            unigram_path(p) for p in cfg.data.prefixes if not os.path.isfile(unigram_path(p))
        ]
        if missing:
            raise ConfigError(
                f"--cold-start unigram: {missing[0]} does not exist (tools/preprocess_data.py "
                "writes it beside each dataset; or use --cold-start uniform)"
            )


class DatasetPasses(NamedTuple):
    """How much of one --data-path dataset an epoch sees."""

    prefix: str
    weight: float
    instances: int  # of the epoch's
    per_pass: int  # samples in one pass over its train split
    passes: float  # instances / per_pass


@dataclasses.dataclass(frozen=True)
class Instances:
    train: Any  # InstanceEpochDataset: the training stream over the fixed instances
    valid: Any
    test: Any
    count: int  # instances per epoch (N)
    epochs: Fraction  # the run's length in epochs: fractional with --train-iters
    passes: list[DatasetPasses]


def build_instances(ctx: BuildContext) -> Instances:
    cfg = ctx.configs
    t = cfg.training
    return make_instances(
        cfg.data,
        ctx.tokenizer,
        cfg.deepspeed.global_batch_size,
        t.eval_samples(ctx.parallel.dp_size),
        train_epochs=t.train_epochs,
        train_samples=None if t.train_epochs is not None else t.train_samples(ctx.parallel.dp_size),
        barrier=comm.barrier,
    )


def make_instances(
    data,
    tokenizer,
    global_batch_size: int,
    eval_samples: int,
    *,
    train_epochs: int | None = None,
    train_samples: int | None = None,
    barrier=None,
) -> Instances:
    """The fixed instances of a SAS run and its train/valid/test streams (one of
    ``train_epochs``, ``train_samples`` gives its length; ``barrier``: the data cache's, see
    data/cache.py)."""
    gbs = global_batch_size
    per_dataset = train_samples_per_dataset(data, barrier)
    per_pass = sum(per_dataset)
    # Whole global batches per epoch, so that no batch straddles two epochs (epoch t+1 reads
    # what epoch t wrote); the few instances cut are the same ones in every epoch.
    instances = per_pass - per_pass % gbs
    if instances == 0:
        raise ConfigError(
            f"--global-batch-size {gbs}: the train split has only {per_pass} samples per pass, "
            "fewer than one global batch"
        )
    train, valid, test = build_train_valid_test_datasets(
        data, tokenizer, (per_pass, eval_samples, eval_samples), barrier
    )
    if train_epochs is not None:
        epochs = Fraction(train_epochs)
    else:
        epochs = Fraction(train_samples, instances)
    # An epoch is the first N samples of the blend: each dataset in proportion to its weight,
    # its own samples in order (whole passes first).
    shares = dataset_passes(getattr(train, "dataset_index", None), instances, per_dataset)
    passes = [
        DatasetPasses(prefix, weight, used, n, share)
        for prefix, weight, n, (used, share) in zip(
            data.prefixes, data.weights, per_dataset, shares
        )
    ]
    stream = InstanceEpochDataset(train, instances, max(math.ceil(epochs), 1), data.seed)
    return Instances(stream, valid, test, instances, epochs, passes)


def describe_passes(passes: list[DatasetPasses]) -> tuple[list[str], list[str]]:
    """Banner lines and warnings on how much of each --data-path dataset an epoch sees."""
    if len(passes) < 2:
        return [], []
    lines = [
        f"per epoch: {prefix} (weight {weight:.3g}): {used:,} instances, {share:.2f} passes over "
        f"its {n:,} samples"
        for prefix, weight, used, n, share in passes
    ]
    total = sum(p.per_pass for p in passes)
    proportional = " ".join(f"{n / total:.3g} {prefix}" for prefix, _, _, n, _ in passes)
    warnings = [
        f"--data-path: {prefix} is seen {share:.2f} times per epoch (weight {weight:.3g} gives "
        f"it {used:,} of the epoch's instances, it has {n:,} samples): {1 - share:.0%} of it "
        f"is never trained on, in any epoch (instances are fixed); weights proportional to "
        f"the sizes ('--data-path {proportional}') see every dataset once per epoch"
        for prefix, weight, used, n, share in passes
        if share < 1
    ]
    return lines, warnings


def build_sas(ctx: BuildContext) -> ModelParts:
    cfg, model_config = ctx.configs, ctx.model_config
    data, replacement = cfg.data, cfg.recipe.replacement
    instances = build_instances(ctx)
    probs = cold_start_probs(
        replacement, data.prefixes, data.weights, ctx.tokenizer.is_special_mask()
    )
    augmentation = cfg.recipe.self_augmentation
    warmup_samples = replacement.cold_start_warmup_iters * cfg.deepspeed.global_batch_size
    cold = make_cold_start(
        replacement,
        probs,
        ctx.seed,
        mask_id=ctx.tokenizer.mask_id,
        warmup_samples=warmup_samples,
    )
    callbacks: list[Callback] = []
    source = cold
    if augmentation.self_augmentation:
        root = augmentation.store_dir(cfg.checkpoint.save)
        source = StoreSource(cold, root)
        layout = StoreLayout(
            num_instances=instances.count,
            width=replacement.width(data.seq_length),
            vocab_size=ctx.tokenizer.vocab_size,
            num_shards=augmentation.replacement_store_shards,
            origin=store_origin(data, replacement, augmentation),
        )
        callbacks.append(
            SelfAugmentation(
                augmentation,
                root=root,
                layout=layout,
                seed=ctx.seed,
                special_ids=np.flatnonzero(ctx.tokenizer.is_special_mask()),
                vocab_size=ctx.tokenizer.vocab_size,
            )
        )
    collator = SasCollator(
        pad_id=ctx.tokenizer.pad_id,
        seq_length=data.seq_length,
        seed=ctx.seed,
        config=replacement,
        source=source,
        # S must stay put only when epoch t+1 reads what epoch t sampled at S.
        fixed_positions=augmentation.self_augmentation,
        drop_hits=augmentation.drop_replacement_hits,
        mask_id=ctx.tokenizer.mask_id,
    )
    model = SasForPretraining(model_config, ctx.parallel, ctx.rng_tracker)
    shape = sas_encoder_shape(model_config, data.seq_length)
    da = model_config.disentangled_attention

    def paper_flops(global_batch: int, steps: int) -> float:
        return sas_train_flops(shape, global_batch, steps, disentangled_attention=da)

    # What runs: the MLM head on the replaced positions (the collator's share of a full row's
    # real tokens), the decoder over the padded vocabulary, lookups as gathers.
    padded_vocab = model.sas.embeddings.word_embeddings.weight.shape[0] * ctx.parallel.tp_size
    executed = dataclasses.replace(shape, vocab_size=padded_vocab)
    relative_rows = model.sas.relative_rows_used(data.seq_length)
    labelled = replacement.mask_prob * (data.seq_length - 2)

    def train_flops(samples: int) -> float:
        return sas_train_flops_executed(
            executed,
            samples,
            labelled * samples,
            relative_rows=relative_rows,
            forwards=-(-samples // cfg.training.micro_batch_size),
        )

    variant = "SAS^DA" if da else "SAS"
    schedule = cfg.recipe.rtd_schedule
    data_lines, data_warnings = describe_passes(instances.passes)
    if ctx.parallel.rank == 0:
        for warning in data_warnings:
            logger.warning(warning)
    warmup = (
        f"; the first {replacement.cold_start_warmup_iters} iterations from "
        f"{replacement.cold_start}^{replacement.cold_start_warmup_power:g}"
        if warmup_samples
        else ""
    )
    if augmentation.self_augmentation:
        source_line = (
            f"self-augmentation from epoch 2 (T={augmentation.sampling_temperature:g}, "
            f"store {augmentation.store_dir(cfg.checkpoint.save)}"
            + ("; hits dropped from S" if augmentation.drop_replacement_hits else "")
            + ")"
        )
    else:
        source_line = "no self-augmentation (cold start in every epoch, S redrawn per epoch)"
    return ModelParts(
        model=model,
        collate_fn=WithHost(collator, SasForPretraining.host_layout),
        train_dataset=instances.train,
        valid_dataset=instances.valid,
        test_dataset=instances.test,
        tokens_per_sample=data.seq_length,
        train_flops=train_flops,
        paper_flops=paper_flops,
        samples_per_epoch=instances.count,
        callbacks=[RtdWeightSchedule(model, schedule, math.floor(instances.epochs)), *callbacks],
        banner=[
            f"variant: {variant}; hidden {model_config.hidden_size}, FFN "
            f"{model_config.ffn_hidden_size}, {model_config.num_attention_heads} heads, "
            f"embedding {model_config.embedding_size}; LayerNorm eps "
            f"{model_config.norm_epsilon:g}; output-layer init {model_config.output_layer_init}",
            f"replacements: {replacement.mask_prob:g} of each instance's tokens; cold start "
            f"{replacement.cold_start}{COLD_START_NOTES.get(replacement.cold_start, '')}"
            f"{warmup}; {source_line}",
            schedule.describe(instances.epochs),
            *data_lines,
        ],
    )


def sas_resume_checks(cfg: RunConfigs) -> tuple:
    """plan_resume's check of a checkpoint SAS would resume: every generation of the store
    was written with this run's origin (data, tokenizer, replacement flags)."""
    augmentation = cfg.recipe.self_augmentation
    if not augmentation.self_augmentation or cfg.checkpoint.finetune:
        return ()
    origin = store_origin(cfg.data, cfg.recipe.replacement, augmentation)
    root = augmentation.store_dir(cfg.checkpoint.save)
    return (lambda candidate: check_store_origin(root, origin),)


def sas_stores(cfg: RunConfigs) -> tuple[tuple[str, str], ...]:
    augmentation = cfg.recipe.self_augmentation
    root = augmentation.store_dir(cfg.checkpoint.save) if augmentation.self_augmentation else None
    return () if root is None else (("--replacement-store", root),)


SPEC = ModelSpec(
    name="SAS",
    prog="pretrain_sas.py",
    description="Pretrain SAS (MLM + lambda * RTD on one encoder) on DeepSpeed.",
    model_config=SasConfig,
    recipe_config=SasRecipe,
    build=build_sas,
    check=check_sas,
    has_epochs=True,
    stores=sas_stores,
    resume_checks=sas_resume_checks,
)

"""Pretrain SAS (MLM + lambda * RTD, one encoder) on DeepSpeed (taco-pretrain-sas, pretrain_sas.py).

    deepspeed --num_gpus 8 pretrain_sas.py --model-size small \\
        --data-path data/wiki_text_sentence --tokenizer-model tok.model --seq-length 128 \\
        --micro-batch-size 64 --global-batch-size 512 --train-iters 250000 --lr 1e-3 \\
        --lr-warmup-iters 10000 --deepspeed-config ds_configs/zero1_bf16.json \\
        --save ckpt --load ckpt --save-interval 5000 --tensorboard-dir tb

SAS^c: ``--rtd-weight-final 50`` (constant lambda). SAS^DA: ``--disentangled-attention``.
Training runs in real epochs over a fixed set of instances (data/epochs.py); lambda steps
once per epoch. The run itself is the generic driver (training/pretrain.py).
"""

from __future__ import annotations

import dataclasses
import os

from megatron_taco.arguments import ConfigError, option, require
from megatron_taco.data.sas_collator import ReplacementConfig
from megatron_taco.models.sas.config import SasConfig
from megatron_taco.recipes.sas_augmentation import SelfAugmentationConfig
from megatron_taco.training.callbacks import Callback
from megatron_taco.training.pretrain import BuildContext, ModelParts, ModelSpec, PretrainConfigs


@dataclasses.dataclass(frozen=True)
class RtdScheduleConfig:
    rtd_weight: float = option(
        50.0, "RTD loss weight lambda in the first epoch (paper: 50).", flag="--rtd-weight"
    )
    rtd_weight_final: float = option(
        200.0,
        "Lambda in the last epoch, linear per epoch in between (paper's SAS: 200; SAS^c: set it "
        "equal to --rtd-weight for a constant lambda).",
        flag="--rtd-weight-final",
    )

    def __post_init__(self) -> None:
        for name in ("rtd_weight", "rtd_weight_final"):
            value = getattr(self, name)
            require(value >= 0, type(self), name, f"must be >= 0, got {value}")

    def weight(self, epoch: int, num_epochs: int) -> float:
        """lambda of 0-based ``epoch``: 50, 87.5, 125, 162.5, 200 over 5 epochs by default."""
        if num_epochs <= 1:
            return float(self.rtd_weight)
        step = (self.rtd_weight_final - self.rtd_weight) / (num_epochs - 1)
        return self.rtd_weight + step * epoch


class RtdWeightSchedule(Callback):
    """Sets the model's lambda at the start of every epoch (also of a resumed one)."""

    name = "rtd_weight_schedule"

    def __init__(self, model, config: RtdScheduleConfig) -> None:
        self.model, self.config = model, config

    def on_epoch_start(self, trainer, state, epoch: int) -> None:
        self.model.set_rtd_weight(self.config.weight(epoch, trainer.num_epochs()))


def check_sas(cfg: PretrainConfigs) -> None:
    """Before any process group: the cold-start files exist, the store has a home."""
    augmentation = cfg.task["self_augmentation"]
    if augmentation.self_augmentation and augmentation.store_dir(cfg.training.save) is None:
        raise ConfigError(
            "--replacement-store: self-augmentation keeps the sampled tokens on disk between "
            "epochs; give --save (the store goes under it) or --replacement-store DIR, or "
            "--no-self-augmentation"
        )
    if cfg.task["replacement"].cold_start == "unigram":
        from megatron_taco.data.indexed_dataset import unigram_path

        missing = [
            unigram_path(p) for p in cfg.data.prefixes if not os.path.isfile(unigram_path(p))
        ]
        if missing:
            raise ConfigError(
                f"--cold-start unigram: {missing[0]} does not exist (tools/preprocess_data.py "
                "writes it beside each dataset; or use --cold-start uniform)"
            )


def sas_shape(config: SasConfig, seq_length: int):
    from megatron_taco.models.flops import EncoderShape

    return EncoderShape(
        layers=config.num_layers,
        hidden=config.hidden_size,
        ffn=config.ffn_hidden_size,
        heads=config.num_attention_heads,
        head_size=config.hidden_size // config.num_attention_heads,
        embedding_size=config.embedding_size,
        vocab_size=config.vocab_size,
        seq_length=seq_length,
    )


def build_instances(ctx: BuildContext):
    """(train stream over fixed instances, valid, test, instances per epoch)."""
    from megatron_taco.data.bert_dataset import (
        build_train_valid_test_datasets,
        train_samples_per_pass,
    )
    from megatron_taco.data.epochs import InstanceEpochDataset

    cfg = ctx.configs
    data, t, gbs = cfg.data, cfg.training, cfg.deepspeed.global_batch_size
    per_pass = train_samples_per_pass(data)
    # Whole global batches per epoch, so that no batch straddles two epochs (epoch t+1 reads
    # what epoch t wrote); the few instances cut are the same ones in every epoch.
    instances = per_pass - per_pass % gbs
    if instances == 0:
        raise ConfigError(
            f"--global-batch-size {gbs}: the train split has only {per_pass} samples per pass, "
            "fewer than one global batch"
        )
    eval_samples = t.eval_samples(ctx.parallel.dp_size)
    train, valid, test = build_train_valid_test_datasets(
        data, ctx.tokenizer, (per_pass, eval_samples, eval_samples)
    )
    if t.train_epochs is not None:
        epochs = t.train_epochs
    else:
        epochs = -(-t.train_samples(ctx.parallel.dp_size) // instances)
    stream = InstanceEpochDataset(train, instances, epochs, data.seed)
    return stream, valid, test, instances


def build_sas(ctx: BuildContext) -> ModelParts:
    import numpy as np

    from megatron_taco.data.replacement_store import StoreLayout
    from megatron_taco.data.sas_collator import ColdStart, SasCollator, cold_start_probs
    from megatron_taco.models.flops import sas_train_flops
    from megatron_taco.models.sas.model import SasForPretraining
    from megatron_taco.recipes.sas_augmentation import SelfAugmentation, StoreSource

    cfg, model_config = ctx.configs, ctx.model_config
    data, replacement = cfg.data, cfg.task["replacement"]
    train, valid, test, instances = build_instances(ctx)
    probs = cold_start_probs(
        replacement, data.prefixes, data.weights, ctx.tokenizer.is_special_mask()
    )
    augmentation = cfg.task["self_augmentation"]
    cold = ColdStart(probs, ctx.seed)
    callbacks: list[Callback] = []
    source = cold
    if augmentation.self_augmentation:
        root = augmentation.store_dir(cfg.training.save)
        source = StoreSource(cold, root)
        layout = StoreLayout(
            num_instances=instances,
            width=replacement.width(data.seq_length),
            vocab_size=ctx.tokenizer.vocab_size,
            num_shards=augmentation.replacement_store_shards,
        )
        special_ids = np.flatnonzero(ctx.tokenizer.is_special_mask())
        callbacks.append(
            SelfAugmentation(
                augmentation,
                root=root,
                layout=layout,
                seed=ctx.seed,
                special_ids=special_ids,
                vocab_size=ctx.tokenizer.vocab_size,
            )
        )
    collator = SasCollator(
        pad_id=ctx.tokenizer.pad_id,
        seq_length=data.seq_length,
        seed=ctx.seed,
        config=replacement,
        source=source,
    )
    model = SasForPretraining(model_config, ctx.parallel, ctx.rng_tracker)
    shape = sas_shape(model_config, data.seq_length)
    da = model_config.disentangled_attention

    def paper_flops(global_batch: int, steps: int) -> float:
        return sas_train_flops(shape, global_batch, steps, disentangled_attention=da)

    def train_flops(samples: int) -> float:
        # ELECTRA's convention counts backward = forward; hardware does ~2x forward.
        return 1.5 * paper_flops(samples, 1)

    variant = "SAS^DA" if da else "SAS"
    schedule = cfg.task["rtd_schedule"]
    return ModelParts(
        model=model,
        collate_fn=collator,
        train_dataset=train,
        valid_dataset=valid,
        test_dataset=test,
        tokens_per_sample=data.seq_length,
        train_flops=train_flops,
        paper_flops=paper_flops,
        samples_per_epoch=instances,
        callbacks=[RtdWeightSchedule(model, schedule), *callbacks],
        banner=[
            f"variant: {variant}; hidden {model_config.hidden_size}, FFN "
            f"{model_config.ffn_hidden_size}, {model_config.num_attention_heads} heads, "
            f"embedding {model_config.embedding_size}",
            f"replacements: {replacement.mask_prob:g} of each instance's tokens; cold start "
            f"{replacement.cold_start}; lambda {schedule.rtd_weight:g} -> "
            f"{schedule.rtd_weight_final:g} per epoch; "
            + (
                f"self-augmentation from epoch 2 (T={augmentation.sampling_temperature:g}, "
                f"store {augmentation.store_dir(cfg.training.save)})"
                if augmentation.self_augmentation
                else "no self-augmentation (cold start in every epoch)"
            ),
        ],
    )


SPEC = ModelSpec(
    name="SAS",
    prog="pretrain_sas.py",
    description="Pretrain SAS (MLM + lambda * RTD on one encoder) on DeepSpeed.",
    model_config=SasConfig,
    task_configs=(
        ("replacement", ReplacementConfig, "replaced tokens"),
        ("rtd_schedule", RtdScheduleConfig, "RTD loss weight"),
        ("self_augmentation", SelfAugmentationConfig, "self-augmentation"),
    ),
    build=build_sas,
    check=check_sas,
    has_epochs=True,
)

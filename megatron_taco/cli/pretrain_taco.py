"""Pretrain TACO with tensor x data parallelism on DeepSpeed (taco-pretrain, pretrain_taco.py).

    deepspeed --num_gpus 8 pretrain_taco.py --tensor-model-parallel-size 2 \\
        --data-path data/wiki_text_sentence --tokenizer-model tok.model --seq-length 128 \\
        --micro-batch-size 32 --global-batch-size 1024 --train-iters 100000 --lr 1e-4 \\
        --lr-warmup-iters 10000 --deepspeed-config ds_configs/zero1_bf16.json \\
        --save ckpt --load ckpt --save-interval 1000 --tensorboard-dir tb

Also runs under torchrun, and as plain ``python pretrain_taco.py ...`` for one process.
Every flag is checked (including the DeepSpeed JSON and the existence of the data,
tokenizer and JSON files) before any process group is created, so a typo fails at once on
every rank instead of after a rendezvous.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_taco.arguments import ConfigError, add_dataclass_args, dataclass_from_args
from megatron_taco.data.config import DataConfig
from megatron_taco.data.masking import MaskingConfig
from megatron_taco.models.taco.config import TacoConfig
from megatron_taco.parallel.config import ParallelConfig, check_world_size
from megatron_taco.training.config import (
    DeepSpeedSettings,
    TrainingConfig,
    resolve_deepspeed_config,
)

logger = logging.getLogger("megatron_taco.pretrain")


@dataclass(frozen=True)
class PretrainConfigs:
    parallel: ParallelConfig
    model: TacoConfig
    data: DataConfig
    masking: MaskingConfig
    training: TrainingConfig
    deepspeed: DeepSpeedSettings
    world_size: int
    device_type: str

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.parallel.tensor_model_parallel_size

    def as_dict(self) -> dict[str, Any]:
        return {
            "parallel": dataclasses.asdict(self.parallel),
            "model": dataclasses.asdict(self.model),
            "data": dataclasses.asdict(self.data),
            "masking": dataclasses.asdict(self.masking),
            "training": dataclasses.asdict(self.training),
            "deepspeed": self.deepspeed.config,
        }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_taco.py",
        description="Pretrain TACO (MLM + MPM) with Megatron tensor parallelism on DeepSpeed.",
        allow_abbrev=False,
    )
    add_dataclass_args(parser, ParallelConfig, "parallelism")
    TacoConfig.add_args(parser)
    add_dataclass_args(parser, DataConfig, "data")
    add_dataclass_args(parser, MaskingConfig, "masking")
    TrainingConfig.add_args(parser)
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
    return parser


def configs_from_args(
    args: argparse.Namespace, *, world_size: int, device_type: str
) -> PretrainConfigs:
    """Build and cross-check every config; reads the DeepSpeed JSON and checks that the
    data, tokenizer and JSON files exist. No process-group work."""
    parallel = dataclass_from_args(ParallelConfig, args)
    model = TacoConfig.from_args(args)
    data = dataclass_from_args(DataConfig, args)
    masking = dataclass_from_args(MaskingConfig, args)
    training = TrainingConfig.from_args(args)
    tp = parallel.tensor_model_parallel_size
    check_world_size(world_size, tp)
    model.validate_parallel(tp)
    if data.seq_length > model.max_position_embeddings:
        raise ConfigError(
            f"--seq-length: {data.seq_length} exceeds --max-position-embeddings "
            f"{model.max_position_embeddings} (positions are 0..seq_length-1)"
        )
    deepspeed = resolve_deepspeed_config(training, world_size // tp, device_type=device_type)
    data.validate_files()
    return PretrainConfigs(
        parallel=parallel,
        model=model,
        data=data,
        masking=masking,
        training=training,
        deepspeed=deepspeed,
        world_size=world_size,
        device_type=device_type,
    )


def parse_configs(argv: list[str] | None = None) -> PretrainConfigs:
    from megatron_taco.training.engine import accelerator_name, launcher_world_size

    args = build_parser().parse_args(argv)
    return configs_from_args(args, world_size=launcher_world_size(), device_type=accelerator_name())


def _banner(
    cfg: PretrainConfigs, *, parameters: int, norms: list[str], optimizer: str, resumed: str
) -> str:
    t, ds = cfg.training, cfg.deepspeed
    tp = cfg.parallel.tensor_model_parallel_size
    lines = [
        "=" * 78,
        "megatron_taco: TACO pretraining",
        f"  world size {cfg.world_size} = tensor parallel {tp} x data parallel "
        f"{cfg.data_parallel_size}  (accelerator: {cfg.device_type})",
        f"  DeepSpeed: {ds.source} | ZeRO stage {ds.zero_stage} | precision {ds.precision}",
        f"  global batch {ds.global_batch_size} = micro-batch {t.micro_batch_size} x "
        f"grad accumulation {ds.grad_accum_steps} x data parallel {cfg.data_parallel_size}; "
        f"seq length {cfg.data.seq_length}",
        f"  model: TACO{f' ({cfg.model.model_size})' if cfg.model.model_size else ''}, "
        f"{cfg.model.num_layers} layers, {parameters:,} parameters",
        f"  LayerNorm: {', '.join(norms) or 'none'}",
        f"  optimizer: {optimizer}; lr {t.lr:g} -> {t.min_lr:g}, warmup {t.warmup_iters} iters, "
        f"{t.lr_decay_style} decay over {t.decay_iters} iters; weight decay {t.weight_decay:g}; "
        f"clip grad {t.clip_grad:g}",
        f"  train iterations {t.train_iters}; {resumed}",
        "=" * 78,
    ]
    return "\n".join(lines)


def run(cfg: PretrainConfigs) -> int:
    # Heavy imports after validation: --help and config errors stay fast.
    import deepspeed  # noqa: F401  (creates DeepSpeed's logger, tuned below)
    import torch

    from megatron_taco.data.bert_dataset import build_train_valid_test_datasets
    from megatron_taco.data.taco_collator import TacoMaskingCollator
    from megatron_taco.data.tokenizer import Tokenizer
    from megatron_taco.models.flops import taco_train_flops
    from megatron_taco.models.taco.model import TacoForPretraining
    from megatron_taco.parallel.random import model_parallel_seed
    from megatron_taco.training.checkpointing import TrainingState, load_checkpoint
    from megatron_taco.training.engine import (
        count_parameters,
        destroy_distributed,
        init_distributed,
        initialize_engine,
        norm_implementations,
    )
    from megatron_taco.training.logging import TrainingLogger
    from megatron_taco.training.loop import PretrainTask, Trainer
    from megatron_taco.training.plots import plot_loss_curves

    # DeepSpeed's INFO output (config dumps, per-step notes) drowns the training log.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    t, data = cfg.training, cfg.data
    parallel = None
    train_logger = None
    try:
        parallel = init_distributed(cfg.parallel.tensor_model_parallel_size)
        if parallel.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        seed = data.seed
        # Our data pipeline uses explicit generators; the global ones are seeded (and
        # checkpointed) for any library code that draws from them.
        random.seed(seed)
        np.random.seed(seed)  # noqa: NPY002
        rng_tracker = model_parallel_seed(seed, parallel)

        tokenizer = Tokenizer(data.tokenizer_model)
        model_config = cfg.model.with_vocab_size(tokenizer.vocab_size)
        dp = parallel.dp_size
        eval_samples = t.eval_samples(dp)
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
            data, tokenizer, (t.train_samples(dp), eval_samples, eval_samples)
        )
        collator = TacoMaskingCollator.from_tokenizer(
            tokenizer, seq_length=data.seq_length, seed=seed, masking=cfg.masking
        )
        model = TacoForPretraining(model_config, parallel, rng_tracker)
        parameters = count_parameters(model, parallel)
        norms = norm_implementations(model)
        engine = initialize_engine(model, t, cfg.deepspeed, parallel)

        state = TrainingState()
        resumed = "starting from scratch"
        if t.load is not None:
            loaded = load_checkpoint(
                engine.engine,
                t.load,
                parallel,
                rng_tracker,
                ckpt_step=t.ckpt_step,
                load_optim=not t.no_load_optim,
                load_rng=not t.no_load_rng,
                finetune=t.finetune,
            )
            if loaded is not None:
                state = loaded
                resumed = (
                    f"fine-tuning from {t.load}"
                    if t.finetune
                    else f"resumed from {t.load} at iteration {state.iteration} "
                    f"({state.consumed_samples} samples consumed)"
                )
        train_logger = TrainingLogger(
            rank=parallel.rank,
            train_iters=t.train_iters,
            start_iteration=state.iteration,
            tensorboard_dir=t.tensorboard_dir,
            metrics_file=t.resolved_metrics_file,
            progress_bar=t.progress_bar,
        )
        train_logger.print(
            _banner(
                cfg,
                parameters=parameters,
                norms=norms,
                optimizer=engine.optimizer_impl,
                resumed=resumed,
            )
        )
        labelled = cfg.masking.mask_prob

        def train_flops(samples: int) -> float:
            # Each sample is two rows (MLM row + MPM row).
            return taco_train_flops(model_config, data.seq_length, 2 * samples, labelled)

        task = PretrainTask(
            model=model,
            collate_fn=collator,
            train_dataset=train_ds,
            valid_dataset=valid_ds,
            test_dataset=test_ds,
            tokens_per_sample=data.seq_length,
            train_flops=train_flops,
        )
        trainer = Trainer(
            engine,
            parallel,
            t,
            task,
            train_logger,
            seed=seed,
            num_workers=data.num_workers,
            rng_tracker=rng_tracker,
            checkpoint_metadata={"configs": cfg.as_dict()},
        )
        state = trainer.train(state)
        train_logger.close()
        metrics_file = t.resolved_metrics_file
        if parallel.rank == 0 and metrics_file is not None and os.path.isfile(metrics_file):
            png = plot_loss_curves(metrics_file)
            if png is not None:
                train_logger.print(f" loss curves: {png}")
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return 0
    finally:
        if train_logger is not None:
            train_logger.close()
        destroy_distributed(parallel)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = parse_configs(argv)
        # Errors found later (e.g. a --load directory without the named checkpoint) are
        # reported the same way, after run() has torn the process groups down.
        return run(cfg)
    except ConfigError as e:
        print(f"pretrain_taco.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

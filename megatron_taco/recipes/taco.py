"""Pretrain TACO with tensor x data parallelism on DeepSpeed (taco-pretrain, pretrain_taco.py).

    deepspeed --num_gpus 8 pretrain_taco.py --tensor-model-parallel-size 2 \\
        --data-path data/wiki_text_sentence --tokenizer-model tok.model --seq-length 128 \\
        --micro-batch-size 32 --global-batch-size 1024 --train-iters 100000 --lr 1e-4 \\
        --lr-warmup-iters 10000 --deepspeed-config ds_configs/zero1_bf16.json \\
        --save ckpt --load ckpt --save-interval 1000 --tensorboard-dir tb

Also runs under torchrun, and as plain ``python pretrain_taco.py ...`` for one process.
The run itself is the generic driver (training/driver.py); this module says what TACO is.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_taco.data.bert_dataset import build_train_valid_test_datasets
from megatron_taco.data.masking import TokenMaskingConfig
from megatron_taco.data.position_masking import PositionMaskingConfig
from megatron_taco.data.taco_collator import TacoMaskingCollator
from megatron_taco.models.common.host import WithHost
from megatron_taco.models.flops import taco_electra_train_flops, taco_train_flops
from megatron_taco.models.taco.config import TacoConfig
from megatron_taco.models.taco.model import TacoForPretraining
from megatron_taco.parallel import comm
from megatron_taco.training.spec import BuildContext, ModelParts, ModelSpec, group


@dataclass(frozen=True)
class TacoRecipe:
    """TACO's own config groups: its MLM's span masking and its MPM's position masking."""

    masking: TokenMaskingConfig = group("masking (MLM)")
    position_masking: PositionMaskingConfig = group("position masking (MPM)")


def build_taco(ctx: BuildContext) -> ModelParts:
    cfg, model_config = ctx.configs, ctx.model_config
    data, t, dp = cfg.data, cfg.training, ctx.parallel.dp_size
    masking, position_masking = cfg.recipe.masking, cfg.recipe.position_masking
    eval_samples = t.eval_samples(dp)
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
        data, ctx.tokenizer, (t.train_samples(dp), eval_samples, eval_samples), comm.barrier
    )
    collator = TacoMaskingCollator.from_tokenizer(
        ctx.tokenizer,
        seq_length=data.seq_length,
        seed=ctx.seed,
        masking=masking,
        position_masking=position_masking,
        num_positions=model_config.max_position_embeddings,
    )
    labelled = masking.mask_prob

    def train_flops(samples: int) -> float:
        # Each sample is two rows (MLM row + MPM row).
        forwards = -(-samples // t.micro_batch_size)
        return taco_train_flops(
            model_config, data.seq_length, 2 * samples, labelled, forwards=forwards
        )

    def paper_flops(global_batch: int, steps: int) -> float:
        return taco_electra_train_flops(model_config, data.seq_length, global_batch, steps)

    return ModelParts(
        model=TacoForPretraining(model_config, ctx.parallel, ctx.rng_tracker),
        collate_fn=WithHost(collator, TacoForPretraining.host_layout),
        train_dataset=train_ds,
        valid_dataset=valid_ds,
        test_dataset=test_ds,
        tokens_per_sample=2 * data.seq_length,  # the encoder runs the MLM and the MPM row
        train_flops=train_flops,
        paper_flops=paper_flops,
        banner=[
            f"streams: WE {model_config.we_hidden_size} ({model_config.we_attention_heads} heads, "
            f"d_v {model_config.we_value_size}), PE {model_config.pe_hidden_size} "
            f"({model_config.pe_attention_heads} heads, d_v {model_config.pe_value_size}), "
            f"d_k {model_config.kv_channels}"
        ],
    )


SPEC = ModelSpec(
    name="TACO",
    prog="pretrain_taco.py",
    description="Pretrain TACO (MLM + MPM) with Megatron tensor parallelism on DeepSpeed.",
    model_config=TacoConfig,
    recipe_config=TacoRecipe,
    build=build_taco,
)

"""Tensor x data parallelism: process groups, TP layers, vocab-parallel loss, RNG streams."""

from megatron_taco.parallel.config import ParallelConfig, check_world_size
from megatron_taco.parallel.cross_entropy import (
    vocab_parallel_accuracy,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from megatron_taco.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    gather_full_weight,
    init_method_normal,
    merge_partitions,
    pad_vocab_size,
    param_is_not_tensor_parallel_duplicate,
    param_is_tensor_parallel,
    scaled_init_method_normal,
    set_tensor_model_parallel_attributes,
    split_partition,
)
from megatron_taco.parallel.mappings import (
    all_gather_to_tp_region,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_tp_region,
    scatter_to_tp_region,
)
from megatron_taco.parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGTracker,
    checkpoint,
    model_parallel_seed,
)
from megatron_taco.parallel.state import (
    ParallelState,
    dp_group_ranks,
    init_parallel,
    single_process_state,
    tp_group_ranks,
)

__all__ = [
    "MODEL_PARALLEL_RNG",
    "ColumnParallelLinear",
    "ParallelConfig",
    "ParallelState",
    "RNGTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_gather_to_tp_region",
    "check_world_size",
    "checkpoint",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tp_region",
    "dp_group_ranks",
    "gather_from_tp_region",
    "gather_full_weight",
    "init_method_normal",
    "init_parallel",
    "merge_partitions",
    "model_parallel_seed",
    "pad_vocab_size",
    "param_is_not_tensor_parallel_duplicate",
    "param_is_tensor_parallel",
    "reduce_from_tp_region",
    "reduce_scatter_to_tp_region",
    "scaled_init_method_normal",
    "scatter_to_tp_region",
    "set_tensor_model_parallel_attributes",
    "single_process_state",
    "split_partition",
    "tp_group_ranks",
    "vocab_parallel_accuracy",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
]

"""Tensor-parallel layers: column/row-parallel linear and vocabulary-parallel embedding.

Initialisation: every rank builds the FULL master weight on CPU in float32 from the default
torch RNG, runs ``init_method`` on it, then keeps its own slice. All ranks therefore draw
the same random numbers in the same order, and a model built from the same seed is the
same full model for every tensor-parallel size (tests compare tp=2 against tp=1).

Split parameters carry ``tensor_model_parallel=True``, ``partition_dim`` and
``partition_stride``; DeepSpeed's gradient-norm code reads ``tensor_model_parallel`` to count
a split parameter on every TP rank but a replicated one only once, and ``merge_partitions``
/ ``gather_full_weight`` use the other two to rebuild full tensors for checkpoints.

Return values: a layer returns its output tensor, like ``nn.Linear``; with
``skip_bias_add=True`` it returns ``(output, bias)`` with the bias not added (``bias`` is None
when the layer has none) so the caller can fuse the add with what follows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taco.parallel import comm
from megatron_taco.parallel.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    group_size,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from megatron_taco.parallel.state import ParallelState

InitMethod = Callable[[torch.Tensor], object]


def init_method_normal(std: float = 0.02) -> InitMethod:
    def init_(tensor: torch.Tensor):
        return nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """Megatron's init for output projections feeding a residual: std / sqrt(2 * num_layers)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1
) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def param_is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, parallel: ParallelState) -> bool:
    """True if this rank should count ``param`` (e.g. in a norm): split params on every TP
    rank, replicated params only on tp_rank 0."""
    return param_is_tensor_parallel(param) or parallel.tp_rank == 0


def pad_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Smallest multiple of ``multiple * tp_size`` >= vocab_size (Megatron's
    make-vocab-size-divisible-by), so every TP rank holds an equal, aligned slice."""
    unit = multiple * tp_size
    return ((vocab_size + unit - 1) // unit) * unit


def split_partition(
    full: torch.Tensor, dim: int, stride: int, rank: int, world: int
) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim``.

    With stride s the dimension is s logical blocks (e.g. fused [q; k; v], s=3); each block
    is split into ``world`` chunks and rank r takes chunk r of every block, concatenated:
    rank r holds [q_r; k_r; v_r], i.e. its own heads of q, k and v.
    """
    size = full.shape[dim]
    if size % (stride * world) != 0:
        raise ValueError(
            f"dimension {dim} of size {size} is not divisible by stride {stride} x tensor-parallel "
            f"size {world}"
        )
    chunks = torch.split(full, size // (stride * world), dim=dim)  # stride*world chunks
    return torch.cat(chunks[rank::world], dim=dim).contiguous()


def merge_partitions(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of split_partition: the per-rank slices (in rank order) -> the full tensor."""
    if stride == 1:
        return torch.cat(parts, dim=dim)
    per_rank = [torch.chunk(p, stride, dim=dim) for p in parts]
    # block s of the full tensor = chunk s of rank 0, chunk s of rank 1, ...
    return torch.cat([per_rank[r][s] for s in range(stride) for r in range(len(parts))], dim=dim)


def gather_full_weight(
    param: torch.Tensor, group, tensor: torch.Tensor | None = None
) -> torch.Tensor:
    """All-gather this rank's slice of a split parameter over the TP group into the full
    (unsplit) tensor, using the parameter's partition attributes. ``tensor`` (default: the
    parameter's data) may be anything laid out like the parameter: its ``.grad``, an Adam
    moment. A replicated parameter comes back as a detached clone. Collective over ``group``.
    """
    data = (param if tensor is None else tensor).detach()
    if not param_is_tensor_parallel(param) or group_size(group) == 1:
        return data.clone()
    parts = comm.all_gather(data, group)
    return merge_partitions(parts, param.partition_dim, getattr(param, "partition_stride", 1))


def _init_partition(
    param: torch.Tensor,
    full_shape: tuple[int, ...],
    init_method: InitMethod,
    dim: int,
    stride: int,
    rank: int,
    world: int,
    pad_to: int | None = None,
) -> None:
    # CPU float32 master so every rank (and every tp size, and CPU vs GPU) draws the same
    # numbers from the same default CPU generator.
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    if pad_to is not None and pad_to > full_shape[dim]:
        pad_shape = list(full_shape)
        pad_shape[dim] = pad_to - full_shape[dim]
        master = torch.cat([master, master.new_zeros(pad_shape)], dim=dim)
    with torch.no_grad():
        param.copy_(split_partition(master, dim, stride, rank, world))
    # Marked even at tp=1 (like Megatron) so checkpoint tools always know the split layout.
    set_tensor_model_parallel_attributes(param, True, dim, stride)


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(f"{what} ({n}) must be divisible by the tensor-parallel size ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output rows: A = [A_0; ...; A_{p-1}], rank i computes
    Y_i = X A_i^T + b_i.  X [..., in] (replicated) -> Y [..., out/tp], or [..., out] with
    ``gather_output``. ``stride`` > 1 for fused weights (stride=3 for [q; k; v])."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelState,
        bias: bool = True,
        gather_output: bool = False,
        init_method: InitMethod | None = None,
        stride: int = 1,
        skip_bias_add: bool = False,
        *,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.stride = stride
        self.tp_group = parallel.tp_group
        tp, rank = parallel.tp_size, parallel.tp_rank
        self.output_size_per_partition = (
            _divide(out_features, tp * stride, "out_features / stride") * stride
        )
        init_method = init_method or init_method_normal()
        kw = {"dtype": params_dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, in_features, **kw))
        _init_partition(self.weight, (out_features, in_features), init_method, 0, stride, rank, tp)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, **kw))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        x = copy_to_tp_region(x, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        out = F.linear(x, self.weight, bias)  # [..., out/tp]
        if self.gather_output:
            out = gather_from_tp_region(out, self.tp_group, dim=-1)  # [..., out]
            if self.stride > 1 and group_size(self.tp_group) > 1:
                # The gather is rank-major [q_0 k_0 v_0 q_1 k_1 v_1]; restore [q; k; v].
                parts = out.chunk(group_size(self.tp_group), dim=-1)
                out = merge_partitions(list(parts), dim=-1, stride=self.stride)
        if self.skip_bias_add:
            return out, self.bias
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"per_partition={self.output_size_per_partition}, stride={self.stride}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by input columns: A = [A_0, ..., A_{p-1}], X = [X_0, ...];
    rank i computes X_i A_i^T and the partial sums are all-reduced, then the (replicated)
    bias is added once.  X [..., in/tp] (``input_is_parallel``) or [..., in] -> Y [..., out]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelState,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_method: InitMethod | None = None,
        skip_bias_add: bool = False,
        *,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.tp_group = parallel.tp_group
        tp, rank = parallel.tp_size, parallel.tp_rank
        self.input_size_per_partition = _divide(in_features, tp, "in_features")
        init_method = init_method or init_method_normal()
        kw = {"dtype": params_dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, self.input_size_per_partition, **kw))
        _init_partition(self.weight, (out_features, in_features), init_method, 1, 1, rank, tp)
        if bias:
            # Replicated on every TP rank: added after the all-reduce, so its gradient is the
            # same on all of them and it must be counted once (tensor_model_parallel=False).
            self.bias = nn.Parameter(torch.zeros(out_features, **kw))
            set_tensor_model_parallel_attributes(self.bias, False, 0, 1)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group, dim=-1)
        out = reduce_from_tp_region(F.linear(x, self.weight), self.tp_group)  # [..., out]
        if self.skip_bias_add:
            return out, self.bias
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"per_partition={self.input_size_per_partition}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split over TP ranks: rank r holds rows
    [vocab_start_index, vocab_end_index) of the padded table [padded_vocab_size, dim].
    Ids outside the range look up zeros locally; the all-reduce sums in the owner's row.
    Rows >= vocab_size are padding: initialised to zero and never looked up by a real id."""

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int,
        parallel: ParallelState,
        init_method: InitMethod | None = None,
        *,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        tp, rank = parallel.tp_size, parallel.tp_rank
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.padded_vocab_size = pad_vocab_size(vocab_size, tp)
        per_partition = self.padded_vocab_size // tp
        self.vocab_start_index = rank * per_partition
        self.vocab_end_index = self.vocab_start_index + per_partition
        self.tp_group = parallel.tp_group
        init_method = init_method or init_method_normal()
        self.weight = nn.Parameter(
            torch.empty(per_partition, embedding_dim, dtype=params_dtype, device=device)
        )
        # Only the real rows are drawn from the RNG, then zero rows are appended, so the
        # random stream (and the model) is the same for any tp even though padding differs.
        full = (vocab_size, embedding_dim)
        _init_partition(self.weight, full, init_method, 0, 1, rank, tp, self.padded_vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)  # [..., dim]
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size}, padded_vocab_size={self.padded_vocab_size}, "
            f"embedding_dim={self.embedding_dim}, rows=[{self.vocab_start_index}, "
            f"{self.vocab_end_index})"
        )

"""Tensor-parallel layouts: merge a checkpoint's tensor-parallel shards into full tensors and
split full tensors for another tensor-parallel size, for any model.

The model is never named here: a ``ModelBuilder`` (``build(parallel, vocab_size)``) builds
it on the meta device at a given tp size, and the partition attributes the parallel layers
set (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``) say how each
parameter is split. Vocabulary-parallel parameters (word embeddings, LM-head biases) are
found by building twice with vocabularies one padding unit apart: only their shapes move.
Their padding rows are dropped when merging and zero rows appended when splitting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from megatron_taco.checkpoint.errors import CheckpointError
from megatron_taco.parallel.layers import merge_partitions, pad_vocab_size, split_partition
from megatron_taco.parallel.state import ParallelState
from megatron_taco.param_groups import split_weight_decay

ModelBuilder = Callable[[ParallelState, int], nn.Module]


Tensors = dict[str, torch.Tensor]


_VOCAB_UNIT = 128  # pad_vocab_size's multiple per tp rank


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    shape: tuple[int, ...]  # one tensor-parallel rank's shape
    split: bool  # split over tp ranks (else replicated)
    dim: int = 0
    stride: int = 1
    vocab: bool = False  # rows along ``dim`` are the padded vocabulary


def _build_meta(build: ModelBuilder, tp_size: int, vocab_size: int) -> nn.Module:
    parallel = ParallelState(
        world_size=tp_size, rank=0, tp_size=tp_size, tp_group=None, dp_group=None
    )
    with torch.device("meta"):
        return build(parallel, vocab_size)


class ModelLayout:
    """How every parameter of a model built at tensor-parallel size ``tp_size`` is split,
    and the optimizer's parameter groups (names in the order DeepSpeed flattens them)."""

    def __init__(self, build: ModelBuilder, tp_size: int, vocab_size: int) -> None:
        self.tp_size, self.vocab_size = tp_size, vocab_size
        self.padded_vocab_size = pad_vocab_size(vocab_size, tp_size)
        model = _build_meta(build, tp_size, vocab_size)
        wider = dict(
            _build_meta(build, tp_size, vocab_size + _VOCAB_UNIT * tp_size).named_parameters()
        )
        self.params: dict[str, ParamLayout] = {}
        for name, p in model.named_parameters():
            split = bool(getattr(p, "tensor_model_parallel", False))
            self.params[name] = ParamLayout(
                shape=tuple(p.shape),
                split=split,
                dim=int(getattr(p, "partition_dim", 0)) if split else 0,
                stride=int(getattr(p, "partition_stride", 1)) if split else 1,
                vocab=tuple(wider[name].shape) != tuple(p.shape),
            )
        self.groups = [g for g in split_weight_decay(model) if g]

    def full_shape(self, name: str) -> tuple[int, ...]:
        lay = self.params[name]
        shape = list(lay.shape)
        if lay.split:
            shape[lay.dim] *= self.tp_size
        if lay.vocab:
            shape[lay.dim] = self.vocab_size
        return tuple(shape)

    def merge(self, parts: list[Tensors], what: str) -> Tensors:
        """Per-rank tensors (params, plus any buffers, taken from rank 0) -> full, unpadded."""
        if len(parts) != self.tp_size:
            raise CheckpointError(
                f"{what}: {len(parts)} tensor-parallel parts, expected {self.tp_size}"
            )
        full: Tensors = {}
        for name, tensor in parts[0].items():
            lay = self.params.get(name)
            if lay is None or not lay.split:
                if lay is not None and tuple(tensor.shape) != lay.shape:
                    raise CheckpointError(
                        f"{what}: {name} is {tuple(tensor.shape)}, the model in metadata.json "
                        f"has {lay.shape}"
                    )
                full[name] = tensor
                continue
            for rank, part in enumerate(parts):
                if name not in part or tuple(part[name].shape) != lay.shape:
                    got = tuple(part[name].shape) if name in part else "missing"
                    raise CheckpointError(
                        f"{what}: {name} of tp rank {rank} is {got}, the model in metadata.json "
                        f"has {lay.shape} at tensor parallel size {self.tp_size}"
                    )
            merged = merge_partitions([p[name] for p in parts], lay.dim, lay.stride)
            full[name] = merged.narrow(lay.dim, 0, self.vocab_size) if lay.vocab else merged
        return full

    def split(self, full: Tensors) -> list[Tensors]:
        """Full, unpadded tensors -> one dict per tp rank (vocabulary padded with zeros)."""
        parts: list[Tensors] = [{} for _ in range(self.tp_size)]
        for name, tensor in full.items():
            lay = self.params.get(name)
            if lay is None or not lay.split:
                for part in parts:
                    part[name] = tensor
                continue
            if tuple(tensor.shape) != self.full_shape(name):
                raise CheckpointError(
                    f"{name} is {tuple(tensor.shape)}, expected {self.full_shape(name)}"
                )
            if lay.vocab:
                pad = list(tensor.shape)
                pad[lay.dim] = self.padded_vocab_size - self.vocab_size
                tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=lay.dim)
            for rank in range(self.tp_size):
                parts[rank][name] = split_partition(tensor, lay.dim, lay.stride, rank, self.tp_size)
        return parts

"""BERT's prediction-head pieces, shared by TACO's MLM/MPM heads and SAS's MLM head.

The transform (dense + GELU + LayerNorm) is replicated on every tp rank: the heads run
only on the labelled positions (~15% of the tokens), too little work to split. The
decoder is tied to the (vocabulary-parallel) word embedding, so logits come out split over
the vocabulary and the loss is the vocabulary-parallel cross entropy: nothing of size
[N, V] is ever gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taco.models.common.layers import (
    LayerNorm,
    gelu,
    init_from_master_,
)
from megatron_taco.parallel.cross_entropy import (
    at_least_float32,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from megatron_taco.parallel.layers import (
    init_method_normal,
    pad_vocab_size,
    set_tensor_model_parallel_attributes,
)
from megatron_taco.parallel.mappings import copy_to_tp_region
from megatron_taco.parallel.state import ParallelState


def replicated_linear(fan_in: int, fan_out: int, std: float) -> nn.Linear:
    """nn.Linear initialised from the CPU master stream (same model for every tp), bias 0."""
    linear = nn.Linear(fan_in, fan_out)
    init_from_master_(linear.weight, init_method_normal(std))
    with torch.no_grad():
        linear.bias.zero_()
    return linear


class PredictionTransform(nn.Module):
    """dense(fan_in -> fan_out) + GELU + LayerNorm, replicated."""

    def __init__(self, fan_in: int, fan_out: int, *, init_std: float, eps: float) -> None:
        super().__init__()
        self.dense = replicated_linear(fan_in, fan_out, init_std)
        self.layernorm = LayerNorm(fan_out, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layernorm(gelu(self.dense(x)))


def vocab_parallel_bias(vocab_size: int, parallel: ParallelState) -> nn.Parameter:
    """The decoder bias, split like the word-embedding rows it is added to."""
    padded = pad_vocab_size(vocab_size, parallel.tp_size)
    bias = nn.Parameter(torch.zeros(padded // parallel.tp_size))
    set_tensor_model_parallel_attributes(bias, True, 0, 1)
    return bias


def tied_lm_logits(h: torch.Tensor, word_weight: torch.Tensor, bias: torch.Tensor, group):
    """h [N, d] (replicated) -> logits [N, V_padded/tp] of this rank's vocabulary, at least
    float32."""
    # Entering the vocab-split matmul: backward all-reduces dL/dh over tp.
    h = copy_to_tp_region(h, group)
    return at_least_float32(F.linear(h, word_weight, bias))


def lm_loss_and_correct(logits: torch.Tensor, labels: torch.Tensor, group, vocab_size: int):
    """(per-token cross entropy [N], correct [N] bool) over the split vocabulary."""
    loss = vocab_parallel_cross_entropy(logits, labels, group, vocab_size=vocab_size)
    with torch.no_grad():
        pred = vocab_parallel_argmax(logits, group, vocab_size=vocab_size)
    return loss, pred == labels


def labelled_count(labels: torch.Tensor, ignore_index: int = -100) -> int:
    """How many entries of ``labels`` carry a label (a host read: called on the CPU batch)."""
    return int((labels != ignore_index).sum())


def gather_labelled(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    count: int | None = None,
    ignore_index: int = -100,
):
    """Rows of ``hidden`` [b*s, d] at the labelled positions of ``labels`` [b, s], in flat
    order, and their labels: ([N, d], [N], flat indices [N]).

    ``count`` = N, counted on the host by the collate wrapper (models/common/host.py): the
    indices then come from a fixed-size nonzero and nothing is read back from the device.
    Without it, ``nonzero`` sizes the result (one host sync). Why not a sync-free form that
    needs no count: the heads over every position, masked, cost 1/0.15 ~ 6.7x the head FLOPs
    for the same loss (the tied decoder is a [d, V] GEMM per token, as costly as several
    encoder layers for V = 30k); a padded static upper bound wastes the padding and needs a
    bound the model cannot know (it is the masking config's). The host knows the exact count
    for free, so the work is exactly the labelled tokens' and the losses are bitwise those of
    the nonzero form."""
    flat = labels.reshape(-1)
    keep = flat != ignore_index
    if count is None:
        idx = keep.nonzero().squeeze(1)
    else:
        idx = torch.nonzero_static(keep, size=count).squeeze(1)
    return hidden.index_select(0, idx), flat.index_select(0, idx), idx


def masked_mean(values: torch.Tensor) -> torch.Tensor:
    """Mean over the entries, 0 for none (a batch without labels must not give NaN)."""
    return values.sum() / max(values.numel(), 1)

"""TACO pre-training heads: masked language modelling (MLM) and masked position modelling (MPM).

Both heads read the concatenated final representation [h_WE; h_PE] (d_WE + d_PE), as the
paper feeds the complete token representation to task layers. The paper leaves the heads'
form open; we use BERT's LM-head shape for both (models/common/lm_head.py):

* MLM: dense(d_WE+d_PE -> d_WE) + GELU + LayerNorm, then the decoder tied to the word
  embedding (vocabulary-parallel logits) + a vocabulary-parallel bias.
* MPM: dense(d_WE+d_PE -> d_PE) + GELU + LayerNorm, then the decoder tied to the absolute
  position embedding rows [0, max_position_embeddings) + bias: the target class is the true
  position, and tying makes "predict position p" mean "be close to p's input embedding"
  (the masked-position row max_position_embeddings is never a target).

The heads run only on the labelled positions, gathered first: on ~15% of the tokens the
vocabulary projection (the most expensive matmul of the model at small sizes) is ~7x cheaper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taco.models.common.lm_head import (
    PredictionTransform,
    lm_loss_and_correct,
    tied_lm_logits,
    vocab_parallel_bias,
)
from megatron_taco.models.taco.config import TacoConfig
from megatron_taco.parallel.cross_entropy import at_least_float32
from megatron_taco.parallel.state import ParallelState


class TacoPretrainingHeads(nn.Module):
    def __init__(self, config: TacoConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.config = config
        self.tp_group = parallel.tp_group
        hidden, std, eps = config.hidden_size, config.init_method_std, config.layernorm_epsilon
        self.mlm_transform = PredictionTransform(
            hidden, config.we_hidden_size, init_std=std, eps=eps
        )
        self.mpm_transform = PredictionTransform(
            hidden, config.pe_hidden_size, init_std=std, eps=eps
        )
        self.mlm_bias = vocab_parallel_bias(config.vocab_size, parallel)
        self.mpm_bias = nn.Parameter(torch.zeros(config.max_position_embeddings))

    def mlm(self, x: torch.Tensor, labels: torch.Tensor, word_weight: torch.Tensor):
        """x [N, d_WE+d_PE] (labelled positions only), labels [N] -> (per-token loss [N], correct [N])."""
        logits = tied_lm_logits(self.mlm_transform(x), word_weight, self.mlm_bias, self.tp_group)
        return lm_loss_and_correct(logits, labels, self.tp_group, self.config.vocab_size)

    def mpm(self, x: torch.Tensor, labels: torch.Tensor, position_weight: torch.Tensor):
        """x [N, d_WE+d_PE], labels [N] true positions -> (per-token loss [N], correct [N])."""
        h = self.mpm_transform(x)  # [N, d_PE]
        table = position_weight[: self.config.max_position_embeddings]  # drop the mask row
        logits = at_least_float32(F.linear(h, table, self.mpm_bias))  # [N, max_positions]
        loss = F.cross_entropy(logits, labels, reduction="none")
        return loss, logits.argmax(dim=-1) == labels

"""TACO pre-training heads: masked language modelling (MLM) and masked position modelling (MPM).

Both heads read the concatenated final representation [h_WE; h_PE] (d_WE + d_PE), as the
paper feeds the complete token representation to task layers. The paper leaves the heads'
form open; we use BERT's LM-head shape for both:

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

from megatron_taco.models.config import TacoConfig
from megatron_taco.models.layers import LayerNorm, gelu, init_from_master_, init_method_normal
from megatron_taco.parallel.cross_entropy import vocab_parallel_argmax, vocab_parallel_cross_entropy
from megatron_taco.parallel.layers import pad_vocab_size, set_tensor_model_parallel_attributes
from megatron_taco.parallel.mappings import copy_to_tp_region
from megatron_taco.parallel.state import ParallelState


def _replicated_linear(fan_in: int, fan_out: int, std: float) -> nn.Linear:
    linear = nn.Linear(fan_in, fan_out)
    init_from_master_(linear.weight, init_method_normal(std))
    with torch.no_grad():
        linear.bias.zero_()
    return linear


class _Transform(nn.Module):
    """BERT's prediction-head transform: dense + GELU + LayerNorm (replicated on every tp rank;
    the heads see only ~15% of the tokens, too little work to split)."""

    def __init__(self, fan_in: int, fan_out: int, config: TacoConfig) -> None:
        super().__init__()
        self.dense = _replicated_linear(fan_in, fan_out, config.init_method_std)
        self.layernorm = LayerNorm(fan_out, config.layernorm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layernorm(gelu(self.dense(x)))


class TacoPretrainingHeads(nn.Module):
    def __init__(self, config: TacoConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.config = config
        self.tp_group = parallel.tp_group
        hidden = config.hidden_size
        self.mlm_transform = _Transform(hidden, config.we_hidden_size, config)
        self.mpm_transform = _Transform(hidden, config.pe_hidden_size, config)
        padded = pad_vocab_size(config.vocab_size, parallel.tp_size)
        # Split like the word embedding rows it is added to.
        self.mlm_bias = nn.Parameter(torch.zeros(padded // parallel.tp_size))
        set_tensor_model_parallel_attributes(self.mlm_bias, True, 0, 1)
        self.mpm_bias = nn.Parameter(torch.zeros(config.max_position_embeddings))

    def mlm(self, x: torch.Tensor, labels: torch.Tensor, word_weight: torch.Tensor):
        """x [N, d_WE+d_PE] (labelled positions only), labels [N] -> (per-token loss [N], correct [N])."""
        h = self.mlm_transform(x)  # [N, d_WE], replicated
        # Entering the vocab-split matmul: backward all-reduces dL/dh over tp.
        h = copy_to_tp_region(h, self.tp_group)
        logits = F.linear(h, word_weight, self.mlm_bias).float()  # [N, V_padded/tp]
        loss = vocab_parallel_cross_entropy(
            logits, labels, self.tp_group, vocab_size=self.config.vocab_size
        )
        with torch.no_grad():
            pred = vocab_parallel_argmax(logits, self.tp_group, vocab_size=self.config.vocab_size)
        return loss, pred == labels

    def mpm(self, x: torch.Tensor, labels: torch.Tensor, position_weight: torch.Tensor):
        """x [N, d_WE+d_PE], labels [N] true positions -> (per-token loss [N], correct [N])."""
        h = self.mpm_transform(x)  # [N, d_PE]
        table = position_weight[: self.config.max_position_embeddings]  # drop the mask row
        logits = F.linear(h, table, self.mpm_bias).float()  # [N, max_positions]
        loss = F.cross_entropy(logits, labels, reduction="none")
        return loss, logits.argmax(dim=-1) == labels

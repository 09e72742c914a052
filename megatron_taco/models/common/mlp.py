"""The tensor-parallel feed-forward block (column-parallel in, row-parallel out)."""

from __future__ import annotations

import torch
from torch import nn

from megatron_taco.models.common.layers import gelu
from megatron_taco.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    init_method_normal,
    scaled_init_method_normal,
)
from megatron_taco.parallel.state import ParallelState


class ParallelMLP(nn.Module):
    """fc2(GELU(fc1(x))): fc1 splits the FFN columns over tp, fc2 all-reduces the partial
    sums. fc2 feeds a residual, so it gets Megatron's std / sqrt(2 * num_layers) init unless
    ``output_std`` says otherwise (ELECTRA/DeBERTa draw it like every other layer)."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        parallel: ParallelState,
        *,
        init_std: float,
        num_layers: int,
        output_std: float | None = None,
    ) -> None:
        super().__init__()
        init = init_method_normal(init_std)
        if output_std is None:
            out_init = scaled_init_method_normal(init_std, num_layers)
        else:
            out_init = init_method_normal(output_std)
        self.fc1 = ColumnParallelLinear(hidden, ffn, parallel, init_method=init)
        self.fc2 = RowParallelLinear(ffn, hidden, parallel, init_method=out_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu(self.fc1(x)))  # [b, s, ffn/tp] -> [b, s, hidden]

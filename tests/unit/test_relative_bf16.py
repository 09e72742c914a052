"""The relative-position backward (models/common/relative.py) sums up to s pair gradients
into one table row per query. On a GPU, scatter_add_ on bf16 is an atomic bf16 add per pair
(each add rounded: ~170 terms near 1 meeting at 150 lose whole units, bf16's spacing there);
CPU kernels happen to accumulate in float32, so a CPU run cannot show the loss itself. What it
can show: the sum is taken in float32 (the ops seen by a dispatch mode), and the bf16 result
stays within bf16 rounding of a float64 reference on the same bf16 inputs."""

from __future__ import annotations

import pytest
import torch

from megatron_taco.models.common.relative import c2p_backward, p2c_backward
from tests.helpers import ScatterDtypes


@pytest.mark.parametrize("which", ["c2p", "p2c"])
def test_relative_row_gradients_accumulate_in_float32(which):
    g = torch.Generator().manual_seed(0)
    h, b, s, d, n = 2, 1, 512, 8, 3
    # Every pair in one of 3 rows: ~170 gradients of one sign meet in each entry.
    index = torch.randint(0, n, (b, s, s), generator=g)
    grad = (0.5 + torch.rand(h, b, s, s, generator=g)).bfloat16()
    x = (0.5 + torch.rand(h, b, s, d, generator=g)).bfloat16()  # q (c2p) or k (p2c)
    table = torch.rand(h, n, d, generator=g).bfloat16()  # k_r (c2p) or q_r (p2c)
    backward = c2p_backward if which == "c2p" else p2c_backward
    got_x = torch.zeros(h, b * s, d, dtype=torch.bfloat16)
    with ScatterDtypes() as seen:
        got = backward(grad, x, table, index, got_x)
    assert seen.dtypes == [torch.float32]
    want_x = torch.zeros(h, b * s, d, dtype=torch.float64)
    with ScatterDtypes() as seen:
        want = backward(grad.double(), x.double(), table.double(), index, want_x)
    assert seen.dtypes == [torch.float64]  # float64 stays float64 (the exact tests)
    assert got.dtype == got_x.dtype == torch.bfloat16
    # Two roundings to bf16 (the row sums, the product): 2 * 2^-8 relative at most.
    rel = ((got.double() - want).abs() / want.abs()).max().item()
    assert rel < 2 * 2**-8, rel
    rel_x = ((got_x.double() - want_x).abs() / want_x.abs()).max().item()
    assert rel_x < 3 * 2**-8, rel_x

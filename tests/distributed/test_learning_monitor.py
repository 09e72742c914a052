"""The learning monitor's figures over tensor x data parallel ranks (2 x 2, gloo) equal one
process's over all the data: data-parallel ranks are summed, tensor-parallel ranks (which
hold the same vectors and labels) are not."""

from __future__ import annotations

import pytest
import torch

from megatron_taco.models.common.monitoring import monitoring_outputs
from megatron_taco.training.monitor import EvaluationStatistics
from tests.helpers import run_distributed


def _data(dp_rank: int):
    g = torch.Generator().manual_seed(10 + dp_rank)
    vectors = torch.randn(3, 7, 5, generator=g) + torch.tensor([1.0, 0.5, 0, 0, -1])
    mask = torch.rand(3, 7, generator=g) < 0.8
    # Rank 0's most frequent label is 2, rank 1's is 6; over both, 6 wins (6 vs 5 of 13).
    labels = [torch.tensor([2, 2, 2, 1, 6, 6]), torch.tensor([6, 6, 6, 2, 2, 3, 6])][dp_rank]
    return vectors, mask, labels


def _figures(batches) -> dict[str, float]:
    stats = EvaluationStatistics()
    for vectors, mask, labels in batches:
        stats.add(monitoring_outputs(vectors, mask, mlm=(labels, 8)))
    return stats


def _worker(rank, world_size):
    from megatron_taco.parallel.state import init_parallel

    parallel = init_parallel(2)
    return _figures([_data(parallel.dp_rank)]).reduce(parallel)


def test_figures_over_tp2_dp2_equal_one_process_over_all_the_data():
    results = run_distributed(_worker, 4)
    want = _figures([_data(0), _data(1)]).reduce()
    assert want["mlm_baseline_acc"] == pytest.approx(6 / 13)
    for got in results:
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-12), key

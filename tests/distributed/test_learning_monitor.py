"""The learning monitor's figures over tensor x data parallel ranks (2 x 2, gloo) equal one
process's over all the data: data-parallel ranks are summed, tensor-parallel ranks (which
hold the same vectors and labels) are not."""

from __future__ import annotations

import pytest
import torch

from megatron_taco.models.common.monitoring import monitoring_outputs
from megatron_taco.training.observability.monitor import EvaluationStatistics
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


# ---------------------------------------------------------------------------------------
# The real models: their last-layer vectors are complete and replicated on every tp rank
# (the figures are reduced over data-parallel ranks only), so tp=2 gives tp=1's figures.


def _model_figures(rank, world_size, tp):
    from megatron_taco.models.sas.model import SasForPretraining
    from megatron_taco.models.taco.model import TacoForPretraining
    from megatron_taco.parallel.random import model_parallel_seed
    from megatron_taco.parallel.state import init_parallel
    from megatron_taco.training.loop import evaluate_batches
    from tests.helpers import make_batch, make_sas_batch, tiny_config, tiny_sas_config

    parallel = init_parallel(tp)
    out = {}
    for name, cls, config, batch in (
        ("taco", TacoForPretraining, tiny_config, make_batch),
        ("sas", SasForPretraining, tiny_sas_config, make_sas_batch),
    ):
        tracker = model_parallel_seed(1234, parallel, device="cpu")
        # A large init: the vectors' pairwise cosines spread well away from 0 and 1.
        cfg = config(hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3)
        model = cls(cfg, parallel, tracker).double().eval()
        batches = [batch(b=3, seed=7), batch(b=2, seed=8)]
        out[name] = evaluate_batches(model, batches, parallel, len(batches))
    return out


def test_real_models_figures_at_tp2_equal_tp1():
    want = run_distributed(_model_figures, 1, 1)[0]
    ranks = run_distributed(_model_figures, 2, 2)
    for name, figures in want.items():
        assert 0.05 < figures["collapse_cosine"] < 0.95, (name, figures["collapse_cosine"])
        for got in ranks:
            for key in ("collapse_cosine", "mlm_baseline_acc", "mlm_acc"):
                assert got[name][key] == pytest.approx(figures[key], rel=1e-12), (name, key)
            if name == "taco":
                assert got[name]["mpm_baseline_acc"] == figures["mpm_baseline_acc"]
        # Bitwise the same on every tp rank: each decides alone whether to stop the run
        # (--exit-on-collapse), so a last-bit difference at the threshold would hang the other.
        assert ranks[0][name] == ranks[1][name]

"""Tensor parallelism over NCCL: tiny TACO at tp=2 on two GPUs equals tp=1 on one, in float64,
on the same batch, every gathered gradient within 1e-10 of its tensor's largest entry and the
replicated parameters' gradients bitwise equal on both ranks. The same worker and comparison
as tests/distributed/test_taco_tp.py's gloo run on CPU (where its mutations show the
comparison fails for wrong tensor-parallel code); NCCL takes the CUDA-only branches of
parallel/mappings.py. With recompute too, whose backward replays the tensor-parallel dropout
streams on the GPU.

And training, tiny TACO and SAS: tp=2 x dp (2 GPUs: dp 1; 4 GPUs: dp 2) through the real
Trainer and DeepSpeed ZeRO-2 in fp32 (no TF32) against tp=1 on one GPU, on the same global
batches, per iteration and in the final parameters: tests/distributed/test_tp_dp_training.py's
worker, comparison and tolerances (its mutations are measured there, on CPU)."""

from __future__ import annotations

import pytest

from tests.distributed.test_taco_tp import _assert_matches, _run_model
from tests.distributed.test_tp_dp_training import (
    MODELS,
    _train,
    assert_training_matches,
    training_differences,
)
from tests.helpers import require_gpus, run_distributed


@pytest.mark.parametrize("recompute", [False, True])
def test_tp2_over_nccl_equals_tp1(recompute):
    require_gpus(2)
    nccl = dict(backend="nccl", timeout=600)
    (tp1,) = run_distributed(_run_model, 1, 1, recompute, None, "cuda", **nccl)
    _assert_matches(tp1, run_distributed(_run_model, 2, 2, recompute, None, "cuda", **nccl))


@pytest.mark.parametrize("gpus", [2, 4], ids=["tp2_dp1", "tp2_dp2"])
def test_tp2_training_over_nccl_equals_tp1(gpus, tmp_path, record_property):
    require_gpus(gpus)
    nccl = dict(backend="nccl", timeout=600)
    (tp1,) = run_distributed(_train, 1, str(tmp_path), 1, "cuda", **nccl)
    ranks = run_distributed(_train, gpus, str(tmp_path), 2, "cuda", **nccl)
    largest = {model: training_differences(tp1[model], ranks[0][model]) for model in MODELS}
    record_property("largest_relative_difference", largest)
    for model in MODELS:
        assert_training_matches(tp1[model], [r[model] for r in ranks], model, dp=gpus // 2)

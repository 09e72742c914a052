"""Tensor parallelism over NCCL: tiny TACO at tp=2 on two GPUs equals tp=1 on one, in float64,
on the same batch, every gathered gradient within 1e-10 of its tensor's largest entry and the
replicated parameters' gradients bitwise equal on both ranks. The same worker and comparison
as tests/distributed/test_taco_tp.py's gloo run on CPU (where its mutations show the
comparison fails for wrong tensor-parallel code); NCCL takes the CUDA-only branches of
parallel/mappings.py. With recompute too, whose backward replays the tensor-parallel dropout
streams on the GPU."""

from __future__ import annotations

import pytest

from tests.distributed.test_taco_tp import _assert_matches, _run_model
from tests.helpers import require_gpus, run_distributed


@pytest.mark.parametrize("recompute", [False, True])
def test_tp2_over_nccl_equals_tp1(recompute):
    require_gpus(2)
    nccl = dict(backend="nccl", timeout=600)
    (tp1,) = run_distributed(_run_model, 1, 1, recompute, None, "cuda", **nccl)
    _assert_matches(tp1, run_distributed(_run_model, 2, 2, recompute, None, "cuda", **nccl))

"""Tensor parallelism over NCCL: tiny TACO at tp=2 on two GPUs equals tp=1 on one, in float64,
on the same batch, every gathered gradient within 1e-10 of its tensor's largest entry and the
replicated parameters' gradients bitwise equal on both ranks (tests/distributed/test_taco_tp.py
checks the same over gloo on CPU; NCCL takes the CUDA-only branches of parallel/mappings.py).
With recompute too, whose backward replays the tensor-parallel dropout streams on the GPU."""

from __future__ import annotations

import pytest
import torch

from megatron_taco.parallel.random import model_parallel_seed
from megatron_taco.parallel.state import init_parallel
from tests.distributed.test_taco_tp import _assert_matches, _build, _step
from tests.helpers import make_batch, require_gpus, run_distributed


def _run_on_gpu(rank, world_size, tp, recompute):
    parallel = init_parallel(tp)
    device = torch.device("cuda", torch.cuda.current_device())
    tracker = model_parallel_seed(1234, parallel, device=device)
    model = _build(parallel, tracker, hidden_dropout=0.0, attention_dropout=0.0,
                   recompute_activations=recompute).to(device)  # fmt: skip
    batch = {k: v.to(device) for k, v in make_batch(b=2, seed=7).items()}
    return _step(model, parallel, batch)


@pytest.mark.parametrize("recompute", [False, True])
def test_tp2_over_nccl_equals_tp1(recompute):
    require_gpus(2)
    (tp1,) = run_distributed(_run_on_gpu, 1, 1, recompute, backend="nccl", timeout=600)
    _assert_matches(tp1, run_distributed(_run_on_gpu, 2, 2, recompute, backend="nccl",
                                         timeout=600))  # fmt: skip

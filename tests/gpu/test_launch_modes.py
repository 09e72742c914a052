"""The documented modes that crashed before issue 28, on a real GPU (their CPU tests:
tests/distributed/test_engine_device.py, tests/unit/test_sampling.py,
tests/unit/test_parallel_single.py):

* one GPU per task (srun --gpus-per-task=1): a rank whose LOCAL_RANK is 1 sees one GPU, index
  0; DeepSpeed's engine (ZeRO-1 and ZeRO-3, whose zero.Init reads LOCAL_RANK) must use it;
* SAS's sampler under torch.use_deterministic_algorithms(True) (--deterministic): no
  floating-point cumsum, and the same draws as on CPU;
* a checkpoint written on CPU resumed on a GPU: the tracker's CPU generator state is not fed
  to the CUDA generator; the stream keeps its seed and forks.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import require_gpus, run_in_process


def _one_gpu_per_task(stage: int) -> str:
    os.environ.update(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0")[:1],
                      LOCAL_RANK="1", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")  # fmt: skip
    from tests.helpers import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    from torch import nn

    from megatron_taco.training.config import TrainingConfig
    from megatron_taco.training.deepspeed_config import (
        load_deepspeed_json,
        resolve_deepspeed_config,
    )
    from megatron_taco.training.engine import (
        destroy_distributed,
        init_distributed,
        initialize_engine,
    )

    parallel = init_distributed(1)
    training = TrainingConfig(train_iters=1, micro_batch_size=2, global_batch_size=2, lr=1e-3)
    ds_json = load_deepspeed_json(f"ds_configs/zero{stage}_bf16.json")
    settings = resolve_deepspeed_config(training, 1, device_type="cuda", ds_json=ds_json)
    engine = initialize_engine(nn.Linear(64, 64), training, settings, parallel).model_engine
    loss = engine(torch.randn(2, 64, device=engine.device, dtype=torch.bfloat16)).float().sum()
    engine.backward(loss)
    engine.step()
    device = str(engine.device)
    engine.destroy()
    destroy_distributed(parallel)
    return device


@pytest.mark.parametrize("stage", [1, 3])
def test_one_gpu_per_task_trains_on_its_device(stage):
    require_gpus(1)
    assert run_in_process(_one_gpu_per_task, stage) == "cuda:0"


def test_sas_sampler_runs_deterministic_on_cuda_and_draws_what_cpu_draws():
    require_gpus(1)
    from megatron_taco.parallel.sampling import vocab_parallel_sample

    logits = torch.randn(4096, 30528, generator=torch.Generator().manual_seed(0))
    kwargs = dict(vocab_size=30522, row_keys=torch.arange(4096) * 7919, seed=3,
                  exclude_ids=torch.tensor([0, 100, 101, 102, 103]))  # fmt: skip
    torch.use_deterministic_algorithms(True)
    try:
        on_gpu = vocab_parallel_sample(logits.cuda().bfloat16(), None, **kwargs)
    finally:
        torch.use_deterministic_algorithms(False)
    on_cpu = vocab_parallel_sample(logits.bfloat16(), None, **kwargs)
    # float32 exp on two devices may differ in the last bit: a draw moves only when its
    # uniform falls within that of a CDF boundary.
    assert (on_gpu.cpu() != on_cpu).sum().item() <= 2


def test_a_cpu_checkpoint_resumes_on_the_gpu():
    require_gpus(1)
    from megatron_taco.checkpoint.rng import get_rng_states, set_rng_states
    from megatron_taco.parallel.random import MODEL_PARALLEL_RNG, RNGTracker

    on_cpu = RNGTracker("cpu")
    on_cpu.add(MODEL_PARALLEL_RNG, 11)
    saved = get_rng_states(on_cpu)
    saved["cuda"] = None  # as a CPU-only machine writes it
    on_gpu = RNGTracker(torch.device("cuda", torch.cuda.current_device()))
    on_gpu.add(MODEL_PARALLEL_RNG, 11)
    with on_gpu.fork():
        want = torch.rand(4, device="cuda")
    on_gpu.reset()  # a fresh run: the stream seeded again, then the CPU checkpoint loaded
    on_gpu.add(MODEL_PARALLEL_RNG, 11)
    set_rng_states(saved, on_gpu)
    with on_gpu.fork():
        assert torch.equal(torch.rand(4, device="cuda"), want)

"""The device ordinal DeepSpeed is given, with one GPU per task (``srun --gpus-per-task=1``).

Each rank sees one device (index 0) whatever its LOCAL_RANK. Two gloo ranks build real
DeepSpeed engines (ZeRO-1, and ZeRO-3, whose zero.Init reads the ordinal from LOCAL_RANK) on
an accelerator patched to have one device and to refuse any other ordinal, as CUDA does with
"invalid device ordinal". Without the project's device handed to DeepSpeed, rank 1 fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from megatron_taco.parallel.state import cuda_device_index, init_parallel
from megatron_taco.training.config import TrainingConfig
from megatron_taco.training.deepspeed_config import load_deepspeed_json, resolve_deepspeed_config
from megatron_taco.training.engine import initialize_engine, release_engine
from tests.helpers import run_distributed

DS_CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"


class OneDeviceAccelerator:
    """What a CUDA accelerator that sees one GPU answers; ordinals >= 1 raise."""

    def __init__(self) -> None:
        self.current = 0
        self.asked: list[int] = []

    def check(self, index) -> None:
        if isinstance(index, torch.device):
            index = index.index
        if index is None:
            return
        self.asked.append(int(index))
        if int(index) >= 1:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")

    def patch(self, monkeypatch, accelerator) -> None:
        real_name = accelerator.device_name

        def device_name(index=None):
            self.check(index)
            return real_name(index)

        def set_device(index):
            self.check(index)
            if isinstance(index, torch.device):  # device_name() is 'cpu' here: no index
                index = self.current if index.index is None else index.index
            self.current = int(index)

        monkeypatch.setattr(accelerator, "device_count", lambda: 1)
        monkeypatch.setattr(accelerator, "current_device", lambda: self.current)
        monkeypatch.setattr(accelerator, "set_device", set_device)
        monkeypatch.setattr(accelerator, "device_name", device_name)


def _worker(rank, world_size, stage):
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    fake = OneDeviceAccelerator()
    with pytest.MonkeyPatch.context() as monkeypatch:
        fake.patch(monkeypatch, accelerator)
        # What init_distributed's set_cuda_device chooses before the process group.
        accelerator.set_device(cuda_device_index(int(os.environ["LOCAL_RANK"]), 1, None))
        parallel = init_parallel(1)
        training = TrainingConfig(
            train_iters=1, micro_batch_size=2, global_batch_size=2 * world_size, lr=1e-3
        )
        ds_json = load_deepspeed_json(str(DS_CONFIGS / f"zero{stage}_fp32.json"))
        settings = resolve_deepspeed_config(
            training, world_size, device_type="cpu", ds_json=ds_json
        )
        torch.manual_seed(0)
        engine = initialize_engine(nn.Linear(8, 8), training, settings, parallel)
        release_engine(engine)
        parallel.destroy()
    return os.environ["LOCAL_RANK"], sorted(set(fake.asked))


@pytest.mark.parametrize("stage", [1, 3])
def test_one_gpu_per_task_gets_device_zero(stage):
    results = run_distributed(_worker, 2, stage)
    # LOCAL_RANK keeps the launcher's value; every ordinal DeepSpeed asked for was 0.
    assert results == [("0", [0]), ("1", [0])]

"""What DeepSpeed makes of the shipped bf16 configs, read from real engines over a real gloo
group (not from the JSON): gradients are accumulated over micro-batches and averaged over
the data-parallel ranks in fp32 at ZeRO 1-3, as Megatron-LM does. ZeRO-0 bf16 averages in
fp32 but accumulates in bf16: DeepSpeed refuses fp32 accumulation without ZeRO
(ds_configs/README.md; the driver warns when such a run accumulates)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_taco.training.config import TrainingConfig
from megatron_taco.training.deepspeed_config import load_deepspeed_json, resolve_deepspeed_config
from tests.helpers import REPO, run_distributed

# Per rank, per micro-batch: the gradient of the one weight. DeepSpeed scales each by 1/2
# (two micro-batches). In bf16, 0.5 + 2^-10 is 0.5 (its spacing at 0.5 is 2^-8), and the
# ranks' sum 0.5 + 2^-10 + 2^-8 rounds to 0.5 + 2^-8; in fp32 both are exact.
GRADS = {0: (1.0, 2.0**-9), 1: (2.0**-7, 0.0)}
FP32 = (0.5 + 2**-10 + 2**-8) / 2  # the averaged, accumulated gradient in fp32
BF16_ACCUMULATED = (0.5 + 2**-8) / 2  # r0's micro-batches summed in bf16, averaged in fp32


class Weight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, batch):
        return {"loss": (self.w * batch["x"]).sum()}


def _engine_view(rank, world, stage):
    from megatron_taco.parallel.state import init_parallel
    from megatron_taco.training.engine import initialize_engine

    parallel = init_parallel(1)
    training = TrainingConfig(train_iters=2, micro_batch_size=1, global_batch_size=2 * world,
                              lr=1e-3, lr_warmup_iters=0, clip_grad=0.0)  # fmt: skip
    ds_json = load_deepspeed_json(str(REPO / "ds_configs" / f"zero{stage}_bf16.json"))
    settings = resolve_deepspeed_config(training, world, device_type="cpu", ds_json=ds_json)
    ds = initialize_engine(Weight(), training, settings, parallel).model_engine
    for micro in range(2):
        x = torch.tensor([GRADS[rank][micro]], dtype=torch.bfloat16)
        ds.backward(ds({"x": x})["loss"])
        ds.step()
    norm = ds.get_global_grad_norm()
    model_dtype, accum_dtype = ds.get_data_types()
    return ds.communication_data_type, accum_dtype, model_dtype, float(norm)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_bf16_accumulates_and_averages_in_fp32(stage):
    for comm, accum, model, norm in run_distributed(_engine_view, 2, stage):
        assert (comm, accum, model) == (torch.float32, torch.float32, torch.bfloat16)
        assert norm == FP32


def test_zero0_bf16_averages_in_fp32_and_accumulates_in_bf16():
    for comm, accum, model, norm in run_distributed(_engine_view, 2, 0):
        assert (comm, accum, model) == (torch.float32, torch.bfloat16, torch.bfloat16)
        assert norm == BF16_ACCUMULATED

"""The logged gradient norm under fp16 is the unscaled one. DeepSpeed's FP16_UnfusedOptimizer
(fp16 at ZeRO-0 around torch's AdamW: every GPU node without apex) reports the norm of the
gradients still multiplied by the loss scale. DeepSpeed refuses fp16 engines on CPU, so the
real optimizer wrapper is built directly here, on CPU fp16 tensors; tests/gpu runs the
engine (test_zero_matrix.py)."""

from __future__ import annotations

import math

import torch

from tests.helpers import run_distributed

SCALE = 2.0**10  # 13 * 2^10 fits fp16 (65504 max); 2^16, the default start, would not


def _norms(rank, world):
    import deepspeed
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from megatron_taco.training.engine import unscaled_grad_norm

    deepspeed.init_distributed(dist_backend="gloo")
    w = torch.nn.Parameter(torch.tensor([0.5, -2.0, 1.0], dtype=torch.float16))
    adam = torch.optim.AdamW([w], lr=1e-3)
    opt = FP16_UnfusedOptimizer(adam, static_loss_scale=SCALE, clip_grad=1.0, verbose=False)
    x = torch.tensor([3.0, 4.0, 12.0], dtype=torch.float16)
    opt.backward((w * x).sum())  # d loss / dw = x: norm 13, scaled 13 * 2^10, exact in fp16
    scale = float(opt.loss_scale)  # what the loop reads before the step
    opt.step()
    reported = float(opt._global_grad_norm)
    return reported, unscaled_grad_norm(opt, reported, scale), unscaled_grad_norm(adam, 7.0, SCALE)


def test_fp16_unfused_optimizer_norm_is_unscaled():
    ((reported, logged, other),) = run_distributed(_norms, 1)
    assert math.isclose(reported, 13.0 * SCALE, rel_tol=1e-6)  # DeepSpeed's: scaled
    assert math.isclose(logged, 13.0, rel_tol=1e-6)
    assert other == 7.0  # wrappers that report the unscaled norm are left alone

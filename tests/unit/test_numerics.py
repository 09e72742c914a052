"""--tf32 (on by default) and --deterministic: set process-wide by the driver before the
model is built (every run of a sweep sets them again). The same runs check that a
checkpoint records its Adam implementation."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_taco.training.config import TrainingConfig
from tests.helpers import run_distributed


def _state():
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.deterministic,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )


def _apply_twice(rank, world):
    from megatron_taco.training.engine import apply_numerics

    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    base = dict(train_iters=1, lr_warmup_iters=0)
    apply_numerics(TrainingConfig(**base, deterministic=True, tf32=False))
    strict = _state()
    apply_numerics(TrainingConfig(**base))
    return strict, _state()


def test_apply_numerics_sets_and_resets_the_process_state():
    ((strict, default),) = run_distributed(_apply_twice, 1)
    assert strict == (True, False, True, ":4096:8")
    # The next run of a sweep without the flags: fast kernels again (the cuBLAS variable
    # stays: it only fixes a workspace size).
    assert default == (False, True, False, ":4096:8")


def _during_build(rank, world, args):
    from megatron_taco.recipes.taco import SPEC
    from megatron_taco.training.configure import build_parser, configs_from_args
    from megatron_taco.training.driver import run as pretrain

    seen = []

    def build(ctx, recipe=SPEC.build):
        seen.append(_state())
        return recipe(ctx)

    spec = dataclasses.replace(SPEC, build=build)
    cfg = configs_from_args(spec, build_parser(spec).parse_args(args), world_size=world,
                                 device_type="cpu")  # fmt: skip
    assert pretrain(cfg, spec, keep_process_group=True) == 0
    from megatron_taco.checkpoint.manifest import read_metadata

    return seen, read_metadata(os.path.join(cfg.checkpoint.save, "iter_0000001"))["optimizer"]


@pytest.mark.parametrize("flags", [(), ("--deterministic", "--no-tf32")])
def test_the_driver_applies_them_before_the_model_is_built(flags, botchan_dataset, tmp_path):
    args = [
        "--model-size", "tiny", "--seq-length", "32", "--data-path", botchan_dataset["prefix"],
        "--tokenizer-model", botchan_dataset["tokenizer"], "--data-cache-path",
        str(tmp_path / "cache"), "--split", "80,10,10", "--micro-batch-size", "2",
        "--train-iters", "1", "--lr-warmup-iters", "0", "--eval-iters", "0",
        "--no-progress-bar", "--save", str(tmp_path / "ckpt"), *flags,
    ]  # fmt: skip
    ((seen, optimizer),) = run_distributed(_during_build, 1, args)
    assert optimizer == "torch.optim.AdamW"  # recorded for the resume check
    deterministic = bool(flags)
    assert seen == [(deterministic, not flags, deterministic, ":4096:8" if flags else None)]

"""The first thing a GPU cluster runs: tiny TACO at tensor parallel 2 over NCCL with
zero2_bf16 through the real deepspeed launcher, 20 iterations, a checkpoint at 10, and a
resume from it. With --deterministic the resumed iterations log the same losses bitwise
(README's promise on GPUs); without it they are close (atomics add in varying order).

Before the fixes of issue 20 the first of these stopped before its first step: CPU tensors
in the tensor-parallel all-reduces (parameter count, gradient norm), which NCCL refuses."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TACO_METRIC_KEYS, deepspeed, require_gpus, train_records

ITERS, SAVE_AT = 20, 10
# Without --deterministic: bf16 losses of a resume that adds in another order.
LOSS_RTOL = 2e-2


def _args(dataset, save, *extra):
    return [
        "--model-size", "tiny", "--seq-length", "64", "--tensor-model-parallel-size", "2",
        "--deepspeed-config", "ds_configs/zero2_bf16.json",
        "--data-path", dataset["prefix"], "--tokenizer-model", dataset["tokenizer"],
        "--data-cache-path", str(dataset["dir"] / "cache"), "--split", "80,10,10",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(ITERS),
        "--lr", "1e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "1", "--save", str(save), "--save-interval", str(SAVE_AT), *extra,
    ]  # fmt: skip


def _full_and_resumed(dataset, tmp_path, *extra):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    out = deepspeed("pretrain_taco.py", *_args(dataset, full, *extra), num_gpus=2, timeout=900)
    assert "world size 2 = tensor parallel 2 x data parallel 1  (accelerator: cuda)" in out.stdout
    assert "ZeRO stage 2 | precision bf16" in out.stdout
    res = deepspeed("pretrain_taco.py", *_args(dataset, resumed, *extra), "--load", str(full),
                    "--ckpt-step", str(SAVE_AT), num_gpus=2, timeout=900)  # fmt: skip
    assert f"resumed from {full} at iteration {SAVE_AT}" in res.stdout
    return full, train_records(full / "metrics.jsonl"), train_records(resumed / "metrics.jsonl")


def test_tp2_nccl_zero2_bf16_resume_is_bitwise_with_deterministic(
    botchan_dataset, tmp_path, record_property
):
    require_gpus(2)
    full_dir, full, resumed = _full_and_resumed(botchan_dataset, tmp_path, "--deterministic")
    assert sorted(full) == list(range(1, ITERS + 1))
    assert sorted(resumed) == list(range(SAVE_AT + 1, ITERS + 1))
    assert all(torch.isfinite(torch.tensor(full[i]["loss"])) for i in full)
    record_property("loss_first_last", (round(full[1]["loss"], 4), round(full[ITERS]["loss"], 4)))
    record_property("tokens_per_s", round(full[ITERS].get("tokens_per_s", 0.0)))
    # MFU in the log where the data sheet knows the GPU (training/observability/peaks.py).
    from megatron_taco.training.observability.peaks import gpu_bf16_peak

    if gpu_bf16_peak(torch.cuda.get_device_name(0)) is not None:
        assert 0 < full[ITERS]["mfu"] < 1
        record_property("mfu", round(full[ITERS]["mfu"], 4))
    for it in resumed:
        for key in (*TACO_METRIC_KEYS, "lr", "grad_norm"):
            assert resumed[it][key] == full[it][key], (it, key)
    # The RNG file holds this rank's own GPU's generator, one state.
    states = torch.load(full_dir / f"iter_{SAVE_AT:07d}" / "rng_state_rank_00001.pt",
                        weights_only=True)  # fmt: skip
    assert torch.is_tensor(states["cuda"]) and states["cuda"].dtype == torch.uint8


def test_tp2_nccl_zero2_bf16_resume_is_close_without_deterministic(botchan_dataset, tmp_path):
    require_gpus(2)
    _, full, resumed = _full_and_resumed(botchan_dataset, tmp_path)
    for it in resumed:
        assert resumed[it]["loss"] == pytest.approx(full[it]["loss"], rel=LOSS_RTOL), it

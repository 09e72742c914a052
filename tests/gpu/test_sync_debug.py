"""Host-device synchronisations per training micro-batch on the GPU, counted by CUDA's own
sync debug mode (torch.cuda.set_sync_debug_mode("warn"): a warning at every synchronising
call) over the real driver for TACO, SAS and SAS^DA with zero1_bf16, and TACO with
zero2_bf16 and zero3_bf16: from the model's forward to the end of the micro-batch's callbacks
(SAS's store write included). The steady-state micro-batch that does not end a step must
have none but DeepSpeed's own at the end of a ZeRO-2 (overlap_comm) or ZeRO-3 backward
(ds_configs/README.md); the counts of every micro-batch go into the report. tests/unit/test_host_sync.py checks the same on CPU with a
dispatch mode."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import require_gpus, run_in_process


def _syncs_per_micro_batch(spec_name, args):
    import traceback
    import warnings

    import torch

    from megatron_taco.recipes import sas, taco
    from megatron_taco.training.callbacks import Callback
    from megatron_taco.training.configure import build_parser, configs_from_args
    from megatron_taco.training.driver import run as pretrain

    spec = {"TACO": taco.SPEC, "SAS": sas.SPEC}[spec_name]
    found: list[str] = []
    per_micro: list[list[str]] = []

    def where() -> str:
        for frame in reversed(traceback.extract_stack()):
            if "/megatron_taco/" in frame.filename or "/deepspeed/" in frame.filename:
                return f"{frame.filename.rpartition('site-packages/')[2]}:{frame.lineno}"
        return "?"

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            found.append(where())

    def start(module, inputs):
        found.clear()
        torch.cuda.set_sync_debug_mode("warn")

    class End(Callback):
        name = "end_of_micro_batch"

        def on_train_start(self, trainer, state):
            trainer.model_engine.module.register_forward_pre_hook(start)

        def after_micro_batch(self, trainer, state, batch, outputs):
            if trainer.model_engine.module.training:
                torch.cuda.set_sync_debug_mode(0)
                per_micro.append(list(found))

    def build(ctx, recipe=spec.build):
        parts = recipe(ctx)
        parts.callbacks.append(End())
        return parts

    spec = dataclasses.replace(spec, build=build)
    cfg = configs_from_args(spec, build_parser(spec).parse_args(args), world_size=1,
                                 device_type="cuda")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_warning
        assert pretrain(cfg, spec, keep_process_group=True) == 0
    return per_micro


# DeepSpeed's own synchronisation at the end of each backward (ds_configs/README.md).
DEEPSPEED_SYNC = {1: None, 2: "runtime/zero/stage_1_and_2.py", 3: "runtime/zero/stage3.py"}


@pytest.mark.parametrize(
    "model,stage", [("taco", 1), ("sas", 1), ("sas_da", 1), ("taco", 2), ("taco", 3)]
)
def test_no_sync_inside_a_micro_batch(model, stage, botchan_dataset, tmp_path, record_property):
    require_gpus(1)
    args = [
        "--model-size", "tiny", "--seq-length", "64",
        "--data-path", botchan_dataset["prefix"], "--tokenizer-model", botchan_dataset["tokenizer"],
        "--data-cache-path", str(tmp_path / "cache"), "--split", "80,10,10",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
        "--lr", "1e-3", "--lr-warmup-iters", "0", "--eval-iters", "0", "--num-workers", "1",
        "--no-progress-bar", "--deepspeed-config", f"ds_configs/zero{stage}_bf16.json",
    ]  # fmt: skip
    if model != "taco":
        args += ["--save", str(tmp_path / "ckpt")]
    if model == "sas_da":
        args.append("--disentangled-attention")
    per_micro = run_in_process(_syncs_per_micro_batch, "TACO" if model == "taco" else "SAS", args)
    record_property("syncs_per_micro_batch", [len(m) for m in per_micro])
    assert len(per_micro) == 6  # 3 iterations x 2 micro-batches
    # Steady state (caches built), not a step boundary: micro-batches 3 and 5.
    steady = per_micro[2] + per_micro[4]
    allowed = DEEPSPEED_SYNC[stage]
    ours = [
        site for site in steady if allowed is None or not site.startswith(f"deepspeed/{allowed}")
    ]
    assert ours == [], per_micro

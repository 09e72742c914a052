"""A fine-tuning sweep runs one training after another in one process. On the GPU each run
must hand its memory back: after a run and the sweep's release_memory(), the memory
allocated is what it was before the next run started (no growth from run to run) and
within a few cuBLAS workspaces of the process's start."""

from __future__ import annotations

from tests.helpers import require_gpus, run_in_process

# cuBLAS keeps one workspace per handle and stream in the caching allocator (counted by
# memory_allocated), a few MiB each: what may stay after the first run.
WORKSPACES = 64 * 2**20
NO_GROWTH = 2**20


def _two_runs(prefix, tokenizer, tmp):
    import torch

    from megatron_taco.recipes.taco import SPEC
    from megatron_taco.training.configure import build_parser, configs_from_args
    from megatron_taco.training.driver import run as pretrain
    from megatron_taco.training.engine import release_memory

    spec = SPEC
    allocated = [torch.cuda.memory_allocated()]
    peaks = []
    for stage in (1, 2):
        args = ["--model-size", "tiny", "--seq-length", "64", "--data-path", prefix,
                "--tokenizer-model", tokenizer, "--data-cache-path", f"{tmp}/cache",
                "--split", "80,10,10", "--micro-batch-size", "4", "--train-iters", "3",
                "--lr", "1e-3", "--lr-warmup-iters", "0", "--eval-iters", "0",
                "--no-progress-bar", "--deepspeed-config", f"ds_configs/zero{stage}_bf16.json"]  # fmt: skip
        cfg = configs_from_args(spec, build_parser(spec).parse_args(args), world_size=1,
                                     device_type="cuda")  # fmt: skip
        torch.cuda.reset_peak_memory_stats()
        assert pretrain(cfg, spec, keep_process_group=True) == 0
        release_memory()  # what the sweep calls after each run
        peaks.append(torch.cuda.max_memory_allocated())
        allocated.append(torch.cuda.memory_allocated())
    return allocated, peaks


def test_a_two_run_sweep_returns_its_memory(botchan_dataset, tmp_path, record_property):
    require_gpus(1)
    (start, after_first, after_second), peaks = run_in_process(
        _two_runs, botchan_dataset["prefix"], botchan_dataset["tokenizer"], str(tmp_path)
    )
    record_property("allocated_MiB_start_run1_run2",
                    [round(x / 2**20, 2) for x in (start, after_first, after_second)])  # fmt: skip
    record_property("peak_MiB_per_run", [round(p / 2**20, 1) for p in peaks])
    assert after_second - after_first <= NO_GROWTH
    assert after_first - start <= WORKSPACES

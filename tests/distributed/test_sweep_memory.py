"""A fine-tuning sweep runs many trainings in one process (recipes/sweep.py: pretrain() with
keep_process_group=True, then release_memory()). After each run nothing of it may stay
reachable: DeepSpeed's ZeRO-1/2 gradient hooks used to keep every run's engine, model and
optimizer alive (on a GPU: its weights, Adam states and buckets), run after run."""

from __future__ import annotations

import dataclasses
import weakref

from tests.helpers import run_distributed


def _two_runs(rank, world, prefix, tokenizer, tmp):
    from megatron_taco.recipes.taco import SPEC, build_taco
    from megatron_taco.training.callbacks import Callback
    from megatron_taco.training.configure import build_parser, configs_from_args
    from megatron_taco.training.driver import run as pretrain
    from megatron_taco.training.engine import release_memory
    from megatron_taco.training.resilience.exit import ExitMonitor

    refs: dict[str, weakref.ref] = {}

    class Spy(Callback):
        name = "spy"

        def on_train_start(self, trainer, state):
            ds = trainer.model_engine
            objects = dict(engine=ds, model=ds.module, optimizer=ds.optimizer,
                           torch_optimizer=ds.basic_optimizer, scheduler=trainer.engine.scheduler)  # fmt: skip
            refs.update({k: weakref.ref(v) for k, v in objects.items()})

    def build(ctx):
        parts = build_taco(ctx)
        parts.callbacks.append(Spy())
        return parts

    spec = dataclasses.replace(SPEC, build=build)
    alive = []
    monitor = ExitMonitor()  # one for every run, as tools/finetune.py gives run_sweep
    for stage in (1, 2):
        args = ["--model-size", "tiny", "--seq-length", "32", "--data-path", prefix,
                "--tokenizer-model", tokenizer, "--data-cache-path", f"{tmp}/cache",
                "--split", "80,10,10", "--micro-batch-size", "2", "--global-batch-size", "4",
                "--lr", "1e-3", "--lr-warmup-iters", "0", "--train-iters", "1", "--eval-iters",
                "0", "--no-progress-bar", "--deepspeed-config",
                f"ds_configs/zero{stage}_fp32.json"]  # fmt: skip
        cfg = configs_from_args(
            spec, build_parser(spec).parse_args(args), world_size=world, device_type="cpu"
        )
        assert pretrain(cfg, spec, monitor=monitor, keep_process_group=True) == 0
        release_memory()  # what the sweep calls after each run
        alive.append(sorted(name for name, ref in refs.items() if ref() is not None))
    monitor.uninstall()
    return alive


def test_each_run_of_a_sweep_is_freed(botchan_dataset, tmp_path):
    results = run_distributed(
        _two_runs, 2, botchan_dataset["prefix"], botchan_dataset["tokenizer"], str(tmp_path)
    )
    assert results == [[[], []], [[], []]]

"""Signal to completed save: how long a rank needs, after SIGTERM (or SLURM's USR1 warning),
to finish its iteration, agree to stop and write a complete checkpoint, for TACO-base and
SAS-base.

    python -m benchmarks.bench_exit_save [--models taco,sas] [--seq-length 128]
        [--deepspeed-config ds_configs/zero1_fp32.json] [--repeats 2] [--results-json PATH]

One rank (plain python: a real gloo world of one), each model's base preset with BERT's
vocabulary (30522), the real DeepSpeed engine, training loop, exit-signal handler and
checkpoint writer (temporary directory, fsync, manifest, rename, tracker). After two warm-up
iterations a timer thread sends the process SIGTERM at a random point of an iteration; the
time from that os.kill() to the save's return is what a launcher or scheduler must allow.
The iteration and the save are timed beside it: their sum is the worst case (a signal just
after an iteration's check). The peer is DeepSpeed's per-node launcher, which SIGKILLs each
rank 30 s after its own SIGTERM: the goal is <= 30 s.

On a GPU the iteration is far shorter; the save is bound by the disk and grows with the
optimizer state per rank (ZeRO-1/2 split it over the data-parallel ranks; the model file is
written by data-parallel rank 0 of each tensor-parallel rank). The checkpoint size is
printed so the time can be scaled to another disk's write rate.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time

import torch

from benchmarks.harness.results import Result, write_results

VOCAB = 30522
LAUNCHER_GRACE_S = 30.0  # deepspeed.launcher.launch: SIGTERM, 30 s, SIGKILL


def taco_sample(seq: int, g: torch.Generator) -> dict:
    """One TACO micro-batch of 2 rows: an MLM row (15% tokens masked) and an MPM row."""
    ids = torch.randint(5, VOCAB, (2, seq), generator=g)
    pos = torch.arange(seq).repeat(2, 1)
    pick = torch.rand(2, seq, generator=g) < 0.15
    mlm = torch.where(pick[0], ids[0], -100)
    ids[0][pick[0]] = 4
    mpm = torch.where(pick[1], pos[1], -100)
    pos[1][pick[1]] = -1
    return dict(input_ids=ids, position_ids=pos, attention_mask=torch.ones(2, seq, dtype=torch.bool),
                mlm_labels=torch.stack([mlm, torch.full_like(mlm, -100)]),
                mpm_labels=torch.stack([torch.full_like(mpm, -100), mpm]))  # fmt: skip


def sas_sample(seq: int, g: torch.Generator) -> dict:
    from megatron_taco.models.sas.model import rtd_labels

    original = torch.randint(5, VOCAB, (1, seq), generator=g)
    pick = torch.rand(1, seq, generator=g) < 0.15
    ids = torch.where(pick, torch.randint(5, VOCAB, (1, seq), generator=g), original)
    mlm = torch.where(pick, original, -100)
    mask = torch.ones(1, seq, dtype=torch.bool)
    return dict(input_ids=ids, attention_mask=mask, mlm_labels=mlm,
                rtd_labels=rtd_labels(ids, mlm, mask))  # fmt: skip


class Batches(torch.utils.data.Dataset):
    """Item i is a whole micro-batch (micro-batch size 1, collated by taking it)."""

    def __init__(self, make, seq: int) -> None:
        self.make, self.seq = make, seq

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> dict:
        return self.make(self.seq, torch.Generator().manual_seed(i))


def build(kind: str, parallel, rng_tracker):
    if kind == "taco":
        from megatron_taco.models.taco.config import TacoConfig
        from megatron_taco.models.taco.model import TacoForPretraining

        return TacoForPretraining(
            TacoConfig.preset("base", vocab_size=VOCAB), parallel
        ), taco_sample
    from megatron_taco.models.sas.config import SasConfig
    from megatron_taco.models.sas.model import SasForPretraining

    model = SasForPretraining(SasConfig.preset("base", vocab_size=VOCAB), parallel, rng_tracker)
    return model, sas_sample


def one_run(kind: str, args, parallel, rng_tracker, save: str) -> dict:
    from megatron_taco.checkpoint.config import CheckpointConfig
    from megatron_taco.checkpoint.layout import TrainingState
    from megatron_taco.training.callbacks import Callback
    from megatron_taco.training.config import TrainingConfig
    from megatron_taco.training.deepspeed_config import (
        load_deepspeed_json,
        resolve_deepspeed_config,
    )
    from megatron_taco.training.engine import initialize_engine
    from megatron_taco.training.loop import Trainer
    from megatron_taco.training.observability.log import TrainingLogger
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor
    from megatron_taco.training.spec import ModelParts

    torch.manual_seed(0)
    model, make = build(kind, parallel, rng_tracker)
    training = TrainingConfig(train_iters=10_000, micro_batch_size=1, global_batch_size=1,
                              lr=1e-4, lr_warmup_iters=1, log_interval=10_000, eval_iters=0,
                              progress_bar=False)  # fmt: skip
    settings = resolve_deepspeed_config(training, 1, device_type="cpu",
                                        ds_json=load_deepspeed_json(args.deepspeed_config))  # fmt: skip
    engine = initialize_engine(model, training, settings, parallel)
    ends: list[float] = []

    class Clock(Callback):
        name = "clock"

        def after_micro_batch(self, trainer, state, batch, outputs):
            ends.append(time.monotonic())
            if len(ends) == args.warmup:  # SIGTERM somewhere in one of the next iterations
                step = ends[-1] - ends[-2]
                delay = random.uniform(0.0, step)
                threading.Timer(delay, kill).start()

    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    monitor = ExitMonitor(ExitConfig())
    monitor.install()
    logger = TrainingLogger(rank=0, train_iters=training.train_iters, progress_bar=False)
    parts = ModelParts(
        model=engine.model_engine.module,
        collate_fn=lambda items: items[0],
        train_dataset=Batches(make, args.seq_length),
        callbacks=[Clock()],
    )
    trainer = Trainer(
        engine,
        parallel,
        training,
        parts,
        logger,
        checkpoint=CheckpointConfig(save=save),
        seed=1,
        exit_monitor=monitor,
    )
    saves: list[tuple[float, float]] = []
    real_save = trainer.save

    def timed_save(state):
        start = time.monotonic()
        real_save(state)
        saves.append((start, time.monotonic()))

    trainer.save = timed_save
    try:
        trainer.train(TrainingState())
    finally:
        monitor.uninstall()
        logger.close()
    ((save_start, save_end),) = saves
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(save) for f in fs)
    iterations = [b - a for a, b in zip(ends, ends[1:])]
    return {
        "signal_to_saved_s": save_end - killed[0],
        "save_s": save_end - save_start,
        "iteration_s": statistics.median(iterations),
        "checkpoint_gb": size / 1e9,
        "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_exit_save",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
    )
    p.add_argument("--models", default="taco,sas")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--deepspeed-config", default="ds_configs/zero1_fp32.json")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="Iterations before the signal.")
    p.add_argument("--dir", default=None, help="Where to save (default: a temporary directory).")
    p.add_argument("--results-json", default=None)
    args = p.parse_args(argv)

    from megatron_taco.training.engine import init_distributed

    parallel = init_distributed(1)
    from megatron_taco.parallel.random import model_parallel_seed

    rng_tracker = model_parallel_seed(1, parallel, device="cpu")
    root = tempfile.mkdtemp(prefix="bench_exit_save-", dir=args.dir)
    rows, results = [], []
    try:
        for kind in args.models.split(","):
            runs = []
            for r in range(args.repeats):
                save = os.path.join(root, f"{kind}-{r}")
                runs.append(one_run(kind, args, parallel, rng_tracker, save))
                shutil.rmtree(save, ignore_errors=True)
            med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            worst = med["iteration_s"] + med["save_s"]
            rows.append((kind, med, worst))
            name = {"taco": "TACO-base", "sas": "SAS-base"}[kind]
            note = (f"{name}, 1 rank, seq {args.seq_length}, {args.deepspeed_config}, "
                    f"{med['checkpoint_gb']:.2f} GB checkpoint; median of {args.repeats}")  # fmt: skip
            results += [
                Result(
                    "bench_exit_save.py",
                    f"{kind}_signal_to_saved_s",
                    med["signal_to_saved_s"],
                    LAUNCHER_GRACE_S,
                    "<=",
                    "s",
                    note,
                ),
                Result(
                    "bench_exit_save.py", f"{kind}_save_s", med["save_s"], None, "<=", "s", note
                ),
                Result(
                    "bench_exit_save.py",
                    f"{kind}_worst_case_s",
                    worst,
                    LAUNCHER_GRACE_S,
                    "<=",
                    "s",
                    note + " (one full iteration + the save)",
                ),
            ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nsignal -> completed save, 1 rank on {os.cpu_count()} CPU cores, seq "
          f"{args.seq_length}, {args.deepspeed_config}; median of {args.repeats}:")  # fmt: skip
    print(f"{'model':<6} {'params':>8} {'ckpt GB':>8} {'iter s':>8} {'save s':>8} "
          f"{'signal->saved s':>16} {'worst s':>8} {'vs 30 s':>8}")  # fmt: skip
    for kind, m, worst in rows:
        print(f"{kind:<6} {m['parameters_m']:>7.1f}M {m['checkpoint_gb']:>8.2f} "
              f"{m['iteration_s']:>8.2f} {m['save_s']:>8.2f} {m['signal_to_saved_s']:>16.2f} "
              f"{worst:>8.2f} {worst / LAUNCHER_GRACE_S:>7.2f}x")  # fmt: skip
    write_results(args.results_json, results)


if __name__ == "__main__":
    main()

"""The papers' fine-tuning protocols as sweeps: a queue of fine-tuning runs in one output
directory, and the table of their scores.

    taco-finetune --protocol sas --load ckpt/sas_small --task glue --data-dir glue_data \\
        --output runs/sas_small_glue

A sweep is tasks x grid x seeds; each run is an ordinary fine-tuning run in
OUTPUT/{task}/{config}-seed{seed}/. Runs go in a fixed order; one whose results.json says
finished is never run again, an interrupted one resumes from its checkpoint, so starting
the same command again (after a crash, a preemption, a requeue) continues the queue.
``--sweep-shard K --sweep-shards N`` runs every N-th run from the K-th (one SLURM array
task each: examples/slurm/finetune_sweep_array.sbatch). After its runs, every process that
ran a sweep rewrites OUTPUT/summary.{json,md} from all results.json found, so the table
always shows what has finished; OUTPUT/sweep.json records the seeds each task's
configurations should have, so the table tells a complete configuration from one whose
seeds have not all finished.

SAS (its appendix Table 6), for the GLUE tasks: learning rates {1e-4, 7.5e-5} (small) or
{7.5e-5, 5e-5} (base); batch sizes {16, 32}; 20 epochs with the best epoch for CoLA, MRPC,
STS-B, RTE (and WNLI), 4 epochs (the last) otherwise; 5 seeds for CoLA/MRPC/STS-B/RTE (and
WNLI), 3 for QNLI/SST-2, 1 for MNLI/QQP. Fixed (protocol_settings): warmup 0.1, linear decay
to 0, Adam eps 1e-6, betas (0.9, 0.999), no weight decay, head dropout 0.1, no layer-wise
decay. Reported: the mean over seeds of the configuration whose mean is best. Table 6 gives
epochs and seeds for GLUE only: another task needs --epoch-grid and --num-seeds.
TACO (its appendix Table 8): GLUE batch {16, 32} x lr {1e-5, 2e-5, 3e-5, 5e-5} x epochs
{3, 4, 5, 6}, weight decay 0.01; SQuAD batch 32 x lr {1e-5, 2e-5, 3e-5, 5e-5} x epochs
{2, 3, 4, 5}, weight decay 0.01; RACE batch 16, lr 1e-5, 6 epochs, weight decay 0.1;
5 seeds; reported: the median over seeds of the best configuration. The paper leaves
open (the command line's, by default our choices, docs/finetuning.md): warmup 0.1 of the
steps, linear decay, Adam eps 1e-6, dropout, the last epoch's scores.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
from dataclasses import dataclass
from typing import Any

from megatron_taco.arguments import option, require
from megatron_taco.errors import ConfigError
from megatron_taco.recipes.sweep_summary import show
from megatron_taco.tasks import TASKS
from megatron_taco.tasks.metrics import GLUE_SCORE_TASKS

# The folders of the GLUE distribution (download_glue_data.py).
GLUE_FOLDERS = {
    "cola": "CoLA",
    "sst2": "SST-2",
    "mrpc": "MRPC",
    "stsb": "STS-B",
    "qqp": "QQP",
    "mnli": "MNLI",
    "qnli": "QNLI",
    "rte": "RTE",
    "wnli": "WNLI",
}


@dataclass(frozen=True)
class SweepConfig:
    protocol: str | None = option(
        None,
        "Run a paper's fine-tuning protocol as a sweep over --task (one task, a comma list, "
        "or 'glue' for the 8 tasks of the GLUE score): 'sas' (its Table 6) or 'taco' (its "
        "Table 8); --output is then the sweep's directory.",
        flag="--protocol",
        choices=("sas", "taco"),
    )
    lrs: tuple[float, ...] | None = option(
        None, "Sweep: learning rates instead of the protocol's.", flag="--lrs"
    )
    batch_sizes: tuple[int, ...] | None = option(
        None, "Sweep: global batch sizes instead of the protocol's.", flag="--batch-sizes"
    )
    epoch_grid: tuple[int, ...] | None = option(
        None, "Sweep: epoch counts instead of the protocol's.", flag="--epoch-grid"
    )
    seeds: int | None = option(
        None, "Sweep: seeds per configuration instead of the protocol's.", flag="--num-seeds"
    )
    sweep_shard: int = option(
        0, "Sweep: run only every --sweep-shards-th run, from this one.", flag="--sweep-shard"
    )
    sweep_shards: int = option(1, "Sweep: number of shards.", flag="--sweep-shards")

    def __post_init__(self) -> None:
        cls = SweepConfig
        require(self.sweep_shards >= 1, cls, "sweep_shards", "must be >= 1")
        require(
            0 <= self.sweep_shard < self.sweep_shards,
            cls,
            "sweep_shard",
            f"must be in [0, --sweep-shards {self.sweep_shards})",
        )
        for name in ("lrs", "batch_sizes", "epoch_grid"):
            values = getattr(self, name)
            if values is not None:
                require(all(v > 0 for v in values), cls, name, "values must be > 0")
        if self.seeds is not None:
            require(self.seeds >= 1, cls, "seeds", "must be >= 1")

    @property
    def is_sweep(self) -> bool:
        return self.protocol is not None or any(
            v is not None for v in (self.lrs, self.batch_sizes, self.epoch_grid, self.seeds)
        )


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: the flags it sets on top of the command line's. ``fixed`` holds
    the settings its protocol fixes besides the grid (namespace dest, value)."""

    task: str
    lr: float
    batch_size: int
    epochs: int
    seed: int
    selection: str
    fixed: tuple[tuple[str, Any], ...] = ()

    @property
    def config_name(self) -> str:
        return f"lr{self.lr:g}-bs{self.batch_size}-ep{self.epochs}"

    def directory(self, root: str) -> str:
        return os.path.join(root, self.task, f"{self.config_name}-seed{self.seed}")


_SAS_SMALL_TASKS = ("cola", "mrpc", "stsb", "rte", "wnli")
_SAS_SEEDS = {"qnli": 3, "sst2": 3, "mnli": 1, "qqp": 1}
# Table 6's fixed rows, as the fine-tuning flags' dests. Linear decay means to 0 at the
# run's end (no --min-lr, no --lr-decay-iters); its "Dropout 0.1" is the head's here: the
# encoder keeps its checkpoint's dropout (fine-tuning has no flag for it; run_sweep warns
# when that is not 0.1).
_SAS_FIXED = {
    "lr_warmup_fraction": 0.1,
    "lr_warmup_iters": None,
    "lr_decay_style": "linear",
    "min_lr": 0.0,
    "lr_decay_iters": None,
    "adam_eps": 1e-6,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "weight_decay": 0.0,
    "layerwise_lr_decay": None,
    "classifier_dropout": 0.1,
}
SAS_DROPOUT = 0.1


def protocol_grid(protocol: str | None, task: str, model_size: str | None, kind: str):
    """(lrs, batch sizes, epochs, seeds, selection) of a protocol for a task, None where the
    protocol gives no value for the task; None without a protocol."""
    if protocol == "sas":
        lrs = (7.5e-5, 5e-5) if model_size == "base" else (1e-4, 7.5e-5)
        if task not in GLUE_FOLDERS:  # Table 6's epochs and seeds are GLUE's
            return lrs, (16, 32), None, None, None
        small = task in _SAS_SMALL_TASKS
        return (
            lrs,
            (16, 32),
            (20 if small else 4,),
            5 if small else _SAS_SEEDS.get(task, 3),
            "best" if small else "last",
        )
    if protocol == "taco":
        lrs = (1e-5, 2e-5, 3e-5, 5e-5)
        if kind == "span":
            return lrs, (32,), (2, 3, 4, 5), 5, "last"
        if kind == "multiple_choice":
            return (1e-5,), (16,), (6,), 5, "last"
        return lrs, (16, 32), (3, 4, 5, 6), 5, "last"
    return None


def protocol_settings(protocol: str | None, kind: str) -> dict[str, Any]:
    """What a protocol fixes besides its grid (namespace dest -> value): all of Table 6's
    other rows for SAS; Table 8's weight decay for TACO, whose other settings the paper
    leaves open (they stay the command line's)."""
    if protocol == "sas":
        return dict(_SAS_FIXED)
    if protocol == "taco":
        return {"weight_decay": 0.1 if kind == "multiple_choice" else 0.01}
    return {}


def expand_tasks(spec: str) -> list[str]:
    names = []
    for name in spec.split(","):
        name = name.strip().lower()
        names += list(GLUE_SCORE_TASKS) if name == "glue" else [name]
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ConfigError(f"--task: unknown task {unknown[0]!r}; one of {sorted(TASKS)} or glue")
    return list(dict.fromkeys(names))


def task_data_dir(root: str, task: str) -> str:
    """A task's folder under a benchmark root (glue_data/CoLA), or the root itself."""
    for name in (GLUE_FOLDERS.get(task), task):
        if name and os.path.isdir(os.path.join(root, name)):
            return os.path.join(root, name)
    return root


def plan_runs(
    sweep: SweepConfig, tasks: list[str], args: argparse.Namespace, model_size: str | None
) -> list[RunSpec]:
    runs = []
    for task in tasks:
        kind = TASKS[task].kind
        grid = protocol_grid(sweep.protocol, task, model_size, kind)
        if grid is None:
            gbs = args.global_batch_size or args.micro_batch_size
            grid = ((args.lr,), (gbs,), (args.train_epochs,), 1, args.epoch_selection)
        lrs, sizes, epochs, seeds, selection = grid
        lrs, sizes = sweep.lrs or lrs, sweep.batch_sizes or sizes
        epochs, seeds = sweep.epoch_grid or epochs, sweep.seeds or seeds
        if epochs is None or seeds is None:
            raise ConfigError(
                f"--protocol {sweep.protocol}: its paper's table gives epochs and seeds for the "
                f"GLUE tasks only, not for task {task!r}; use --protocol taco, or give "
                "--epoch-grid and --num-seeds (and --lrs/--batch-sizes to replace the rest)"
            )
        fixed = tuple(protocol_settings(sweep.protocol, kind).items())
        for lr, bs, ep, s in itertools.product(lrs, sizes, epochs, range(seeds)):
            runs.append(
                RunSpec(task, lr, bs, ep, args.seed + s, selection or args.epoch_selection, fixed)
            )
    return runs


def _same(dest: str, a: Any, b: Any) -> bool:
    # Layer-wise decay 1.0 is no layer-wise decay.
    if dest == "layerwise_lr_decay":
        a, b = (None if v == 1.0 else v for v in (a, b))
    return a == b


def check_fixed_settings(
    protocol: str | None, runs: list[RunSpec], args: argparse.Namespace, parser
) -> str | None:
    """Refuse a command line that sets a flag its protocol fixes to another value (one line
    naming every such flag), and describe what the protocol sets. argparse cannot tell a
    flag given at its default from one left out: a value other than the flag's default was
    given, and is refused if it conflicts; a value at its default is replaced, as the
    returned line says."""
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    fixed: dict[str, Any] = {}
    conflicts: dict[str, Any] = {}
    for run in runs:
        for dest, value in run.fixed:
            given = getattr(args, dest)
            if not _same(dest, given, value) and not _same(dest, given, parser.get_default(dest)):
                conflicts[dest] = given
            fixed.setdefault(dest, value)
    if conflicts:
        table = {"sas": "the SAS paper's Table 6", "taco": "the TACO paper's Table 8"}[protocol]
        raise ConfigError(
            f"--protocol {protocol} fixes "
            + ", ".join(f"{flags[d]} {show(fixed[d])}" for d in conflicts)
            + f" ({table}); the command line gives "
            + ", ".join(f"{flags[d]} {show(v)}" for d, v in conflicts.items())
            + ": drop those flags, or drop --protocol and sweep with --lrs/--batch-sizes/"
            "--epoch-grid/--num-seeds"
        )
    if not fixed:
        return None
    return f"sweep: --protocol {protocol} fixes " + ", ".join(
        f"{flags[d]} {show(v)}" for d, v in fixed.items()
    )


def run_namespace(
    args: argparse.Namespace, run: RunSpec, root: str, data_parallel_size: int
) -> argparse.Namespace:
    """The command line of one run: the sweep's flags with the run's values. Its micro-batch
    is --micro-batch-size, or less where the run's global batch needs it (TACO's batch 16
    on 4 data-parallel ranks runs micro-batches of 4)."""
    ns = copy.copy(args)
    ns.task, ns.lr, ns.seed, ns.train_epochs = run.task, run.lr, run.seed, run.epochs
    ns.global_batch_size = run.batch_size
    per_rank, rest = divmod(run.batch_size, data_parallel_size)
    if per_rank == 0 or rest:
        raise ConfigError(
            f"--batch-sizes: the global batch {run.batch_size} of {run.config_name} is not a "
            f"multiple of the data-parallel size {data_parallel_size}"
        )
    ns.micro_batch_size = max(
        m for m in range(1, min(args.micro_batch_size, per_rank) + 1) if per_rank % m == 0
    )
    ns.epoch_selection = run.selection
    ns.data_dir = task_data_dir(args.data_dir, run.task)
    ns.output = run.directory(root)
    for dest, value in run.fixed:
        if not _same(dest, getattr(ns, dest), value):
            setattr(ns, dest, value)
    return ns

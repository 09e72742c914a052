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
always shows what has finished.

SAS (its appendix Table 6): learning rates {1e-4, 7.5e-5} (small) or {7.5e-5, 5e-5}
(base); 20 epochs with the best epoch for CoLA, MRPC, STS-B, RTE (and WNLI), 4 epochs
(the last) otherwise; 5 seeds for CoLA/MRPC/STS-B/RTE (and WNLI), 3 for QNLI/SST-2, 1 for
MNLI/QQP; batch 32, warmup 0.1, linear decay, Adam eps 1e-6, betas (0.9, 0.999), no weight
decay, dropout 0.1, no layer-wise decay. Reported: the mean over seeds of the learning
rate whose mean is best.
TACO (its appendix Table 8): GLUE batch {16, 32} x lr {1e-5, 2e-5, 3e-5, 5e-5} x epochs
{3, 4, 5, 6}, weight decay 0.01; SQuAD batch 32 x lr {1e-5, 2e-5, 3e-5, 5e-5} x epochs
{2, 3, 4, 5}, weight decay 0.01; RACE batch 16, lr 1e-5, 6 epochs, weight decay 0.1;
5 seeds; reported: the median over seeds of the best configuration. The paper leaves
open (our choice, docs/finetuning.md): warmup 0.1 of the steps, linear decay, Adam eps
1e-6, dropout 0.1, the last epoch's scores.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
from dataclasses import dataclass
from typing import Any

from megatron_taco.arguments import ConfigError, option, require

GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte")  # the score's 8
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
SUMMARY = "summary"


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
    """One run of a sweep: the flags it sets on top of the command line's."""

    task: str
    lr: float
    batch_size: int
    epochs: int
    seed: int
    selection: str
    weight_decay: float | None = None

    @property
    def config_name(self) -> str:
        return f"lr{self.lr:g}-bs{self.batch_size}-ep{self.epochs}"

    def directory(self, root: str) -> str:
        return os.path.join(root, self.task, f"{self.config_name}-seed{self.seed}")


_SAS_SMALL_TASKS = ("cola", "mrpc", "stsb", "rte", "wnli")
_SAS_SEEDS = {"qnli": 3, "sst2": 3, "mnli": 1, "qqp": 1}


def protocol_grid(protocol: str | None, task: str, model_size: str | None, kind: str):
    """(lrs, batch sizes, epochs, seeds, selection, weight decay) of a protocol for a task;
    without a protocol the command line's values make a one-point grid."""
    if protocol == "sas":
        lrs = (7.5e-5, 5e-5) if model_size == "base" else (1e-4, 7.5e-5)
        small = task in _SAS_SMALL_TASKS
        return (lrs, (32,), (20 if small else 4,), 5 if small else _SAS_SEEDS.get(task, 3),
                "best" if small else "last", 0.0)  # fmt: skip
    if protocol == "taco":
        lrs = (1e-5, 2e-5, 3e-5, 5e-5)
        if kind == "span":
            return lrs, (32,), (2, 3, 4, 5), 5, "last", 0.01
        if kind == "multiple_choice":
            return (1e-5,), (16,), (6,), 5, "last", 0.1
        return lrs, (16, 32), (3, 4, 5, 6), 5, "last", 0.01
    return None


def expand_tasks(spec: str) -> list[str]:
    from megatron_taco.tasks import TASKS

    names = []
    for name in spec.split(","):
        name = name.strip().lower()
        names += list(GLUE_TASKS) if name == "glue" else [name]
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
    from megatron_taco.tasks import TASKS

    runs = []
    for task in tasks:
        grid = protocol_grid(sweep.protocol, task, model_size, TASKS[task].kind)
        if grid is None:
            gbs = args.global_batch_size or args.micro_batch_size
            grid = ((args.lr,), (gbs,), (args.train_epochs,), 1, args.epoch_selection, None)
        lrs, sizes, epochs, seeds, selection, wd = grid
        lrs, sizes = sweep.lrs or lrs, sweep.batch_sizes or sizes
        epochs, seeds = sweep.epoch_grid or epochs, sweep.seeds or seeds
        for lr, bs, ep, s in itertools.product(lrs, sizes, epochs, range(seeds)):
            runs.append(RunSpec(task, lr, bs, ep, args.seed + s, selection, wd))
    return runs


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
    if run.weight_decay is not None:
        ns.weight_decay = run.weight_decay
    return ns


def run_sweep(spec, args: argparse.Namespace, sweep: SweepConfig, monitor=None) -> int:
    """Every run of this shard that has not finished, in one set of processes (one process
    group for all of them), then the summary. Stops at the first run that is interrupted
    (an exit signal, a time limit): starting the command again continues from it."""
    from megatron_taco.recipes.finetune import model_size_of
    from megatron_taco.recipes.finetune_eval import read_results
    from megatron_taco.training.engine import (
        accelerator_name,
        destroy_distributed,
        launcher_world_size,
    )
    from megatron_taco.training.pretrain import pretrain

    root = args.output
    if not root:
        raise ConfigError("--output: the sweep's directory is required")
    tasks = expand_tasks(args.task or "")
    runs = plan_runs(sweep, tasks, args, model_size_of(args.load, args.ckpt_step))
    mine = runs[sweep.sweep_shard :: sweep.sweep_shards]
    world, device = launcher_world_size(), accelerator_name()
    features: dict[tuple, Any] = {}  # one tokenisation per task for all its runs
    status = 0
    try:
        for i, run in enumerate(mine):
            done = read_results(run.directory(root))
            if done is not None and done.get("finished"):
                continue
            dp = world // args.tensor_model_parallel_size
            cfg = spec.configs_from_args(
                run_namespace(args, run, root, dp), world_size=world, device_type=device
            )
            key = (cfg.data.task, cfg.data.data_dir, cfg.data.seq_length, cfg.data.tokenizer_model)
            if key not in features:
                features = {key: spec.load_features(cfg)}  # keep one task's at a time
            print(f"sweep: run {i + 1}/{len(mine)}: {run.directory(root)}", flush=True)
            status = pretrain(cfg, spec.for_run(cfg, features[key]), monitor=monitor,
                              keep_process_group=True)  # fmt: skip
            result = read_results(run.directory(root))
            if status != 0 or result is None or not result.get("finished"):
                print(f"sweep: stopped at {run.directory(root)} (not finished)", flush=True)
                break
    finally:
        destroy_distributed(None)
    if int(os.environ.get("RANK", "0")) == 0:
        table = write_summary(root, sweep.protocol)
        print(table, flush=True)
    return status


# ---------------------------------------------------------------------------------------
# The table


def _results(root: str) -> list[dict[str, Any]]:
    found = []
    for directory, _dirs, files in sorted(os.walk(root)):
        if "results.json" in files:
            with open(os.path.join(directory, "results.json"), encoding="utf-8") as f:
                result = json.load(f)
            result["directory"] = os.path.relpath(directory, root)
            found.append(result)
    return found


def _config_of(result: dict[str, Any]) -> str:
    h = result["hyperparameters"]
    return f"lr{h['lr']:g}-bs{h['global_batch_size']}-ep{h['epochs']}"


def _main_key(result: dict[str, Any]) -> str:
    """The main metric's key among a result's dev scores (split/metric for MNLI)."""
    main = result["main_metric"]
    return main if main in result["dev"] else f"{result.get('main_split')}/{main}"


def summarize(root: str, protocol: str | None = None) -> dict[str, Any]:
    """Per task: every configuration's mean (SAS protocol, and by default) or median (TACO
    protocol) over its finished seeds of every dev metric, and the best configuration by
    the task's main metric; plus the GLUE score when all 8 GLUE tasks are there."""
    from megatron_taco.tasks import glue_score

    aggregate = statistics.median if protocol == "taco" else statistics.fmean
    by_task: dict[str, dict[str, list[dict]]] = {}
    for result in _results(root):
        if result.get("finished"):
            by_task.setdefault(result["task"], {}).setdefault(_config_of(result), []).append(result)
    tasks = {}
    for task, configs in sorted(by_task.items()):
        rows = {}
        for config, results in configs.items():
            metrics = sorted(set.intersection(*(set(r["dev"]) for r in results)))
            rows[config] = {
                "seeds": len(results),
                "dev": {m: aggregate([r["dev"][m] for r in results]) for m in metrics},
                "main_metric": _main_key(results[0]),
            }
        main = next(iter(rows.values()))["main_metric"]
        best = max(rows, key=lambda c: rows[c]["dev"].get(main, float("-inf")))
        tasks[task] = {"best": best, **rows[best], "configs": rows}
    summary: dict[str, Any] = {
        "protocol": protocol,
        "aggregate": "median" if protocol == "taco" else "mean",
        "tasks": tasks,
    }
    if all(t in tasks for t in GLUE_TASKS):
        summary["glue_score"] = glue_score(
            {t: nested_scores(t, tasks[t]["dev"]) for t in GLUE_TASKS}
        )
    return summary


def nested_scores(task: str, flat: dict[str, float]) -> dict[str, dict[str, float]]:
    """results.json's flat dev scores -> {split: {metric: value}} (finetune_eval.flat_scores
    names a task's only split's metrics plainly, several splits' as split/metric)."""
    from megatron_taco.tasks import TASKS

    splits = TASKS[task].dev_splits
    if len(splits) == 1:
        return {splits[0]: dict(flat)}
    out: dict[str, dict[str, float]] = {s: {} for s in splits}
    for key, value in flat.items():
        split, _, metric = key.partition("/")
        out.setdefault(split, {})[metric] = value
    return out


def markdown_table(summary: dict[str, Any]) -> str:
    lines = [
        f"| task | best configuration | seeds | dev ({summary['aggregate']} over seeds) |",
        "|---|---|---|---|",
    ]
    for task, row in summary["tasks"].items():
        scores = ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["dev"].items()))
        lines.append(f"| {task} | {row['best']} | {row['seeds']} | {scores} |")
    if "glue_score" in summary:
        lines.append(
            f"| **GLUE score** (8 tasks, WNLI excluded) | | | {summary['glue_score']:.2f} |"
        )
    return "\n".join(lines)


def write_summary(root: str, protocol: str | None) -> str:
    from megatron_taco.recipes.finetune_eval import write_json_atomic, write_text_atomic

    summary = summarize(root, protocol)
    table = markdown_table(summary)
    os.makedirs(root, exist_ok=True)
    write_json_atomic(os.path.join(root, f"{SUMMARY}.json"), summary)
    write_text_atomic(os.path.join(root, f"{SUMMARY}.md"), table + "\n")
    return table


def sweep_from_args(args: argparse.Namespace) -> SweepConfig:
    from megatron_taco.arguments import dataclass_from_args

    return dataclass_from_args(SweepConfig, args)


__all__ = [
    "GLUE_TASKS",
    "RunSpec",
    "SweepConfig",
    "markdown_table",
    "plan_runs",
    "protocol_grid",
    "run_sweep",
    "summarize",
    "sweep_from_args",
    "write_summary",
]

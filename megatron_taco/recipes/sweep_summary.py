"""A sweep's records and its table: OUTPUT/sweep.json (the seeds each task's configurations
should have), every run's results.json read back, and OUTPUT/summary.{json,md} (the
protocol's statistic over seeds of each configuration, the best configuration per task,
the GLUE score) with the GLUE server's submission files collected.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from typing import Any

from megatron_taco import io
from megatron_taco.recipes.finetune_eval import RESULTS_FILE, SUBMISSION_DIR, write_json_atomic
from megatron_taco.tasks import TASKS, glue_score, glue_task_scores
from megatron_taco.tasks.metrics import GLUE_SCORE_TASKS as GLUE_TASKS

SUMMARY = "summary"
PLAN_FILE = "sweep.json"

_RESULT_KEYS = ("task", "finished", "dev", "main_metric", "hyperparameters")


def show(value: Any) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def write_plan(root: str, protocol: str | None, runs: list) -> None:
    """OUTPUT/sweep.json: the protocol and the seeds each task's configurations should have
    (merged with an earlier sweep's tasks in the same directory)."""
    plan = read_plan(root)
    seeds = plan.get("seeds", {})
    for task in dict.fromkeys(r.task for r in runs):
        first = next(r for r in runs if r.task == task)
        seeds[task] = sum(1 for r in runs if r.task == task and r.config_name == first.config_name)
    os.makedirs(root, exist_ok=True)
    write_json_atomic(os.path.join(root, PLAN_FILE), {"protocol": protocol, "seeds": seeds})


def read_plan(root: str) -> dict[str, Any]:
    try:
        with open(os.path.join(root, PLAN_FILE), encoding="utf-8") as f:
            plan = json.load(f)
    except (OSError, ValueError):
        return {}
    return plan if isinstance(plan, dict) and isinstance(plan.get("seeds", {}), dict) else {}


def read_result(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """A run's results.json, or None and what is wrong with it (one line naming it)."""
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path}: unreadable ({e})"
    except json.JSONDecodeError as e:
        return None, f"{path}: not valid JSON (truncated?): {e}"
    if not isinstance(result, dict):
        return None, f"{path}: not a JSON object"
    missing = [k for k in _RESULT_KEYS if k not in result]
    if missing:
        return None, f"{path}: no {missing[0]!r}: not a fine-tuning run's results.json"
    if not isinstance(result["hyperparameters"], dict) or not isinstance(result["dev"], dict):
        return None, f"{path}: 'hyperparameters' and 'dev' must be objects"
    return result, None


def _results(root: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Every readable results.json under root, and a warning line for each unreadable one
    (skipped: a directory of partly copied or foreign runs still gets its table)."""
    found, warnings = [], []
    for directory, _dirs, files in sorted(os.walk(root)):
        if RESULTS_FILE in files:
            result, problem = read_result(os.path.join(directory, RESULTS_FILE))
            if result is None:
                warnings.append(f"warning: skipped {problem}")
                continue
            result["directory"] = os.path.relpath(directory, root)
            found.append(result)
    return found, warnings


# Hyperparameters that do not change what a run computes (how it is laid out on devices),
# and the seed: runs differing only in these are seeds of one configuration.
_NOT_CONFIG = (
    "seed",
    "micro_batch_size",
    "zero_stage",
    "tensor_model_parallel_size",
    "data_parallel_size",
    "pad_to_seq_length",
)

_BASE = ("lr", "global_batch_size", "epochs")

_SHORT = {
    "weight_decay": "wd",
    "layerwise_lr_decay": "lld",
    "warmup_fraction": "warmup",
    "lr_decay_style": "decay-",
    "adam_eps": "eps",
    "adam_betas": "betas",
    "clip_grad": "clip",
    "seq_length": "seq",
    "classifier_dropout": "headdrop",
    "hidden_dropout": "drop",
    "precision": "",
    "load": "ckpt-",
    "iteration": "step",
    "selection": "sel-",
}


def _config_of(result: dict[str, Any]) -> dict[str, Any]:
    """Everything that makes a run's configuration: its hyperparameters but the seed (and
    the device layout), the pretrained checkpoint, and how its epoch was chosen."""
    config = {k: v for k, v in result["hyperparameters"].items() if k not in _NOT_CONFIG}
    if config.get("layerwise_lr_decay") == 1.0:
        config["layerwise_lr_decay"] = None
    config.setdefault("group_by_length", False)  # runs from before the flag
    pretrained = result.get("pretrained") or {}
    config["load"] = pretrained.get("load")
    config["iteration"] = pretrained.get("iteration")
    config["random_init"] = bool(pretrained.get("random_init"))
    config["selection"] = result.get("selection")
    return config


def _config_names(configs: list[dict[str, Any]]) -> list[str]:
    """lr{lr}-bs{batch}-ep{epochs}, plus only what differs between the configurations."""
    keys = sorted({k for c in configs for k in c} - set(_BASE))
    differing = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]

    def part(key: str, value: Any) -> str:
        if key == "random_init":
            return "random-init" if value else "pretrained"
        if key == "load" and value:
            value = os.path.basename(str(value).rstrip("/"))
        if isinstance(value, list):
            value = ",".join(show(v) for v in value)
        return f"{_SHORT.get(key, key + '-')}{show(value)}"

    names = []
    for c in configs:
        base = "-".join(f"{n}{show(c.get(k))}" for n, k in zip(("lr", "bs", "ep"), _BASE))
        names.append("-".join([base, *(part(k, c.get(k)) for k in differing)]))
    for i, name in enumerate(names):
        if names.count(name) > 1:  # e.g. two checkpoints of one basename
            names[i] = f"{name}-{i}"
    return names


def _seed_order(seed: Any) -> tuple:
    return (seed is None, seed if isinstance(seed, int) else 0, str(seed))


def summarize(
    root: str,
    protocol: str | None = None,
    *,
    aggregate: str | None = None,
    convention: str = "sas",
) -> dict[str, Any]:
    """Per task: every configuration's mean (SAS protocol, and by default) or median (TACO
    protocol) over its finished seeds of every dev metric, its seeds found and expected, and
    the best configuration by the task's main metric, among the complete ones where any is;
    plus the GLUE score (``convention``: metrics.glue_score's) when all 8 GLUE tasks are
    there. The expected seeds are the sweep's (sweep.json), or else the most any of the
    task's configurations has."""
    plan = read_plan(root)
    protocol = protocol or plan.get("protocol")
    aggregate = aggregate or ("median" if protocol == "taco" else "mean")
    reduce = statistics.median if aggregate == "median" else statistics.fmean
    found, warnings = _results(root)
    by_task: dict[str, list[dict]] = {}
    for result in found:
        if result["finished"]:
            by_task.setdefault(result["task"], []).append(result)
    tasks = {}
    for task, results in sorted(by_task.items()):
        configs: list[dict[str, Any]] = []
        groups: list[list[dict]] = []
        for result in results:
            config = _config_of(result)
            if config not in configs:
                configs.append(config)
                groups.append([])
            groups[configs.index(config)].append(result)
        seeds = [
            sorted({r["hyperparameters"].get("seed") for r in g}, key=_seed_order) for g in groups
        ]
        expected = plan.get("seeds", {}).get(task) or max(len(s) for s in seeds)
        rows = {}
        for name, group, found_seeds in zip(_config_names(configs), groups, seeds):
            metrics = sorted(set.intersection(*(set(r["dev"]) for r in group)))
            first = group[0]  # the main metric's key among its dev scores: split/metric for MNLI
            metric = first["main_metric"]
            main_key = metric if metric in first["dev"] else f"{first.get('main_split')}/{metric}"
            rows[name] = {
                "seeds": len(found_seeds),
                "seeds_expected": expected,
                "complete": len(found_seeds) >= expected,
                "seed_values": found_seeds,
                "dev": {m: reduce([r["dev"][m] for r in group]) for m in metrics},
                # DeBERTa's convention beside the protocol's aggregate: mean and sample
                # standard deviation over the seeds (no deviation from one seed, even when
                # it ran twice, e.g. at two tensor-parallel sizes: that spread is not a seed's)
                "dev_mean": {m: statistics.fmean([r["dev"][m] for r in group]) for m in metrics},
                "dev_std": {
                    m: statistics.stdev([r["dev"][m] for r in group])
                    if len(found_seeds) > 1
                    else None
                    for m in metrics
                },
                "main_metric": main_key,
                "directories": sorted(r["directory"] for r in group),
                # the seed with the best main metric (the run whose test files a sweep submits)
                "best_run": max(group, key=lambda r: _finite(r["dev"].get(main_key)))["directory"],
                "dev_by_run": {r["directory"]: r["dev"] for r in group},
            }
        main = next(iter(rows.values()))["main_metric"]
        candidates = [c for c in rows if rows[c]["complete"]] or list(rows)
        best = max(candidates, key=lambda c: rows[c]["dev"].get(main, float("-inf")))
        tasks[task] = {"best": best, **rows[best], "configs": rows}
        if not rows[best]["complete"]:
            warnings.append(
                f"warning: {task}: no configuration has all {expected} seeds; the best of the "
                f"incomplete ones, {best}, has {rows[best]['seeds']}"
            )
    summary: dict[str, Any] = {
        "protocol": protocol,
        "aggregate": aggregate,
        "convention": convention,
        "tasks": tasks,
        "warnings": warnings,
    }
    if all(t in tasks for t in GLUE_TASKS):
        _glue_score(summary, convention)
    return summary


def _finite(value: Any) -> float:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else -math.inf


def _glue_score(summary: dict[str, Any], convention: str) -> None:
    tasks = summary["tasks"]
    nested = {t: nested_scores(t, tasks[t]["dev"]) for t in GLUE_TASKS}
    try:
        summary["glue_score"] = glue_score(nested, convention)
    except ValueError as e:
        summary["warnings"].append(f"warning: no GLUE score: {e}")
        return
    summary["glue_task_scores"] = glue_task_scores(nested, convention)
    # The mean over seeds: the score of the tasks' seed means (it is linear in them). Its
    # standard deviation is that of the score of one seed per task, the tasks' seeds drawn
    # independently: sqrt(sum of the tasks' variances) / 8.
    means = {t: nested_scores(t, tasks[t]["dev_mean"]) for t in GLUE_TASKS}
    summary["glue_score_mean"] = glue_score(means, convention)
    # A task of one seed has no spread to add: a deviation summed without it would claim
    # less than is known (0.00 when every task has one seed), so there is none then.
    summary["glue_score_std"] = None
    if all(tasks[t]["seeds"] > 1 for t in GLUE_TASKS):
        variances = []
        for t in GLUE_TASKS:
            per_seed = [
                glue_task_scores({t: nested_scores(t, dev)}, convention)[t]
                for dev in tasks[t]["dev_by_run"].values()
            ]
            variances.append(statistics.variance(per_seed))
        summary["glue_score_std"] = math.sqrt(sum(variances)) / len(GLUE_TASKS)
    incomplete = [t for t in GLUE_TASKS if not tasks[t]["complete"]]
    if incomplete:
        summary["warnings"].append(
            "warning: the GLUE score uses incomplete configurations: "
            + ", ".join(
                f"{t} ({tasks[t]['seeds']}/{tasks[t]['seeds_expected']} seeds)" for t in incomplete
            )
        )


def nested_scores(task: str, flat: dict[str, float]) -> dict[str, dict[str, float]]:
    """results.json's flat dev scores -> {split: {metric: value}} (finetune_eval.flat_scores
    names a task's only split's metrics plainly, several splits' as split/metric)."""
    splits = TASKS[task].dev_splits
    if len(splits) == 1:
        return {splits[0]: dict(flat)}
    out: dict[str, dict[str, float]] = {s: {} for s in splits}
    for key, value in flat.items():
        split, _, metric = key.partition("/")
        out.setdefault(split, {})[metric] = value
    return out


_CONVENTIONS = {
    "sas": "SAS paper: STS-B mean of Pearson and Spearman, MNLI mean of m and mm",
    "electra": "ELECTRA: STS-B Spearman, MNLI matched",
}


def markdown_table(summary: dict[str, Any]) -> str:
    """The best configuration of every task, then notes: configurations missing seeds, and
    the summary's warnings (one line each)."""
    lines = [
        f"| task | best configuration | seeds | dev ({summary['aggregate']} over seeds) "
        "| mean ± std over seeds |",
        "|---|---|---|---|---|",
    ]
    for task, row in summary["tasks"].items():
        scores = ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["dev"].items()))
        spread = ", ".join(
            f"{k} {v:.2f} ± {show_std(row.get('dev_std', {}).get(k))}"
            for k, v in sorted(row.get("dev_mean", {}).items())
        )
        seeds = f"{row['seeds']}/{row['seeds_expected']}"
        seeds += "" if row["complete"] else " (incomplete)"
        lines.append(f"| {task} | {row['best']} | {seeds} | {scores} | {spread} |")
    if "glue_score" in summary:
        convention = summary["convention"]
        spread = ""
        if "glue_score_mean" in summary:
            spread = f"{summary['glue_score_mean']:.2f} ± {show_std(summary['glue_score_std'])}"
        lines.append(
            f"| **GLUE score** (8 tasks, WNLI excluded; {convention} convention: "
            f"{_CONVENTIONS.get(convention, convention)}) | | | {summary['glue_score']:.2f} "
            f"| {spread} |"
        )
    incomplete = [
        f"{task} {name} ({row['seeds']}/{row['seeds_expected']})"
        for task, t in summary["tasks"].items()
        for name, row in t["configs"].items()
        if not row["complete"]
    ]
    if incomplete:
        lines += ["", "Incomplete configurations (seeds found/expected): " + ", ".join(incomplete)]
    if summary["warnings"]:
        lines += ["", *summary["warnings"]]
    return "\n".join(lines)


def collect_submission(root: str, summary: dict[str, Any]) -> None:
    """OUTPUT/submission/: each task's GLUE server files (--predict-test) from the run of its
    best configuration with the best main dev score; summary["submission"] says which."""
    chosen = {}
    for task, row in summary["tasks"].items():
        source = os.path.join(root, row["best_run"], SUBMISSION_DIR)
        if not os.path.isdir(source):
            continue
        target = os.path.join(root, SUBMISSION_DIR)
        os.makedirs(target, exist_ok=True)
        for name in sorted(os.listdir(source)):
            if name.endswith(".tsv"):
                with open(os.path.join(source, name), encoding="utf-8") as f:
                    io.atomic_write(os.path.join(target, name), f.read())
        chosen[task] = row["best_run"]
    if chosen:
        summary["submission"] = chosen


def show_std(value: float | None) -> str:
    """A standard deviation over seeds, "-" where there is none (one seed)."""
    return "-" if value is None else f"{value:.2f}"


def write_summary(root: str, protocol: str | None) -> str:
    summary = summarize(root, protocol)
    collect_submission(root, summary)
    table = markdown_table(summary)
    os.makedirs(root, exist_ok=True)
    # Replaced whole: readers, and other writers (a sweep's array tasks on other nodes
    # rewrite the same summary), see the old file or the new one, never a mix.
    write_json_atomic(os.path.join(root, f"{SUMMARY}.json"), summary)
    io.atomic_write(os.path.join(root, f"{SUMMARY}.md"), table + "\n")
    return table

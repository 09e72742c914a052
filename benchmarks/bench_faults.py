"""A fault campaign: randomly placed faults, each job requeued until it finishes and compared
bit for bit with a run that never failed (issue 38).

    python -m benchmarks.bench_faults --trials 30 --seed 1 --out /tmp/faults [--results-json F]
    python -m benchmarks.bench_faults --replay /tmp/faults/trials/trial_0007
    python -m benchmarks.bench_faults --trial-seed 2851224 --out /tmp/faults
    python -m benchmarks.bench_faults --trials 8 --kinds kill_save,kill_point \\
        --bug tracker_before_files --out /tmp/faults_bug      # must report failures

Each trial draws, from its own seed, a model (TACO, SAS, SAS^DA: tiny presets on a tiny
corpus), a layout (dp 2 with ZeRO 0-3, tp 2 with ZeRO 0-1), DataLoader workers (0 or 1), a
launcher (deepspeed, torchrun, each alone or under taco-launch) and a fault
(benchmarks/faults/plan.py), sometimes a second one in the first restart. The job is then run
as a requeue runs it (the same command, --load = --save) until it finishes, at most
--max-attempts times, and compared with the configuration's reference run (cached in
OUT/references): every training and validation record of metrics.jsonl, every tensor of every
checkpoint both saved, the replacement store byte for byte, the tracker. Faults at a byte or
a code point are injected by a sitecustomize shim on the job's PYTHONPATH
(benchmarks/faults/shim), which also plants --bug; no product code is changed.

Writes OUT/summary.json (counts trials, exact, refused, differed, hung, lost_data, failures,
by fault kind and place, iterations lost, time to a running job again) and prints a table.
A trial that did not end exactly keeps its directory (trial.json with the command, seed and
faults; attempt logs; the run's files) and its replay command; exact ones keep trial.json and
result.json. Exit status 1 when any trial failed (see benchmarks/faults/verdict.py).
Outside `make test`: about a minute per trial on two cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks.faults.jobs import REPO, build_corpus
from benchmarks.faults.plan import KINDS, MODELS, TrialPlan, pick_trial, trial_seed
from benchmarks.faults.report import markdown, stops, summarize, table
from benchmarks.faults.trial import Limits, rescore, run_trial

BUGS = ("tracker_before_files", "tracker_before_metadata", "no_rng_restore")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--seed", type=int, default=0, help="the campaign's seed")
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "build" / "bench_faults",
        help="campaign directory: corpus, references, trials, summary.json",
    )
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds to draw from")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--bug", choices=BUGS, help="plant a deliberate bug in every trial's runs")
    p.add_argument("--replay", type=Path, help="run a kept trial again (its directory)")
    p.add_argument("--trial-seed", type=int, help="run the one trial of this seed")
    p.add_argument("--attempt-timeout", type=float, default=Limits.attempt_timeout)
    p.add_argument("--max-attempts", type=int, default=Limits.max_attempts)
    p.add_argument("--keep-all", action="store_true", help="keep the runs of exact trials too")
    p.add_argument(
        "--rescore",
        action="store_true",
        help="evaluate the kept trials in --out again (no runs), then summarize",
    )
    p.add_argument("--results-json", help="also write the results there (benchmarks/results.py)")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        p.error(f"--kinds: unknown {bad}; choose from {','.join(KINDS)}")
    args.kinds = kinds
    args.models = tuple(m for m in args.models.split(",") if m)
    if [m for m in args.models if m not in MODELS]:
        p.error(f"--models: choose from {','.join(MODELS)}")
    return args


def _run_one(plan: TrialPlan, trial_dir: Path, out: Path, limits: Limits, bug: str | None,
             keep: bool) -> dict:  # fmt: skip
    corpus = build_corpus(out / "corpus")
    started = time.time()
    result = run_trial(plan, corpus, trial_dir, out / "references", limits, bug)
    result.update(trial=trial_dir.name, replay=f"python -m benchmarks.bench_faults --replay "
                  f"{trial_dir}", wall_s=time.time() - started)  # fmt: skip
    (trial_dir / "result.json").write_text(json.dumps(result, indent=1))
    if result["outcome"] == "exact" and not result["failure"] and not keep:
        shutil.rmtree(trial_dir / "run", ignore_errors=True)
    return result


def _line(i: int, result: dict) -> str:
    lost = [x["lost"] for x in stops(result)]
    mark = "FAIL" if result["failure"] else "ok"
    return (f"[{i:4d}] {mark:4s} {result['outcome']:9s} {result['config']:34s} "
            f"{'; '.join(result['faults'])} lost={lost} ({result['wall_s']:.0f}s)")  # fmt: skip


def replay(args: argparse.Namespace, limits: Limits) -> int:
    saved = json.loads((args.replay / "trial.json").read_text())
    plan = TrialPlan.from_json(saved)
    campaign = args.replay.resolve().parent.parent  # its corpus and references
    target = args.replay / "replay"
    if target.exists():
        shutil.rmtree(target)
    result = _run_one(plan, target, campaign, limits, saved.get("bug"), keep=True)
    print(_line(0, result))
    print(json.dumps({k: result[k] for k in ("outcome", "reasons", "differences",
                                               "lost_data", "refusal_line")}, indent=1))  # fmt: skip
    return 1 if result["failure"] else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    limits = Limits(attempt_timeout=args.attempt_timeout, max_attempts=args.max_attempts)
    if args.replay is not None:
        return replay(args, limits)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.trial_seed is not None:
        seeds = [(f"seed_{args.trial_seed}", args.trial_seed)]
    else:
        n = len(args.kinds)
        seeds = [(f"trial_{i:04d}", trial_seed(args.seed, i, n)) for i in range(args.trials)]
    results, started = [], time.time()
    for i, (name, seed) in enumerate(seeds):
        trial_dir = out / "trials" / name
        done = trial_dir / "result.json"
        if done.is_file() and json.loads(done.read_text()).get("seed") == seed:
            result = json.loads(done.read_text())  # a campaign resumed: this trial ran
            if args.rescore and (trial_dir / "run").is_dir():
                result = rescore(trial_dir, out / "references")
        elif args.rescore:
            continue
        else:
            plan = pick_trial(seed, args.kinds, args.models)
            result = _run_one(plan, trial_dir, out, limits, args.bug, args.keep_all)
        results.append(result)
        print(_line(i, result), flush=True)
    summary = summarize(results, seed=args.seed, bug=args.bug, kinds=list(args.kinds),
                        seconds=time.time() - started)  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "table.md").write_text(markdown(summary) + "\n")
    print(table(summary))
    if args.results_json:
        write_results(args.results_json, summary)
    return 1 if summary["failures"] else 0


def write_results(path: str, summary: dict) -> None:
    from benchmarks.harness.results import Result, write_results

    n = max(summary["trials"], 1)
    lost, recovery = summary["iterations_lost_per_save_interval"], summary["recovery_s"]
    name = "bench_faults"
    write_results(path, [
        Result(name, "trials exact, or refused with one line after damage", 1 - summary["failures"] / n,
               1.0, ">=", "share", f"{summary['trials']} trials, seed {summary['seed']}"),
        Result(name, "trials that differed silently", summary["differed"], 0, "<=", "trials"),
        Result(name, "trials hung past the timeout", summary["hung"], 0, "<=", "trials"),
        Result(name, "worst iterations lost / --save-interval", lost["worst"], 1.0, "<=", "x"),
        Result(name, "median fault to a running job again", recovery["median"], None, "<=", "s"),
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

"""Run every benchmark and print one table of their ratios against their goals (make bench).

    python -m benchmarks.run_all [--only NAME ...] [--skip NAME ...] [--out build/bench]
    python -m benchmarks.run_all --list      # what each measures and its goal; runs nothing

BENCHMARKS below names every benchmarks/bench_*.py with what it measures and its goal. Those
that run on their own defaults run in turn, as ``python -m benchmarks.bench_x
--results-json OUT/bench_x.json`` (the convention of benchmarks/harness/results.py); each
one's output goes to the terminal and to OUT/bench_x.log. Those that need inputs (a corpus,
other runs' folders) are listed with the one command that reproduces their table, and not
run. Then one table: every metric, its value, its goal and whether it is met or by how
much it is missed, and the machine it ran on. OUT/results.json holds all of it. Exit status
1 if a benchmark failed to run (a missed goal is a result, not a failure).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
import time

from benchmarks.harness.jobs import run_logged
from benchmarks.harness.paths import BENCH_OUT, REPO
from benchmarks.harness.results import machine, read_results, write_json


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """benchmarks/``name``.py: ``what`` it compares and its ``goal``; ``command``, for one
    that needs inputs, is how its table is reproduced (make bench does not run it)."""

    name: str
    what: str
    goal: str
    command: str = ""


# docs/sas_variants.md's long run: the bundled corpus with the learning tier's tokenizer.
SAS_CAMPAIGN = (
    "--corpus demo --vocab-size 1000 --split 90,5,5 --layers 2 --hidden 128 --seq-length 32 "
    "--batch 64"
)
BENCHMARKS = (
    Benchmark(
        "bench_preprocess",
        "sentence-level preprocessing vs Megatron-LM's preprocess_data.py (marginal MB/s, "
        "same JSON lines and tokenizer), and the tool vs its bare split + encode loop",
        ">= 2.0x Megatron-LM; >= 70% of the bare loop at both levels",
    ),
    Benchmark(
        "bench_splitters",
        "blingfire vs punkt on Wikipedia leads: punkt's boundaries kept, and speed",
        "(chooses the default splitter)",
    ),
    Benchmark(
        "bench_samples",
        "our BERT sample index vs megatron-core's BERTMaskedWordPieceDataset: build "
        "time and samples/s through a DataLoader",
        ">= 1.0x on both",
    ),
    Benchmark(
        "bench_sas_step",
        "SAS-small (and SAS^DA-small) step time vs transformers' ELECTRA-small; peak "
        "activation memory of the base encoders",
        "<= 0.75x ELECTRA-small's step time",
    ),
    Benchmark(
        "bench_sas_store",
        "replacement-store work per micro-batch vs a SAS-small step; peak RSS vs "
        "instances beside an in-RAM buffer",
        "< 2% of a step; RSS growth 0.1M -> 3M instances <= 32 MiB",
    ),
    Benchmark(
        "bench_taco_step",
        "TACO-base tokens/s and peak activation memory vs transformers' DeBERTa-v2",
        ">= 1.0x DeBERTa-lab's tokens/s; <= 1.0x its memory",
    ),
    Benchmark(
        "bench_learning",
        "held-out MLM, collapse and RTD curves on the same batches: our TACO, SAS, "
        "SAS^c, SAS^DA vs transformers' BERT, ELECTRA and SAS's objective on ELECTRA's "
        "encoder",
        "TACO >= BERT at every point; SAS = the reference within seed noise",
    ),
    Benchmark(
        "bench_sas_variants",
        "SAS's variants (the paper's recipe, the release's cold starts, departures) "
        "beside ELECTRA and BERT, or TACO beside BERT: tokens to leave the plateau, MLM, "
        "RTD, collapse; with --select-lr each variant's own learning rate, then its seeds",
        "a recipe counts as learning when every seed leaves the plateau (1.5x) on both "
        "corpora; TACO >= BERT at equal FLOPs",
        f"python -m benchmarks.bench_sas_variants {SAS_CAMPAIGN} --iters 800 --eval-interval "
        "200 --variants paper mlm_lambda_small electra --lrs 5e-4 1e-3 --seeds 3 --select-lr "
        "--equal-flops --out OUT (then --corpus wiki; TACO against BERT: --layers 4 --hidden "
        "256 --iters 600 --eval-interval 150 --variants taco bert)",
    ),
    Benchmark(
        "bench_sas_factors",
        "the paper's SAS recipe in the campaign's setting with one factor changed at a "
        "time (steps vs tokens: batch 32 and 128; a schedule twice as long; a 30% warm-up; "
        "a 2000-piece tokenizer), 3 seeds on each corpus: seeds that leave the plateau",
        "a factor holds when every seed leaves the plateau (1.5x) on both corpora",
        "python -m benchmarks.bench_sas_factors --corpus wiki demo --out OUT",
    ),
    Benchmark(
        "bench_sas_downstream",
        "a bench_sas_variants campaign downstream at equal training FLOPs: zero-shot word "
        "order, frozen probe and Table 6 fine-tuning ([CLS] and mean-pooled heads; lr and "
        "epoch chosen on dev, figures on test), mean ± std over seeds, paired t-tests",
        "SAS >= ELECTRA and TACO >= BERT (the papers' claims), p < 0.05 over the seeds",
        f"python -m benchmarks.bench_sas_downstream {SAS_CAMPAIGN} --runs OUT --sentences 600 "
        "--finetune (OUT: the campaign's --out; TACO's campaign: --layers 4 --hidden 256)",
    ),
    Benchmark(
        "bench_finetune",
        "fine-tuning examples/s: our dynamic padding vs our padded path vs transformers' Trainer",
        ">= 2.5x padded (single sentences); >= 1.0x Trainer",
    ),
    Benchmark(
        "bench_exit_save",
        "signal -> completed checkpoint save of TACO-base and SAS-base on one rank",
        "<= 30 s, the launcher's grace before SIGKILL",
    ),
    Benchmark(
        "bench_faults",
        "randomly placed faults (killed ranks and launchers, signals, a kill mid-save, "
        "ENOSPC/EIO, corrupt bytes, stale locks) on TACO/SAS/SAS^DA runs, each requeued "
        "and compared bit for bit with a run that never failed",
        "every trial exact (<= one --save-interval redone) or refused in one line; 0 differed, "
        "0 hung, 0 lost data",
        "python -m benchmarks.bench_faults --trials 200 --seed 1 --out OUT",
    ),
    Benchmark(
        "bench_task_features",
        "load_task('mnli') features vs Megatron-LM's per-example featurisation loop",
        ">= 2.0x in CPU seconds",
    ),
)


def listing() -> str:
    """Every benchmark: its name, what it compares, its goal (and, for one that needs
    inputs, the command that reproduces its table)."""
    lines = []
    for b in BENCHMARKS:
        how = "" if not b.command else " (needs inputs: not run by make bench)"
        lines.append(f"{b.name}{how}")
        for key, text in (("what", b.what), ("goal", b.goal)):
            first = f"    {key + ':':<6}"
            lines += textwrap.wrap(text, 96, initial_indent=first, subsequent_indent=" " * 10)
        if b.command:  # one line, to be pasted
            lines.append(f"    run:  {b.command}")
    return "\n".join(lines)


def status(r: dict) -> str:
    value, goal, op = r.get("value"), r.get("goal"), r.get("op", ">=")
    if value is None:
        return "not measured"
    if goal is None:
        return "(no goal)"
    if (value >= goal) if op == ">=" else (value <= goal):
        return "met"
    if op == ">=":
        return f"MISSED by {(goal - value) / abs(goal):.0%}" if goal else "MISSED"
    return f"MISSED: {(value - goal) / abs(goal):.0%} over" if goal else "MISSED"


def fmt(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "share":
        return f"{value:.2%}"
    return f"{value:.3g} {unit}" if unit != "x" else f"{value:.2f}x"


def run(name: str, out_dir: str) -> tuple[list[dict], str | None, float]:
    json_path = os.path.join(out_dir, f"{name}.json")
    log_path = os.path.join(out_dir, f"{name}.log")
    if os.path.exists(json_path):
        os.remove(json_path)
    print(f"\n===== {name} =====", flush=True)
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", f"benchmarks.{name}", "--results-json", json_path]
    rc = run_logged(argv, log_path)
    elapsed = time.perf_counter() - t0
    error = None if rc == 0 else f"exit status {rc} (see {os.path.relpath(log_path, REPO)})"
    results = []
    if os.path.exists(json_path):
        results = read_results(json_path)
    elif error is None:
        error = "wrote no --results-json"
    return results, error, elapsed


def print_table(host: str, rows: list[dict], failures: list) -> None:
    print(f"\nBenchmarks on {host}")
    widths = (18, 56, 12, 10)
    header = ("benchmark", "metric", "value", "goal")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)) + "  status")
    for r in rows:
        goal = "-" if r.get("goal") is None else f"{r.get('op', '>=')} {fmt(r['goal'], r['unit'])}"
        cells = (r["benchmark"], r["metric"], fmt(r.get("value"), r["unit"]), goal)
        print("  ".join(str(c)[:w].ljust(w) for c, w in zip(cells, widths)) + f"  {status(r)}")
        if r.get("note"):
            print(" " * (widths[0] + 2) + f"  {r['note']}")
    for name, error in failures:
        print(f"{name}: FAILED, {error}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.run_all", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--only", nargs="+", default=[], help="run only these (bench_x or x)")
    ap.add_argument("--skip", nargs="+", default=[], help="leave these out")
    ap.add_argument("--out", default=BENCH_OUT, help="logs and JSON")
    ap.add_argument("--list", action="store_true", help="print what each measures; run nothing")
    args = ap.parse_args(argv)
    if args.list:
        print(listing())
        return 0

    def short(n: str) -> str:
        return n.removeprefix("benchmarks.").removeprefix("bench_").removesuffix(".py")

    by_name = {short(b.name): b for b in BENCHMARKS}
    for n in args.only + args.skip:
        if short(n) not in by_name:
            ap.error(f"no benchmark {n!r}; there are: {', '.join(by_name)}")
        b = by_name[short(n)]
        if n in args.only and b.command:
            ap.error(f"{b.name} needs inputs; run: {b.command}")
    only, skip = {short(n) for n in args.only}, {short(n) for n in args.skip}
    chosen = [b for n, b in by_name.items() if not b.command and (not only or n in only)]
    chosen = [b for b in chosen if short(b.name) not in skip]
    os.makedirs(args.out, exist_ok=True)
    print(listing())

    host = machine()
    rows, failures = [], []
    for b in chosen:
        results, error, elapsed = run(b.name, args.out)
        if error:
            failures.append((b.name, error))
        rows.extend(results)
        print(f"----- {b.name}: {elapsed:.0f} s" + (f", {error}" if error else ""), flush=True)
    print_table(host, rows, failures)
    write_json(
        os.path.join(args.out, "results.json"),
        {"machine": host, "results": rows, "failures": failures},
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Run every benchmark and print one table of their ratios against their goals (make bench).

    python benchmarks/run_all.py [--only NAME ...] [--skip NAME ...] [--out build/bench]

Each benchmarks/bench_*.py runs in turn, with its own defaults, as
``python bench_x.py --results-json OUT/bench_x.json`` (the convention of results.py); its
output goes to the terminal and to OUT/bench_x.log. Then one table: every metric, its
value, its goal and whether it is met or by how much it is missed, and the machine it ran
on. OUT/results.json holds all of it. Exit status 1 if a benchmark failed to run (a missed
goal is a result, not a failure).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    memory = ""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory = f", {pages * size / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs{memory}{gpu or ', no GPU'}; {platform.platform()}"


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


def run(script: str, out_dir: str) -> tuple[list[dict], str | None, float]:
    name = os.path.splitext(os.path.basename(script))[0]
    json_path = os.path.join(out_dir, f"{name}.json")
    log_path = os.path.join(out_dir, f"{name}.log")
    if os.path.exists(json_path):
        os.remove(json_path)
    print(f"\n===== {name} =====", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, script, "--results-json", json_path],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        rc = proc.wait()
    elapsed = time.perf_counter() - t0
    error = None if rc == 0 else f"exit status {rc} (see {os.path.relpath(log_path, REPO)})"
    results = []
    if os.path.exists(json_path):
        with open(json_path) as f:
            results = json.load(f)
    elif error is None:
        error = "wrote no --results-json"
    return results, error, elapsed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", default=[], help="run only these (bench_x or x)")
    ap.add_argument("--skip", nargs="+", default=[], help="leave these out")
    ap.add_argument("--out", default=os.path.join(REPO, "build", "bench"), help="logs and JSON")
    args = ap.parse_args(argv)

    def short(n: str) -> str:
        return n.removeprefix("bench_").removesuffix(".py")

    scripts = sorted(glob.glob(os.path.join(HERE, "bench_*.py")))
    names = {short(os.path.basename(s)): s for s in scripts}
    for n in args.only + args.skip:
        if short(n) not in names:
            ap.error(f"no benchmark {n!r}; there are: {', '.join(names)}")
    chosen = [s for n, s in names.items() if (not args.only or n in map(short, args.only))]
    chosen = [s for s in chosen if short(os.path.basename(s)) not in map(short, args.skip)]
    os.makedirs(args.out, exist_ok=True)

    host = machine()
    rows, failures = [], []
    for script in chosen:
        results, error, elapsed = run(script, args.out)
        name = os.path.splitext(os.path.basename(script))[0]
        if error:
            failures.append((name, error))
        rows.extend(results)
        print(f"----- {name}: {elapsed:.0f} s" + (f", {error}" if error else ""), flush=True)

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
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"machine": host, "results": rows, "failures": failures}, f, indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

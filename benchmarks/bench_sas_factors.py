"""What else takes the paper's SAS recipe off the plateau at small sizes (issue 37, item 3):
the recipe campaign's setting (docs/sas_variants.md: 2 x 128, batch 64 x seq 32, 800
iterations, 10% warm-up, a 1000-piece tokenizer) with one factor changed at a time, over
seeds, on each corpus; one table of the seeds that leave the plateau and the end ratios.

    python -m benchmarks.bench_sas_factors --corpus wiki demo --out OUT
    python -m benchmarks.bench_sas_factors --corpus demo --factors base b32 b128 --seeds 3 \\
        --variant mlm_lambda_small --lr 5e-4 --out OUT

Each (corpus, factor) is one bench_sas_variants campaign in OUT/CORPUS/FACTOR, run with
--reuse: a campaign cut short resumes where it stopped, and runs already in a folder are
read, not run again. The batch factors keep the tokens (and the tokens between
evaluations, and those evaluated) of the base setting and change the optimizer steps at the
same learning rate; ``long`` doubles both, so b32 against long is twice the tokens at the
same steps. SAS's lambda ramps over the run's whole epochs of the corpus, so ``long`` (twice
the epochs) ramps it about half as fast; ``v2000`` keeps the whole epochs (each a little shorter)
and has its own most-frequent-token baseline. A factor "holds" when every seed leaves
the plateau on every corpus given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import traceback

from benchmarks import bench_sas_variants
from benchmarks.harness.results import write_json
from benchmarks.learning.variants import VARIANTS

# The recipe campaign's setting (docs/sas_variants.md), which every factor changes.
BASE = ("--vocab-size", "1000", "--seq-length", "32", "--layers", "2", "--hidden", "128",
        "--split", "90,5,5", "--batch", "64", "--iters", "800", "--eval-interval", "200",
        "--eval-iters", "8", "--warmup-fraction", "0.1")  # fmt: skip

# name -> (bench_sas_variants flags that replace BASE's, what it changes)
FACTORS = {
    "base": ((), "the campaign's setting: 800 steps of 64, 10% warm-up, 1000 pieces"),
    "long": (("--iters", "1600"), "a schedule twice as long (twice the tokens)"),
    "b32": (("--batch", "32", "--iters", "1600", "--eval-interval", "400", "--eval-iters", "16"),
            "the same tokens in twice the steps (batch 32)"),
    "b128": (("--batch", "128", "--iters", "400", "--eval-interval", "100", "--eval-iters", "4"),
             "the same tokens in half the steps (batch 128)"),
    "warm30": (("--warmup-fraction", "0.3"), "a 30% warm-up"),
    "v2000": (("--vocab-size", "2000"), "a 2000-piece tokenizer"),
}  # fmt: skip


def campaign_argv(args, corpus: str, factor: str) -> list[str]:
    """bench_sas_variants' command line for one (corpus, factor): BASE, then the factor's
    flags (argparse keeps an option's last value)."""
    out = os.path.join(args.out, corpus, factor)
    return [*BASE, *FACTORS[factor][0], "--corpus", corpus, "--variants", args.variant,
            "--lrs", repr(args.lr), "--seeds", str(args.seeds), "--seed", str(args.seed),
            "--left-plateau", repr(args.left_plateau), "--jobs", str(args.jobs), "--reuse",
            "--out", out, "--json", os.path.join(out, "summary.json")]  # fmt: skip


def read_row(path: str) -> dict | None:
    """One campaign's summary (its single curve) as a table row; None if no seed ended (a
    campaign whose every run failed writes an empty summary)."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        rows = list(json.load(f).values())
    if len(rows) != 1:
        return None
    (row,) = rows
    ratios = row["ratio_by_seed"]
    exits = list(row["left_plateau_tokens_by_seed"].values())
    return {
        "left": sum(e is not None for e in exits),
        "seeds": len(exits),
        "ratio": statistics.mean(ratios) if ratios else None,
        "ratio_std": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
        "ratio_by_seed": ratios,
        "collapse": row["collapse"],
        "tokens": row["tokens"],
    }


def holds(rows: dict, corpora: list[str], seeds: int) -> bool:
    """Every seed left the plateau on every corpus (issue 37's bar for "learns")."""
    return all(rows.get(c) is not None and rows[c]["left"] == seeds for c in corpora)


def report(table: dict, corpora: list[str], seeds: int) -> None:
    """``table``: factor -> corpus -> read_row's row (or None)."""
    print("\nseeds left the plateau / end MLM accuracy x baseline (mean ± std over seeds)")
    print(f"{'factor':<8} " + " ".join(f"{c:>28}" for c in corpora) + "  holds  what")
    for factor, rows in table.items():
        cells = []
        for c in corpora:
            r = rows.get(c)
            if r is None:
                cells.append("did not end")
                continue
            short = "" if r["seeds"] == seeds else f" ({seeds - r['seeds']} cut)"
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f} ± {r['ratio_std']:.2f}x"
            cells.append(f"{r['left']}/{r['seeds']}{short} {ratio}")
        verdict = "yes" if holds(rows, corpora, seeds) else "no"
        print(f"{factor:<8} " + " ".join(f"{cell:>28}" for cell in cells)
              + f"  {verdict:<5}  {FACTORS[factor][1]}")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_sas_factors", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--corpus", nargs="+", choices=("demo", "wiki"), default=["wiki", "demo"])
    p.add_argument("--factors", nargs="+", choices=tuple(FACTORS), default=list(FACTORS))
    p.add_argument("--variant", choices=tuple(v for v, m in VARIANTS.items() if m[0] == "sas"),
                   default="paper", help="The SAS recipe under test (default: the paper's).")  # fmt: skip
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234, help="The first seed.")
    bench_sas_variants.add_output_flags(p, "sas_factors", "Write the table here.")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    for flag, value in (("--lr", args.lr), ("--left-plateau", args.left_plateau)):
        if not value > 0:
            p.error(f"{flag} must be > 0, got {value:g}")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    table, ok = {}, True
    for factor in args.factors:
        table[factor] = {}
        for corpus in args.corpus:
            print(f"== {corpus}, {factor}: {FACTORS[factor][1]}", flush=True)
            argv_c = campaign_argv(args, corpus, factor)
            if os.path.isfile(argv_c[-1]):  # a summary left by an earlier call is not this one's
                os.remove(argv_c[-1])
            ok &= campaign(argv_c)
            table[factor][corpus] = read_row(argv_c[-1])
    report(table, args.corpus, args.seeds)
    if args.json:
        write_json(args.json, table)
    return 0 if ok else 1


def campaign(argv: list[str]) -> bool:
    """One bench_sas_variants campaign; False if a run of it failed or it was refused. A
    sweep of hours goes on past one campaign's failure (its traceback, a bug, is shown)."""
    try:
        return bench_sas_variants.main(argv) == 0
    except SystemExit as e:  # a one-line refusal, already printed
        return e.code in (0, None)
    except Exception:
        traceback.print_exc()
        return False


if __name__ == "__main__":
    raise SystemExit(main())

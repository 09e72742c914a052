"""taco-glue-score / tools/glue_score.py: the score table of a directory of fine-tuning runs
(a sweep's --output, or any folder holding run directories with results.json) and the GLUE
score in the SAS paper's or ELECTRA's convention (the 8 tasks' dev scores averaged, WNLI
excluded; they differ in STS-B's and MNLI's number: tasks/metrics.py). Beside the
protocol's aggregate over seeds (SAS: mean, TACO: median), every score also gets its mean
± standard deviation over the seeds found (DeBERTa's convention), and the seeds found.

    python tools/glue_score.py runs/sas_small_glue [--convention electra] [--json out.json]

A results.json that cannot be read (truncated, or not a fine-tuning run's) is skipped with
a warning line naming it, so a directory of partly written runs still gets its table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_taco.arguments import run_cli
from megatron_taco.cli import tool_parser
from megatron_taco.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    from megatron_taco.tasks.metrics import GLUE_SCORE_CONVENTIONS

    p = tool_parser("glue_score.py", __doc__)
    p.add_argument("results", help="Directory searched (recursively) for results.json files.")
    p.add_argument(
        "--aggregate",
        choices=("mean", "median"),
        default=None,
        help="Over the seeds of a configuration: mean (SAS paper) or median (TACO paper) "
        "(default: the sweep's protocol's, from DIR/sweep.json; mean without one).",
    )
    p.add_argument(
        "--convention",
        choices=GLUE_SCORE_CONVENTIONS,
        default="sas",
        help="How STS-B and MNLI become one number each: sas (the mean of Pearson and "
        "Spearman, of matched and mismatched) or electra (Spearman, matched) (default: sas).",
    )
    p.add_argument("--json", help="Also write the summary as JSON to this file.")
    return p


def score(args: argparse.Namespace) -> None:
    from megatron_taco.recipes.sweep_summary import GLUE_TASKS, markdown_table, show_std, summarize

    if not os.path.isdir(args.results):
        raise ConfigError(f"{args.results} is not a directory")
    summary = summarize(args.results, aggregate=args.aggregate, convention=args.convention)
    if not summary["tasks"]:
        for warning in summary["warnings"]:
            print(warning, file=sys.stderr)
        raise ConfigError(f"{args.results}: no finished run (results.json with finished: true)")
    print(markdown_table(summary))
    if "glue_score" in summary:
        print(
            f"GLUE score ({args.convention} convention): {summary['glue_score']:.2f} "
            f"({summary['aggregate']} over seeds); mean ± std over seeds "
            f"{summary['glue_score_mean']:.2f} ± {show_std(summary['glue_score_std'])}"
        )
    else:
        missing = [t for t in GLUE_TASKS if t not in summary["tasks"]]
        if missing:
            print(f"(no GLUE score: no finished run of {', '.join(missing)})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), argv, score)


if __name__ == "__main__":
    sys.exit(main())

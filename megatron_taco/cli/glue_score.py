"""taco-glue-score / tools/glue_score.py: the score table of a directory of fine-tuning runs
(a sweep's --output, or any folder holding run directories with results.json) and the GLUE
score as ELECTRA and the SAS paper compute it (the 8 tasks' dev scores averaged, WNLI
excluded).

    python tools/glue_score.py runs/sas_small_glue [--aggregate median] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_taco.arguments import ConfigError, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="taco-glue-score", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    p.add_argument("results", help="Directory searched (recursively) for results.json files.")
    p.add_argument(
        "--aggregate",
        choices=("mean", "median"),
        default="mean",
        help="Over the seeds of a configuration: mean (SAS paper) or median (TACO paper).",
    )
    p.add_argument("--json", help="Also write the summary as JSON to this file.")
    return p


def score(args: argparse.Namespace) -> None:
    from megatron_taco.recipes.sweep import markdown_table, summarize

    if not os.path.isdir(args.results):
        raise ConfigError(f"{args.results} is not a directory")
    summary = summarize(args.results, "taco" if args.aggregate == "median" else None)
    if not summary["tasks"]:
        raise ConfigError(f"{args.results}: no finished run (results.json with finished: true)")
    print(markdown_table(summary))
    if "glue_score" not in summary:
        from megatron_taco.recipes.sweep import GLUE_TASKS

        missing = [t for t in GLUE_TASKS if t not in summary["tasks"]]
        print(f"(no GLUE score: no finished run of {', '.join(missing)})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), argv, score)


if __name__ == "__main__":
    sys.exit(main())

"""taco-merge-datasets / tools/merge_datasets.py: see megatron_taco.preprocessing.merge."""

from __future__ import annotations

import sys

from megatron_taco.arguments import dataclass_from_args, run_cli
from megatron_taco.cli import tool_parser
from megatron_taco.data.indexed_dataset import IndexedDatasetError
from megatron_taco.preprocessing.merge import MergeConfig, merge_datasets


def main(argv: list[str] | None = None) -> int:
    return run_cli(
        tool_parser(
            "merge_datasets.py",
            "Merge Megatron indexed datasets (.bin/.idx) and their unigram counts.",
            (MergeConfig, "merge"),
        ),
        argv,
        lambda args: merge_datasets(dataclass_from_args(MergeConfig, args)),
        user_errors=(IndexedDatasetError,),
    )


if __name__ == "__main__":
    sys.exit(main())

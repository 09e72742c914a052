"""taco-merge-datasets / tools/merge_datasets.py: see megatron_taco.preprocessing.merge."""

from __future__ import annotations

import argparse

from megatron_taco.arguments import add_dataclass_args, dataclass_from_args, program_name, run_cli
from megatron_taco.data.indexed_dataset import IndexedDatasetError
from megatron_taco.preprocessing.merge import MergeConfig, merge_datasets


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program_name("merge_datasets.py"),
        description="Merge Megatron indexed datasets (.bin/.idx) and their unigram counts.",
    )
    add_dataclass_args(parser, MergeConfig, "merge")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_cli(
        build_parser(),
        argv,
        lambda args: merge_datasets(dataclass_from_args(MergeConfig, args)),
        user_errors=(IndexedDatasetError,),
    )

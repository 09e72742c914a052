"""Tokenize raw corpora into Megatron indexed datasets (taco-preprocess-data).

Megatron's tools/preprocess_data.py flags; see megatron_taco.preprocessing.preprocess for the
pipeline, the output layout and the guarantees (deterministic, atomic outputs).
"""

from __future__ import annotations

import argparse
import signal
import sys

from megatron_taco.arguments import dataclass_from_args
from megatron_taco.cli import tool_parser
from megatron_taco.errors import ConfigError
from megatron_taco.preprocessing.config import PreprocessConfig, PreprocessError
from megatron_taco.preprocessing.preprocess import preprocess
from megatron_taco.preprocessing.staging import PreprocessInterrupted


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser(
        "preprocess_data.py",
        "Tokenize corpora (Wikipedia XML, WikiExtractor, BookCorpus, OpenWebText, CC-News, JSON "
        "lines, parquet) into Megatron .bin/.idx datasets with unigram counts.",
        (PreprocessConfig, "preprocess"),
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="Do not show the progress bar on stderr"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = dataclass_from_args(PreprocessConfig, args)
        preprocess(config, progress=not args.no_progress)
    except ConfigError as e:
        parser.error(str(e))  # exits 2
    except PreprocessError as e:
        print(f"{parser.prog}: error: {e}\nno output was written", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, PreprocessInterrupted) else signal.SIGINT
        print(
            f"{parser.prog}: interrupted by {signal.Signals(signum).name}; temporary files "
            "removed, no output was written",
            file=sys.stderr,
        )
        return 128 + int(signum)
    return 0


if __name__ == "__main__":
    sys.exit(main())

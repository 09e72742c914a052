"""Build (and cache) the train/valid/test sample indices ahead of a run, and summarise them
(taco-build-samples).

    python tools/build_samples.py --data-path data/wiki_text_sentence --tokenizer-model tok.model \\
        --seq-length 128 --train-samples 100000 --valid-samples 1000 --test-samples 100

The indices land in --data-cache-path under the same keys pretraining computes, so the run
that follows loads them instead of building them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_taco.arguments import dataclass_from_args, option, require, run_cli
from megatron_taco.cli import tool_parser
from megatron_taco.data.bert_dataset import BertSampleDataset, build_train_valid_test_datasets
from megatron_taco.data.blending import BlendedDataset
from megatron_taco.data.config import DataConfig
from megatron_taco.data.indexed_dataset import IndexedDatasetError, data_file_path
from megatron_taco.data.samples import NUM_SPECIAL_TOKENS, SPLIT_NAMES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleCounts:
    train_samples: int = option(0, "Training samples to build.", flag="--train-samples")
    valid_samples: int = option(0, "Validation samples to build.", flag="--valid-samples")
    test_samples: int = option(0, "Test samples to build.", flag="--test-samples")

    def __post_init__(self) -> None:
        for name in ("train_samples", "valid_samples", "test_samples"):
            v = getattr(self, name)
            require(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                SampleCounts,
                name,
                f"must be an integer >= 0, got {v!r}",
            )
        require(
            self.train_samples + self.valid_samples + self.test_samples > 0,
            SampleCounts,
            "train_samples",
            "nothing to build: give --train-samples, --valid-samples and/or --test-samples",
        )


def _lengths(part: BertSampleDataset) -> np.ndarray:
    """Exact tokens per sample ([CLS] and [SEP] included), vectorised over the index."""
    ds = part.indexed_dataset
    index = np.asarray(part.sample_index)
    sizes = np.asarray(ds.sizes, dtype=np.int64)
    cum = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=cum[1:])
    body = cum[index[:, 1]] - cum[index[:, 0]]
    # The dataset drops an end-of-document [SEP] stored in the data; read each sample's last
    # stored token to count exactly as it does.
    last = index[:, 1] - 1
    has = sizes[last] > 0
    if np.any(has):
        tokens = np.memmap(data_file_path(ds.path_prefix), dtype=ds.dtype, mode="r")
        at = np.asarray(ds.pointers, dtype=np.int64)[last[has]] // ds.dtype.itemsize
        ends_with_sep = np.zeros(index.shape[0], dtype=bool)
        ends_with_sep[has] = tokens[at + sizes[last[has]] - 1] == part.sep_id
        body = body - ends_with_sep
    return np.minimum(body, index[:, 2]) + NUM_SPECIAL_TOKENS


def _parts(dataset: Any) -> list[BertSampleDataset]:
    return list(dataset.datasets) if isinstance(dataset, BlendedDataset) else [dataset]


def summarise(
    config: DataConfig, splits: tuple[Any, Any, Any], tokenizer: Any, requested: tuple[int, ...]
) -> str:
    lines = []
    header = (
        f"{'split':<6} {'dataset':<28} {'docs':>9} {'skipped':>8} {'epochs':>6} {'samples':>10} "
        f"{'mean tok':>8} {'max tok':>7} {'padding':>7} {'truncated':>9} {'status':>7}"
    )
    lines += [header, "-" * len(header)]
    for name, dataset, wanted in zip(SPLIT_NAMES, splits, requested):
        if dataset is None:
            why = "skipped: no documents in this split" if wanted else "0 samples requested"
            lines.append(f"{name:<6} {why}")
            continue
        for part in _parts(dataset):
            info = part.info
            lengths = _lengths(part)
            docs = info["doc_range"][1] - info["doc_range"][0]
            skipped = info.get("empty_documents", 0) + info.get("short_documents", 0)
            kept = max(info.get("tokens", 0) + info.get("truncated_tokens", 0), 1)
            label = os.path.basename(part.indexed_dataset.path_prefix)
            if len(label) > 28:
                label = label[:12] + "..." + label[-13:]
            lines.append(
                f"{name:<6} {label:<28} {docs:>9} {skipped:>8} {info.get('epochs', 0):>6} "
                f"{len(part):>10} {lengths.mean():>8.1f} {lengths.max():>7} "
                f"{1 - lengths.mean() / config.seq_length:>7.1%} "
                f"{info.get('truncated_tokens', 0) / kept:>9.1%} {info.get('status', ''):>7}"
            )
            if info.get("long_sentences"):
                lines.append(
                    f"       {info['long_sentences']} sentences longer than seq_length - 2 "
                    "(truncated; Megatron would skip their documents)"
                )
        if isinstance(dataset, BlendedDataset):
            achieved = np.bincount(
                np.asarray(dataset.dataset_index, dtype=np.int64), minlength=len(dataset.datasets)
            ) / max(len(dataset), 1)
            pairs = ", ".join(
                f"{os.path.basename(p.indexed_dataset.path_prefix)}: {a:.4f} (requested {w:.4f})"
                for p, a, w in zip(dataset.datasets, achieved, dataset.weights)
            )
            lines.append(f"       blend of {len(dataset)}: {pairs}")
    lines.append(
        "padding = share of [PAD] positions; truncated = body tokens cut to fit the target "
        "length (the packed sentences overshoot it, as in Megatron)"
    )
    at = next((i for i, d in enumerate(splits) if d is not None and len(d)), None)
    if at is not None:
        example_split = splits[at]
        # the first of the first few samples with the most sentences shows the packing best
        candidates = [example_split[i] for i in range(min(len(example_split), 20))]
        sample = max(candidates, key=lambda x: (int(x["sentence_ids"].max()), -x["index"]))
        n = sample["length"]
        body = sample["tokens"][1 : n - 1]
        lines.append(
            f"example: sample {sample['index']} of {SPLIT_NAMES[at]} "
            f"({n} tokens, {int(sample['sentence_ids'].max()) + 1} sentences):"
        )
        lines.append(f"  [CLS] {tokenizer.decode(body)} [SEP]")
    return "\n".join(lines)


def _build_and_summarise(args: argparse.Namespace) -> None:
    config = dataclass_from_args(DataConfig, args)
    counts = dataclass_from_args(SampleCounts, args)
    config.validate_files()
    tokenizer = config.load_tokenizer()
    requested = (counts.train_samples, counts.valid_samples, counts.test_samples)
    splits = build_train_valid_test_datasets(config, tokenizer, requested)
    print(f"sample indices cached in {config.cache_dir()}")
    for prefix in config.prefixes:
        print(f"  {os.path.basename(prefix)}: {prefix}")
    print(summarise(config, splits, tokenizer, requested))


def main(argv: list[str] | None = None) -> int:
    return run_cli(
        tool_parser(
            "build_samples.py",
            "Build and cache BERT sample indices for --data-path and summarise them.",
            (DataConfig, "data"),
            (SampleCounts, "samples"),
        ),
        argv,
        _build_and_summarise,
        user_errors=(IndexedDatasetError, ValueError, OSError),
    )


if __name__ == "__main__":
    sys.exit(main())

"""Concatenate indexed datasets into one (tools/merge_datasets.py), like Megatron's merge_datasets.

Every input is opened and checked (format, dtype, unigram counts) before a byte is written.
The output is built under temporary names in the output directory and renamed into place at
the end, so an interrupted or failed merge never leaves a file under the final name.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from megatron_taco.arguments import option, require
from megatron_taco.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    data_file_path,
    index_file_path,
    unigram_path,
)
from megatron_taco.errors import ConfigError
from megatron_taco.preprocessing.staging import replace_dataset

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergeConfig:
    input: tuple[str, ...] = option(
        help="A directory (every PREFIX.bin/PREFIX.idx pair in it, in sorted order) or a list "
        "of dataset prefixes, merged in the order given"
    )
    output_prefix: str = option(help="Prefix of the merged dataset")

    def __post_init__(self) -> None:
        require(len(self.input) > 0, MergeConfig, "input", "at least one input is required")
        require(bool(self.output_prefix), MergeConfig, "output_prefix", "must not be empty")
        require(
            not os.path.isdir(self.output_prefix),
            MergeConfig,
            "output_prefix",
            f"{self.output_prefix} is a directory; give a prefix such as {self.output_prefix}/merged",
        )


def _prefixes_in_directory(directory: str) -> list[str]:
    prefixes: set[str] = set()
    for name in os.listdir(directory):
        stem, ext = os.path.splitext(name)
        if ext not in (".bin", ".idx") or not os.path.isfile(os.path.join(directory, name)):
            continue
        other = os.path.join(directory, stem + (".idx" if ext == ".bin" else ".bin"))
        if not os.path.isfile(other):
            raise ConfigError(
                f"--input: {os.path.join(directory, name)} has no matching {os.path.basename(other)}"
            )
        prefixes.add(os.path.join(directory, stem))
    return sorted(prefixes)


def resolve_inputs(config: MergeConfig) -> list[str]:
    prefixes: list[str] = []
    for item in config.input:
        if os.path.isdir(item):
            found = _prefixes_in_directory(item)
            if not found:
                raise ConfigError(f"--input: directory {item} contains no .bin/.idx dataset")
            prefixes.extend(found)
            continue
        missing = [
            p for p in (index_file_path(item), data_file_path(item)) if not os.path.isfile(p)
        ]
        if missing:
            hint = (
                " (give the prefix, without .bin/.idx)" if item.endswith((".bin", ".idx")) else ""
            )
            raise ConfigError(f"--input: {' and '.join(missing)} not found{hint}")
        prefixes.append(item)
    seen: set[str] = set()
    for p in prefixes:
        key = os.path.realpath(p)
        if key in seen:
            raise ConfigError(f"--input: dataset {p} is given twice")
        seen.add(key)
    out = os.path.realpath(config.output_prefix)
    if out in seen:
        raise ConfigError(
            f"--output-prefix: {config.output_prefix} is also an input; merge into a new prefix"
        )
    return prefixes


def _load_unigram_counts(prefixes: list[str]) -> np.ndarray | None:
    have = [os.path.isfile(unigram_path(p)) for p in prefixes]
    if not any(have):
        return None
    if not all(have):
        missing = [unigram_path(p) for p, h in zip(prefixes, have) if not h]
        raise ConfigError(
            f"--input: some inputs have unigram counts and others do not; missing: {', '.join(missing)}"
        )
    total: np.ndarray | None = None
    first = ""
    for p in prefixes:
        path = unigram_path(p)
        try:
            counts = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise ConfigError(f"--input: {path}: unreadable unigram counts ({e})") from None
        if counts.ndim != 1 or counts.dtype.kind not in "iu":
            raise ConfigError(
                f"--input: {path}: expected a 1-D integer array, found {counts.dtype} {counts.shape}"
            )
        if total is None:
            total, first = counts.astype(np.int64), path
        elif counts.shape != total.shape:
            raise ConfigError(
                f"--input: {path} counts {counts.shape[0]} token ids but {first} counts "
                f"{total.shape[0]}; were they tokenized with different vocabularies?"
            )
        else:
            total += counts.astype(np.int64)
    return total


def merge_datasets(config: MergeConfig) -> str:
    """Merge; returns the output prefix. Raises ConfigError/IndexedDatasetError on bad inputs."""
    prefixes = resolve_inputs(config)
    datasets = [IndexedDataset(p) for p in prefixes]  # full validation of every input up front
    dtypes = {ds.dtype for ds in datasets}
    if len(dtypes) > 1:
        listing = ", ".join(f"{ds.path_prefix}: {ds.dtype}" for ds in datasets)
        raise ConfigError(f"--input: datasets do not share a token dtype ({listing})")
    dtype = datasets[0].dtype
    num_sequences = sum(len(ds) for ds in datasets)
    num_documents = sum(ds.num_documents for ds in datasets)
    del datasets
    counts = _load_unigram_counts(prefixes)

    out = config.output_prefix
    out_dir = os.path.dirname(os.path.abspath(out))
    os.makedirs(out_dir, exist_ok=True)
    # Same directory as the final files, so os.replace is an atomic rename, never a copy.
    tmp = os.path.join(out_dir, f".{os.path.basename(out)}.merging-{os.getpid()}")
    tmp_files = [data_file_path(tmp), index_file_path(tmp), unigram_path(tmp)]
    start = time.monotonic()
    builder = IndexedDatasetBuilder(data_file_path(tmp), dtype=dtype)
    try:
        for p in prefixes:
            logger.info("appending %s", p)
            builder.add_index(p)
        builder.finalize(index_file_path(tmp))
        if counts is not None:
            with open(unigram_path(tmp), "wb") as f:
                np.save(f, counts)
        # Re-open the result: a merge that cannot be read back must not replace anything.
        merged = IndexedDataset(tmp)
        if len(merged) != num_sequences or merged.num_documents != num_documents:
            raise IndexedDatasetError(
                f"{index_file_path(tmp)}: merged {len(merged)} sequences / "
                f"{merged.num_documents} documents, expected {num_sequences} / {num_documents}"
            )
        del merged
        replace_dataset(tmp, out, unigram=counts is not None)
    except BaseException:
        builder.close()
        for path in tmp_files:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        raise
    logger.info(
        "merged %d datasets into %s: %d documents, %d sequences, dtype %s%s in %.1fs",
        len(prefixes),
        out,
        num_documents,
        num_sequences,
        dtype,
        ", unigram counts summed" if counts is not None else "",
        time.monotonic() - start,
    )
    return out

"""BERT samples: ``[CLS] sentences... [SEP] [PAD]...`` from an indexed dataset and a sample index,
and the train/valid/test datasets (blended when several --data-path prefixes are given)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch.utils.data

from megatron_taco.data.blending import (
    BLEND_INDEX_VERSION,
    BlendedDataset,
    blend_indices,
    samples_per_dataset,
)
from megatron_taco.data.cache import (
    CacheEntry,
    array_from_state,
    array_state,
    file_identity,
    load_or_build,
)
from megatron_taco.data.config import DataConfig
from megatron_taco.data.indexed_dataset import IndexedDataset, check_index, index_file_path
from megatron_taco.data.samples import (
    NUM_SPECIAL_TOKENS,
    SAMPLE_INDEX_VERSION,
    SPLIT_NAMES,
    build_sample_index_with_stats,
    get_split_document_ranges,
    log_stats,
    parse_split,
)
from megatron_taco.errors import ConfigError

logger = logging.getLogger(__name__)


class BertSampleDataset(torch.utils.data.Dataset):
    """One sample per row of ``sample_index`` (see samples.py), as the contract's dict.

    The body (the row's sentences, concatenated) is cut to the row's target length, at the
    end: Megatron truncates the longer of its two segments; with a single segment that is
    the end. A trailing [SEP] in the data (``--append-eod``'s end-of-document marker) is
    dropped first so that the sample ends with exactly one [SEP].
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        sample_index: np.ndarray,
        *,
        seq_length: int,
        cls_id: int,
        sep_id: int,
        pad_id: int,
        word_start_mask: np.ndarray,
        special_token_mask: np.ndarray | None = None,
        name: str = "",
        info: dict[str, Any] | None = None,
    ) -> None:
        if seq_length < NUM_SPECIAL_TOKENS + 1:
            raise ValueError(f"seq_length must be >= {NUM_SPECIAL_TOKENS + 1}, got {seq_length}")
        sample_index = (
            np.asarray(sample_index) if not isinstance(sample_index, np.memmap) else sample_index
        )
        if sample_index.ndim != 2 or sample_index.shape[1] != 3:
            raise ValueError(f"sample_index must have shape [N, 3], got {sample_index.shape}")
        word_start_mask = np.asarray(word_start_mask, dtype=bool)
        if word_start_mask.ndim != 1:
            raise ValueError("word_start_mask must be a bool array over the vocabulary")
        if special_token_mask is not None:
            special_token_mask = np.asarray(special_token_mask, dtype=bool)
            if special_token_mask.shape != word_start_mask.shape:
                raise ValueError(
                    f"special_token_mask has shape {special_token_mask.shape}, word_start_mask "
                    f"{word_start_mask.shape}; both are over the same vocabulary"
                )
        self.indexed_dataset = indexed_dataset
        self.sample_index = sample_index
        self.seq_length = int(seq_length)
        self.cls_id, self.sep_id, self.pad_id = int(cls_id), int(sep_id), int(pad_id)
        self.word_start_mask = word_start_mask
        self.special_token_mask = special_token_mask
        self.name = name or getattr(indexed_dataset, "path_prefix", "")
        self.info = dict(info or {})

    def __len__(self) -> int:
        return int(self.sample_index.shape[0])

    def __getitem__(self, idx: int) -> dict[str, Any]:
        i = check_index(idx, len(self), f"{self.name}: sample")
        start, end, target = (int(x) for x in self.sample_index[i])
        max_body = self.seq_length - NUM_SPECIAL_TOKENS
        if target > max_body:
            raise ValueError(
                f"{self.name}: sample {i} has target length {target} but seq_length "
                f"{self.seq_length} leaves room for {max_body}: the sample index was built "
                "for a longer --seq-length"
            )
        pieces = self.indexed_dataset[start:end]
        lengths = np.asarray(self.indexed_dataset.sizes[start:end], dtype=np.int64)
        body = np.concatenate(pieces).astype(np.int64) if len(pieces) else np.zeros(0, np.int64)
        if body.shape[0] and body[-1] == self.sep_id:
            body = body[:-1]
        body = body[:target]
        nb = body.shape[0]
        if nb and (body.min() < 0 or body.max() >= self.word_start_mask.shape[0]):
            raise ValueError(
                f"{self.name}: sample {i} has token id {int(body.max())} outside the tokenizer's "
                f"vocabulary of {self.word_start_mask.shape[0]} (was the dataset made with "
                "another --tokenizer-model?)"
            )
        length = nb + NUM_SPECIAL_TOKENS
        sep_at = nb + 1

        tokens = np.full(self.seq_length, self.pad_id, dtype=np.int64)
        tokens[0] = self.cls_id
        tokens[1:sep_at] = body
        tokens[sep_at] = self.sep_id

        sentence_ids = np.full(self.seq_length, -1, dtype=np.int64)
        sentence_of_token = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), lengths)
        sentence_ids[1:sep_at] = sentence_of_token[:nb]

        word_starts = np.zeros(self.seq_length, dtype=bool)
        word_starts[1:sep_at] = self.word_start_mask[body]
        word_starts[0] = word_starts[sep_at] = True

        special = np.zeros(self.seq_length, dtype=bool)
        special[0] = True
        special[sep_at:] = True  # [SEP] and the padding
        if self.special_token_mask is not None:
            special[1:sep_at] = self.special_token_mask[body]
        return {
            "tokens": tokens,
            "length": length,
            "sentence_ids": sentence_ids,
            "word_starts": word_starts,
            "special": special,
            "index": i,
        }

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["sample_index"] = array_state(self.sample_index)
        return state

    def __setstate__(self, state: dict) -> None:
        state["sample_index"] = array_from_state(state["sample_index"])
        self.__dict__.update(state)


def _dataset_identity(ds: IndexedDataset) -> dict[str, Any]:
    ident = file_identity(index_file_path(ds.path_prefix))
    ident["sequences"] = len(ds)
    ident["documents"] = int(ds.document_indices.shape[0]) - 1
    return ident


def get_sample_index(
    ds: IndexedDataset,
    config: DataConfig,
    split_name: str,
    doc_range: tuple[int, int],
    num_samples: int | None,
    cache_dir: str | None,
    num_epochs: int | None = None,
    barrier: Callable[[], None] | None = None,
) -> CacheEntry:
    """The (cached) sample index of one split of one dataset: ``num_samples`` samples, or
    ``num_epochs`` whole passes over the split's documents. ``barrier``: cache.load_or_build's."""
    description = {
        "kind": "bert_sample_index",
        "version": SAMPLE_INDEX_VERSION,
        "dataset": _dataset_identity(ds),
        "split": config.split,
        "split_name": split_name,
        "doc_range": [int(doc_range[0]), int(doc_range[1])],
        "seq_length": config.seq_length,
        "short_seq_prob": config.short_seq_prob,
        "min_sentences": config.min_sentences,
        "seed": config.seed,
        "num_samples": None if num_samples is None else int(num_samples),
        **({"num_epochs": int(num_epochs)} if num_epochs is not None else {}),
    }

    def build():
        try:
            index, stats = build_sample_index_with_stats(
                ds.sizes,
                ds.document_indices,
                doc_range,
                num_samples=num_samples,
                num_epochs=num_epochs,
                max_seq_length=config.seq_length,
                short_seq_prob=config.short_seq_prob,
                min_sentences=config.min_sentences,
                seed=config.seed,
                compact=True,  # int32 rows for corpora under 2**31 sentences
            )
        except ValueError as e:
            raise ConfigError(f"--data-path: {ds.path_prefix} ({split_name} split): {e}") from None
        log_stats(stats, f"{ds.path_prefix} {split_name}")
        return {"sample_index": index}, dataclasses.asdict(stats)

    return load_or_build(
        "bert_sample_index", description, ("sample_index",), build, cache_dir, barrier
    )


def get_blend_index(
    weights: Sequence[float],
    size: int,
    cache_dir: str | None,
    barrier: Callable[[], None] | None = None,
) -> CacheEntry:
    description = {
        "kind": "blend_index",
        "version": BLEND_INDEX_VERSION,
        "weights": [float(w) for w in weights],
        "size": int(size),
    }

    def build():
        d, s = blend_indices(weights, size)
        return {"dataset_index": d, "dataset_sample_index": s}, {}

    return load_or_build(
        "blend_index",
        description,
        ("dataset_index", "dataset_sample_index"),
        build,
        cache_dir,
        barrier,
    )


def _check_num_samples(train_valid_test_num_samples) -> list[int]:
    values = list(train_valid_test_num_samples)
    if len(values) != 3:
        raise ValueError(
            f"train_valid_test_num_samples must be 3 counts (train, valid, test), got {values!r}"
        )
    out = []
    for name, v in zip(SPLIT_NAMES, values):
        v = 0 if v is None else v
        if isinstance(v, bool) or int(v) != v or v < 0:
            raise ValueError(f"number of {name} samples must be an integer >= 0, got {v!r}")
        out.append(int(v))
    return out


def train_samples_per_dataset(
    config: DataConfig, barrier: Callable[[], None] | None = None
) -> list[int]:
    """Samples in one pass of the BERT sample mapping over each --data-path dataset's train
    split, in --data-path order (their sum is SAS's instance count before rounding to whole
    batches). Call it on every rank (it synchronises on the cache with ``barrier``)."""
    config.validate_files()
    counts, train = [], SPLIT_NAMES[0]
    for prefix in config.prefixes:
        ds = IndexedDataset(prefix)
        doc_range = get_split_document_ranges(ds.num_documents, config.split)[0]
        if doc_range[0] == doc_range[1]:
            raise ConfigError(
                f"--split: {config.split!r} gives the train split none of the documents of {prefix}"
            )
        entry = get_sample_index(
            ds, config, train, doc_range, None, config.cache_dir(), num_epochs=1, barrier=barrier
        )
        counts.append(int(entry.arrays["sample_index"].shape[0]))
    return counts


def _empty_split_note(split: str, name: str, prefixes, datasets, empty: list[int]) -> str:
    share = 100 * parse_split(split)[SPLIT_NAMES.index(name)]
    docs = min(datasets[k].num_documents for k in empty)
    where = ", ".join(prefixes[k] for k in empty)
    return (
        f"--split {split} gives the {name} split {share:.2g}% of the {docs} documents of "
        f"{where}, which rounds to none: {name} evaluation is skipped (a {name} share of about "
        f"{100 / max(docs, 1):.2g}% or more would give it a document)"
    )


def build_train_valid_test_datasets(
    config: DataConfig,
    tokenizer: Any,
    train_valid_test_num_samples: Sequence[int | None],
    barrier: Callable[[], None] | None = None,
) -> tuple[Any, Any, Any]:
    """(train, valid, test): a BertSampleDataset per split (a BlendedDataset of them with several
    prefixes), or None for a split with 0 samples requested. A valid or test split that --split
    leaves without documents is None too, with a one-line note; an empty train split is an error.

    Call it on every rank (it synchronises on the cache with ``barrier``, which several ranks
    need: parallel/comm.py's); the index files are built once, by global rank 0, and
    memory-mapped everywhere else.
    """
    config.validate_files()
    counts = _check_num_samples(train_valid_test_num_samples)
    prefixes, weights = config.prefixes, config.weights
    cache_dir = config.cache_dir()
    datasets = [IndexedDataset(p) for p in prefixes]
    ranges = [get_split_document_ranges(ds.num_documents, config.split) for ds in datasets]
    vocab_size = int(getattr(tokenizer, "vocab_size", len(tokenizer.word_start_mask())))
    common = {
        "seq_length": config.seq_length,
        "cls_id": tokenizer.cls_id,
        "sep_id": tokenizer.sep_id,
        "pad_id": tokenizer.pad_id,
        "word_start_mask": tokenizer.word_start_mask(),
        "special_token_mask": tokenizer.is_special_mask(),
    }
    if common["word_start_mask"].shape[0] != vocab_size:
        raise ValueError(
            f"--tokenizer-model: word_start_mask() has {common['word_start_mask'].shape[0]} "
            f"entries for a vocabulary of {vocab_size}"
        )

    def one(k: int, split: int, num_samples: int) -> BertSampleDataset:
        ds = datasets[k]
        doc_range = ranges[k][split]
        name = SPLIT_NAMES[split]
        entry = get_sample_index(
            ds, config, name, doc_range, num_samples, cache_dir, barrier=barrier
        )
        info = dict(entry.info, doc_range=list(doc_range), split=name, status=entry.status)
        return BertSampleDataset(
            ds, entry.arrays["sample_index"], name=f"{ds.path_prefix} [{name}]", info=info, **common
        )

    result: list[Any] = []
    for split, n in enumerate(counts):
        empty = [k for k in range(len(datasets)) if ranges[k][split][0] == ranges[k][split][1]]
        if n and empty:
            name = SPLIT_NAMES[split]
            if split == 0:
                raise ConfigError(
                    f"--split: {config.split!r} gives the train split none of the documents of "
                    f"{', '.join(prefixes[k] for k in empty)}, but {n} train samples were "
                    "requested; give the train split a larger share"
                )
            # Small corpora routinely round a 0.1% test share down to no document: evaluation
            # on that split is skipped (a note, sized to the data), not the run refused.
            logger.info(
                "note: %s", _empty_split_note(config.split, name, prefixes, datasets, empty)
            )
            n = 0
        if n == 0:
            result.append(None)
        elif len(datasets) == 1:
            result.append(one(0, split, n))
        else:
            blend = get_blend_index(weights, n, cache_dir, barrier)
            d_index = blend.arrays["dataset_index"]
            s_index = blend.arrays["dataset_sample_index"]
            per_dataset = samples_per_dataset(weights, n, d_index)
            parts = [one(k, split, per_dataset[k]) for k in range(len(datasets))]
            result.append(
                BlendedDataset(
                    parts, weights, n, dataset_index=d_index, dataset_sample_index=s_index
                )
            )
    return result[0], result[1], result[2]

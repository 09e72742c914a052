"""SAS batches: each instance's replaced set S and the tokens placed there.

S (paper, eq. 1): ceil(mask_prob * k) of the instance's k real non-special tokens, drawn as
whole words in a random order seeded by (seed, instance id). It is the same in every epoch:
the tokens the model samples at S in epoch t are what it reads at S in epoch t+1, so S
must not move (docs/sas_model.md). To keep |S| exactly ceil(mask_prob * k) (and store rows
fixed-width), the last word drawn may be cut.

The tokens placed at S come from a ``ReplacementSource``: the cold-start distribution
(unigram counts of the corpus, or uniform over the non-special vocabulary), or in later
epochs the tokens the model itself sampled (the self-augmentation store). No [MASK] token:
SAS never uses it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from megatron_taco.arguments import ConfigError, option, require
from megatron_taco.data.indexed_dataset import unigram_path
from megatron_taco.data.masking import IGNORE_INDEX, sample_spans, word_units

COLD_STARTS = ("unigram", "uniform")
SELECT_STREAM = 2  # TACO's collator uses streams 0 and 1
COLD_STREAM = 3


@dataclasses.dataclass(frozen=True)
class ReplacementConfig:
    mask_prob: float = option(
        0.15,
        "Fraction of each instance's real tokens that are replaced (|S| = ceil of it).",
        flag="--mask-prob",
    )
    cold_start: str = option(
        "unigram",
        "Distribution of the first epoch's replacements: the corpus's unigram token counts "
        "(the {prefix}_unigram.npy files of --data-path, blended by their weights) or uniform "
        "over the non-special vocabulary.",
        flag="--cold-start",
        choices=COLD_STARTS,
    )

    def __post_init__(self) -> None:
        require(
            0.0 < self.mask_prob < 1.0,
            type(self),
            "mask_prob",
            f"must be in (0, 1), got {self.mask_prob}",
        )
        require(
            self.cold_start in COLD_STARTS,
            type(self),
            "cold_start",
            f"must be one of {COLD_STARTS}, got {self.cold_start!r}",
        )

    def width(self, seq_length: int) -> int:
        """Largest |S|: slots per instance (a store row)."""
        return math.ceil(self.mask_prob * (seq_length - 2))


def replaced_positions(
    word_starts: np.ndarray, special: np.ndarray, length: int, mask_prob: float, seed: int, index
) -> np.ndarray:
    """S of one instance: int64 token positions, in draw order (the order of a store row)."""
    maskable = ~np.asarray(special, dtype=bool)
    maskable[length:] = False
    k = int(maskable.sum())
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    budget = math.ceil(mask_prob * k)
    starts, ends, linked = word_units(word_starts, maskable)
    rng = np.random.default_rng([int(seed), int(index), SELECT_STREAM])
    # One-word spans: whole words in a uniformly random order until the budget is covered.
    first, _, _ = sample_spans(ends - starts, linked, budget, rng, geometric_p=1.0, max_span=1)
    words = [np.arange(starts[u], ends[u]) for u in first]
    return np.concatenate(words)[:budget].astype(np.int64)


def cold_start_probs(
    config: ReplacementConfig,
    prefixes: Sequence[str],
    weights: Sequence[float],
    special: np.ndarray,
) -> np.ndarray:
    """float64 [vocab] probabilities of the first epoch's replacements; specials get 0.
    Unigram: each dataset's counts normalised, then mixed by the --data-path weights."""
    special = np.asarray(special, dtype=bool)
    vocab = special.shape[0]
    if config.cold_start == "uniform":
        probs = (~special).astype(np.float64)
    else:
        probs = np.zeros(vocab, dtype=np.float64)
        for prefix, weight in zip(prefixes, weights):
            probs += weight * _unigram_distribution(prefix, vocab, special)
    total = probs.sum()
    if total <= 0:
        raise ConfigError("--cold-start: the distribution has no non-special token")
    return probs / total


def _unigram_distribution(prefix: str, vocab: int, special: np.ndarray) -> np.ndarray:
    path = unigram_path(prefix)
    if not os.path.isfile(path):
        raise ConfigError(
            f"--cold-start unigram: {path} does not exist (tools/preprocess_data.py writes it "
            "beside each dataset; or use --cold-start uniform)"
        )
    try:
        counts = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--cold-start unigram: {path} is not a .npy array: {e}") from None
    if counts.ndim != 1 or counts.shape[0] != vocab or not np.issubdtype(counts.dtype, np.integer):
        raise ConfigError(
            f"--cold-start unigram: {path} holds {counts.dtype} {counts.shape}, expected integer "
            f"counts of shape ({vocab},) for the --tokenizer-model's vocabulary"
        )
    counts = np.where(special, 0, counts).astype(np.float64)
    if counts.sum() <= 0:
        raise ConfigError(f"--cold-start unigram: {path} counts no non-special token")
    return counts / counts.sum()


class ReplacementSource(Protocol):
    def replacements(self, instance: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Tokens (int64, len(positions)) placed at S of ``instance`` in ``epoch``."""


class ColdStart:
    """Draws from a fixed distribution, seeded by (seed, instance, epoch)."""

    def __init__(self, probs: np.ndarray, seed: int) -> None:
        self.cdf = np.cumsum(np.asarray(probs, dtype=np.float64))
        self.cdf /= self.cdf[-1]
        self.seed = int(seed)

    def replacements(self, instance: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(instance), COLD_STREAM, int(epoch)])
        draws = np.searchsorted(self.cdf, rng.random(positions.shape[0]), side="right")
        return np.minimum(draws, self.cdf.shape[0] - 1).astype(np.int64)


class SasCollator:
    """DataLoader collate_fn: samples (with ``index`` = instance id and ``epoch``) -> the
    batch SasForPretraining reads, plus ``instance_ids`` [b], ``epoch`` [b] and
    ``replaced_positions`` [b, W] (-1 padded) for the self-augmentation sampler."""

    def __init__(
        self,
        *,
        pad_id: int,
        seq_length: int,
        seed: int,
        config: ReplacementConfig,
        source: ReplacementSource,
    ) -> None:
        self.pad_id, self.seq_length, self.seed = int(pad_id), int(seq_length), int(seed)
        self.config = config
        self.source = source
        self.width = config.width(seq_length)

    def positions(self, sample: Mapping[str, Any]) -> np.ndarray:
        return replaced_positions(
            sample["word_starts"],
            sample["special"],
            int(sample["length"]),
            self.config.mask_prob,
            self.seed,
            sample["index"],
        )

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        b, s = len(samples), self.seq_length
        if b == 0:
            raise ValueError("cannot collate an empty batch")
        input_ids = np.full((b, s), self.pad_id, dtype=np.int64)
        mlm_labels = np.full((b, s), IGNORE_INDEX, dtype=np.int64)
        rtd_labels = np.full((b, s), IGNORE_INDEX, dtype=np.int64)
        positions = np.full((b, self.width), -1, dtype=np.int64)
        instances = np.empty(b, dtype=np.int64)
        epochs = np.empty(b, dtype=np.int64)
        for i, sample in enumerate(samples):
            tokens = np.asarray(sample["tokens"], dtype=np.int64)
            length = int(sample["length"])
            instance, epoch = int(sample["index"]), int(sample.get("epoch", 0))
            where = self.positions(sample)
            replaced = tokens.copy()
            replaced[where] = self.source.replacements(instance, epoch, where)
            input_ids[i] = replaced
            mlm_labels[i, where] = tokens[where]
            # RTD over every real token ([CLS]/[SEP] included, as ELECTRA): 1 = replaced. A
            # replacement equal to the original is "original" (paper, eq. 5).
            rtd_labels[i, :length] = replaced[:length] != tokens[:length]
            positions[i, : where.shape[0]] = where
            instances[i], epochs[i] = instance, epoch
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(np.arange(s) < _lengths(samples)[:, None]),
            "mlm_labels": torch.from_numpy(mlm_labels),
            "rtd_labels": torch.from_numpy(rtd_labels),
            "instance_ids": torch.from_numpy(instances),
            "epoch": torch.from_numpy(epochs),
            "replaced_positions": torch.from_numpy(positions),
        }


def _lengths(samples: Sequence[Mapping[str, Any]]) -> np.ndarray:
    return np.asarray([int(sample["length"]) for sample in samples], dtype=np.int64)

"""SAS batches: each instance's replaced set S and the tokens placed there.

S (paper, eq. 1): ceil(mask_prob * k) of the instance's k real non-special tokens, drawn as
whole words in a random order. With self-augmentation it is seeded by (seed, instance id) and
the same in every epoch: the tokens the model samples at S in epoch t are what it reads at S
in epoch t+1, so S must not move (docs/sas_model.md). Without it (the Unig-MLM-RTD
ablation) nothing links two epochs, and S is drawn afresh per epoch, seeded by (seed,
instance, epoch): the paper's dynamic masking. To keep |S| exactly ceil(mask_prob * k) (and
store rows fixed-width), the last word drawn may be cut.

The tokens placed at S come from a ``ReplacementSource``: the cold-start distribution
(unigram counts of the corpus, or uniform over the non-special vocabulary; optionally
flattened to p^power for the run's first iterations, the reference release's warm-up), or
in later epochs the tokens the model itself sampled (the self-augmentation store). With
``drop_hits`` a stored token equal to the original drops its position from S (the reference
release). The paper's SAS never reads [MASK]; the reference release's ``mask`` and ``mlm``
cold starts put it at S in the first epoch only (``MaskedColdStart``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from megatron_taco.arguments import option, require
from megatron_taco.data.indexed_dataset import unigram_path
from megatron_taco.data.masking import IGNORE_INDEX, sample_spans, word_units
from megatron_taco.data.replacement_store import ReplacementStoreError
from megatron_taco.errors import ConfigError
from megatron_taco.model_outputs import DATA_FAULT

COLD_STARTS = ("unigram", "uniform", "mask", "mlm")
# The reference release's cold starts that put [MASK] at S (not the paper's text).
MASKED_COLD_STARTS = ("mask", "mlm")
SELECT_STREAM = 2  # TACO's collator uses streams 0 and 1
COLD_STREAM = 3
MASK_SHARE_STREAM = 4
KEEP = -1  # a source's "leave the original token here" (BERT's 10% kept)
# BERT's split of the selected positions under the ``mlm`` cold start: [MASK], random, kept.
BERT_MASK_SHARE, BERT_RANDOM_SHARE = 0.8, 0.1


@dataclasses.dataclass(frozen=True)
class ReplacementConfig:
    mask_prob: float = option(
        0.15,
        "Fraction of each instance's real tokens that are replaced (|S| = ceil of it).",
        flag="--mask-prob",
    )
    cold_start: str = option(
        "unigram",
        "The first epoch's replacements at S: 'unigram' draws from the corpus's unigram token "
        "counts (the {prefix}_unigram.npy files of --data-path, blended by their weights; the "
        "paper), 'uniform' over the non-special vocabulary (the paper's Table 4 alternative). "
        "The reference release's options, not the paper's text: 'mask' puts [MASK] at every "
        "position of S (RTD label 1 there); 'mlm' is BERT's masked LM over S (80%% [MASK], 10%% "
        "a uniform random token, 10%% kept), with MLM labels only: no RTD loss in the first "
        "epoch. From epoch 2 the model's own samples replace S whichever is chosen.",
        flag="--cold-start",
        choices=COLD_STARTS,
    )
    cold_start_warmup_iters: int = option(
        0,
        "For the run's first N iterations draw the cold-start replacements from the cold-start "
        "distribution raised to --cold-start-warmup-power and renormalised (the reference "
        "release: 1000 iterations of unigram^0.5); 0 = off, as in the paper.",
        flag="--cold-start-warmup-iters",
    )
    cold_start_warmup_power: float = option(
        0.5,
        "Power of the cold-start distribution during --cold-start-warmup-iters (< 1 flattens it).",
        flag="--cold-start-warmup-power",
    )

    stored_mask_share: float = option(
        0.0,
        "A departure from the paper, off by default (SCRIPT keeps [MASK] in the MLM pass of a "
        "single-network generator/critic): in the epochs that read the self-augmentation "
        "store, this share of each instance's S reads [MASK] instead of its stored sample "
        "(MLM label kept; no RTD label there, a [MASK] being trivially replaced), the rest the "
        "stored sample. The model's softmax at every position of S is sampled and stored as "
        "always (at a [MASK], a generator's sample).",
        flag="--stored-mask-share",
    )

    def __post_init__(self) -> None:
        cls, cold = type(self), self.cold_start
        share, prob = self.stored_mask_share, self.mask_prob
        iters, power = self.cold_start_warmup_iters, self.cold_start_warmup_power
        require(0.0 <= share <= 1.0, cls, "stored_mask_share", f"must be in [0, 1], got {share}")
        require(0.0 < prob < 1.0, cls, "mask_prob", f"must be in (0, 1), got {prob}")
        require(
            cold in COLD_STARTS, cls, "cold_start", f"must be one of {COLD_STARTS}, got {cold!r}"
        )
        iters_ok = isinstance(iters, int) and iters >= 0
        require(iters_ok, cls, "cold_start_warmup_iters", f"must be an integer >= 0, got {iters!r}")
        require(
            cold not in MASKED_COLD_STARTS or iters == 0,
            cls,
            "cold_start_warmup_iters",
            f"flattens a sampled cold start; --cold-start {cold} draws no cold-start "
            "samples to flatten (drop --cold-start-warmup-iters)",
        )
        power_ok = math.isfinite(power) and power > 0
        require(power_ok, cls, "cold_start_warmup_power", f"must be > 0, got {power}")

    def width(self, seq_length: int) -> int:
        """Largest |S|: slots per instance (a store row)."""
        return math.ceil(self.mask_prob * (seq_length - 2))


def replaced_positions(
    word_starts: np.ndarray,
    special: np.ndarray,
    length: int,
    mask_prob: float,
    seed: int,
    index,
    epoch: int | None = None,
) -> np.ndarray:
    """S of one instance: int64 token positions, in draw order (the order of a store row).
    ``epoch`` None: the same S in every epoch; else S seeded by the epoch too."""
    maskable = ~np.asarray(special, dtype=bool)
    maskable[length:] = False
    k = int(maskable.sum())
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    budget = math.ceil(mask_prob * k)
    starts, ends, linked = word_units(word_starts, maskable)
    key = [int(seed), int(index), SELECT_STREAM]
    rng = np.random.default_rng(key if epoch is None else [*key, int(epoch)])
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
    """float64 [vocab] probabilities of the first epoch's sampled replacements; specials get
    0. Unigram: each dataset's counts normalised, then mixed by the --data-path weights. The
    masked cold starts' random tokens are uniform, as BERT's."""
    special = np.asarray(special, dtype=bool)
    vocab = special.shape[0]
    if config.cold_start != "unigram":
        probs = (~special).astype(np.float64)
    else:
        probs = np.zeros(vocab, dtype=np.float64)
        for prefix, weight in zip(prefixes, weights):
            probs += weight * _unigram_distribution(prefix, vocab, special)
    total = probs.sum()
    if total <= 0:
        raise ConfigError("--cold-start: the distribution has no non-special token")
    return probs / total


def tempered(probs: np.ndarray, power: float) -> np.ndarray:
    """probs ** power, renormalised (zeros stay zero): power 0.5 is the reference release's
    unigram^0.5 warm-up."""
    out = np.power(np.asarray(probs, dtype=np.float64), float(power))
    return out / out.sum()


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
    def replacements(
        self, instance: int, epoch: int, positions: np.ndarray, global_index: int | None = None
    ) -> np.ndarray:
        """Tokens (int64, len(positions)) placed at S of ``instance`` in ``epoch``;
        ``global_index`` is the sample's place in the training stream (None in evaluation)."""

    def reads_store(self, epoch: int) -> bool:
        """Whether the tokens of ``epoch`` come from the self-augmentation store."""

    def detects(self, epoch: int) -> bool:
        """Whether ``epoch``'s batches carry RTD labels (False: MLM only, no RTD term)."""


def _cdf(probs: np.ndarray) -> np.ndarray:
    cdf = np.cumsum(np.asarray(probs, dtype=np.float64))
    return cdf / cdf[-1]


class ColdStart:
    """Draws from a fixed distribution, seeded by (seed, instance, epoch); the first
    ``warmup_samples`` samples of the training stream draw from ``warmup_probs`` instead."""

    def __init__(
        self,
        probs: np.ndarray,
        seed: int,
        *,
        warmup_probs: np.ndarray | None = None,
        warmup_samples: int = 0,
    ) -> None:
        self.cdf = _cdf(probs)
        self.seed = int(seed)
        self.warmup_samples = int(warmup_samples) if warmup_probs is not None else 0
        self.warmup_cdf = _cdf(warmup_probs) if self.warmup_samples else None

    def replacements(
        self, instance: int, epoch: int, positions: np.ndarray, global_index: int | None = None
    ) -> np.ndarray:
        cdf = self.cdf
        warm = self.warmup_cdf is not None and global_index is not None
        if warm and global_index < self.warmup_samples:
            cdf = self.warmup_cdf
        rng = np.random.default_rng([self.seed, int(instance), COLD_STREAM, int(epoch)])
        draws = np.searchsorted(cdf, rng.random(positions.shape[0]), side="right")
        return np.minimum(draws, cdf.shape[0] - 1).astype(np.int64)

    def reads_store(self, epoch: int) -> bool:
        return False

    def detects(self, epoch: int) -> bool:
        return True


class MaskedColdStart:
    """The reference release's ``mask`` and ``mlm`` cold starts: [MASK] at every position of
    S, or BERT's 80% [MASK] / 10% a token drawn from ``probs`` / 10% KEEP (the collator puts
    the original back), seeded by (seed, instance, epoch). ``mlm`` batches carry no RTD
    labels."""

    def __init__(self, kind: str, probs: np.ndarray, mask_id: int, seed: int) -> None:
        if kind not in MASKED_COLD_STARTS:
            raise ValueError(f"not a masked cold start: {kind!r}")
        self.kind, self.cdf = kind, _cdf(probs)
        self.mask_id, self.seed = int(mask_id), int(seed)

    def replacements(
        self, instance: int, epoch: int, positions: np.ndarray, global_index: int | None = None
    ) -> np.ndarray:
        n = positions.shape[0]
        out = np.full(n, self.mask_id, dtype=np.int64)
        if self.kind == "mask":
            return out
        rng = np.random.default_rng([self.seed, int(instance), COLD_STREAM, int(epoch)])
        u, r = rng.random(n), rng.random(n)
        random_token = np.minimum(np.searchsorted(self.cdf, r, side="right"), self.cdf.shape[0] - 1)
        share = BERT_MASK_SHARE + BERT_RANDOM_SHARE
        out = np.where(u >= BERT_MASK_SHARE, random_token, out)
        return np.where(u >= share, KEEP, out).astype(np.int64)

    def reads_store(self, epoch: int) -> bool:
        return False

    def detects(self, epoch: int) -> bool:
        return self.kind != "mlm"


def make_cold_start(
    config: ReplacementConfig,
    probs: np.ndarray,
    seed: int,
    *,
    mask_id: int,
    warmup_samples: int = 0,
) -> ColdStart | MaskedColdStart:
    """The first epoch's ``ReplacementSource`` for --cold-start (``probs`` from
    cold_start_probs); ``warmup_samples`` training samples from probs^power first."""
    if config.cold_start in MASKED_COLD_STARTS:
        return MaskedColdStart(config.cold_start, probs, mask_id, seed)
    warmup = tempered(probs, config.cold_start_warmup_power) if warmup_samples else None
    return ColdStart(probs, seed, warmup_probs=warmup, warmup_samples=warmup_samples)


class SasCollator:
    """DataLoader collate_fn: samples (with ``index`` = instance id, ``epoch`` and
    ``global_index``) -> the batch SasForPretraining reads, plus for the self-augmentation
    sampler ``instance_ids`` [b], ``epoch`` [b], ``replaced_positions`` [b, W] (S in draw
    order, -1 padded: slot j of a store row is position replaced_positions[:, j]),
    ``dropped_slots`` [b, W] (slots of S dropped as hits: read unreplaced, no MLM label) and
    ``from_store`` [b] (how many of the row's kept slots hold a token read from the store).

    ``fixed_positions``: S is the same in every epoch (needed by self-augmentation); False
    draws it afresh per epoch. ``drop_hits``: drop store tokens equal to the original."""

    def __init__(
        self,
        *,
        pad_id: int,
        seq_length: int,
        seed: int,
        config: ReplacementConfig,
        source: ReplacementSource,
        fixed_positions: bool = True,
        drop_hits: bool = False,
        mask_id: int | None = None,
    ) -> None:
        if config.stored_mask_share and mask_id is None:
            raise ValueError("--stored-mask-share needs the tokenizer's [MASK] id (mask_id)")
        self.mask_id = mask_id
        self.pad_id, self.seq_length, self.seed = int(pad_id), int(seq_length), int(seed)
        self.config = config
        self.source = source
        self.width = config.width(seq_length)
        self.fixed_positions = bool(fixed_positions)
        self.drop_hits = bool(drop_hits)

    def positions(self, sample: Mapping[str, Any]) -> np.ndarray:
        return replaced_positions(
            sample["word_starts"],
            sample["special"],
            int(sample["length"]),
            self.config.mask_prob,
            self.seed,
            sample["index"],
            None if self.fixed_positions else int(sample.get("epoch", 0)),
        )

    def _stored_masks(self, instance: int, epoch: int, drop: np.ndarray) -> np.ndarray | None:
        """Which slots of S read [MASK] in a self-augmentation epoch (None: none), seeded by
        (seed, instance, epoch); a dropped hit is never one."""
        share = self.config.stored_mask_share
        if share <= 0:
            return None
        rng = np.random.default_rng([self.seed, int(instance), MASK_SHARE_STREAM, int(epoch)])
        return (rng.random(drop.shape[0]) < share) & ~drop

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        b, s = len(samples), self.seq_length
        if b == 0:
            raise ValueError("cannot collate an empty batch")
        input_ids = np.full((b, s), self.pad_id, dtype=np.int64)
        mlm_labels = np.full((b, s), IGNORE_INDEX, dtype=np.int64)
        rtd_labels = np.full((b, s), IGNORE_INDEX, dtype=np.int64)
        positions = np.full((b, self.width), -1, dtype=np.int64)
        dropped = np.zeros((b, self.width), dtype=bool)
        from_store = np.zeros(b, dtype=np.int64)
        instances = np.empty(b, dtype=np.int64)
        epochs = np.empty(b, dtype=np.int64)
        lengths = np.empty(b, dtype=np.int64)
        fault = None
        for i, sample in enumerate(samples):
            tokens = np.asarray(sample["tokens"], dtype=np.int64)
            length = int(sample["length"])
            instance, epoch = int(sample["index"]), int(sample.get("epoch", 0))
            where = self.positions(sample)
            try:
                placed = self.source.replacements(
                    instance, epoch, where, sample.get("global_index")
                )
            except (ReplacementStoreError, OSError) as e:
                # Raised here it would stop this rank alone (in a DataLoader worker) while
                # the others wait in a collective: the batch carries the line instead, with
                # the originals in S, and the loop stops every rank with it (DATA_FAULT).
                fault = fault or f"--replacement-store: {e}"
                placed = np.full(where.shape, KEEP)
            placed = np.where(placed == KEEP, tokens[where], placed)
            stored = self.source.reads_store(epoch)
            hits = placed == tokens[where]
            drop = hits if (stored and self.drop_hits) else np.zeros_like(hits)
            kept = where[~drop]
            masked = self._stored_masks(instance, epoch, drop) if stored else None
            if masked is not None:
                placed = np.where(masked, self.mask_id, placed)
            replaced = tokens.copy()
            replaced[where] = placed  # a dropped hit places the original: unchanged
            input_ids[i] = replaced
            mlm_labels[i, kept] = tokens[kept]
            # RTD over every real token ([CLS]/[SEP] included, as ELECTRA): 1 = replaced. A
            # replacement equal to the original is "original" (paper, eq. 5). None in the
            # ``mlm`` cold start's epoch: MLM only; none at a [MASK] of --stored-mask-share.
            if self.source.detects(epoch):
                rtd_labels[i, :length] = replaced[:length] != tokens[:length]
                if masked is not None:
                    rtd_labels[i, where[masked]] = IGNORE_INDEX
            positions[i, : where.shape[0]] = where
            dropped[i, : where.shape[0]] = drop
            read = kept.shape[0] - (0 if masked is None else int(masked.sum()))
            from_store[i] = read if stored else 0
            instances[i], epochs[i], lengths[i] = instance, epoch, length
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(np.arange(s) < lengths[:, None]),
            "mlm_labels": torch.from_numpy(mlm_labels),
            "rtd_labels": torch.from_numpy(rtd_labels),
            "instance_ids": torch.from_numpy(instances),
            "epoch": torch.from_numpy(epochs),
            "replaced_positions": torch.from_numpy(positions),
            "dropped_slots": torch.from_numpy(dropped),
            "from_store": torch.from_numpy(from_store),
        }
        if fault is not None:
            batch[DATA_FAULT] = fault
        return batch

"""The BERT sample index: which sentences of which document form each training sample.

Semantics follow Megatron's BERT mapping (``build_mapping`` in megatron-core's
``datasets/helpers.cpp``), computed with vectorised numpy instead of a compiled loop:

* Sentences of one document are packed greedily until the sample holds at least its target
  number of tokens; a sample never crosses a document boundary. The target is the longest
  body that fits (``max_seq_length`` minus [CLS] and [SEP]); with probability
  ``short_seq_prob`` it is drawn uniformly from ``[2, longest]`` instead.
* A sample is only closed early (before the document ends) when it has at least
  ``min_sentences`` sentences *and* at least ``min_sentences`` sentences remain for the
  next one, so every sample has ``min_sentences`` sentences or is a whole document that
  has them. Megatron requires "more than one remaining", which is the same thing for the
  default ``min_sentences=2``.
* Documents with fewer than ``min_sentences`` sentences are skipped.
* Each row is ``(first sentence, end sentence (exclusive), target length)``. Because the
  sample is closed only once the target is *reached*, its last sentence usually overshoots;
  the dataset truncates the body to the target (Megatron does the same).

Deliberate differences from Megatron (so indices are not interchangeable with its cache):

* Over-long sentences. Megatron drops every document that contains a sentence longer than
  512 tokens. Here such documents are kept: a sentence longer than the longest target
  closes its sample at once (the packing rule already does that) and the dataset
  truncates it, so the rest of the document is still used. They are counted in
  :class:`SampleIndexStats` (``long_sentences``, and the tokens lost in
  ``truncated_tokens``) so a corpus with many of them (tables, lists that the sentence
  splitter could not split) is noticed. Splitting them into several samples would need
  token offsets in the index, which its three-column format (shared with Megatron) has
  no room for; re-preprocess such corpora with a better sentence splitter instead.
* Randomness. Megatron draws each sample's target length from one mt19937 stream as the
  packing walks the corpus, which is inherently sequential. Here the target of a sample
  is a counter-based draw (splitmix64 of seed, epoch and the sentence it starts at), so
  it is computed only where a sample starts, for every document and epoch at once. Sample
  starts are distinct sentences, so targets are independent per sample with exactly
  probability ``short_seq_prob`` of being short (Megatron rounds to ``1/round(1/p)``).
* Shuffling. Each epoch's rows, in corpus order, are shuffled on their own and epochs are
  concatenated, so every document is seen once per epoch before any is repeated (Megatron
  shuffles all epochs together). With ``num_samples`` the index is cut to exactly
  ``num_samples`` rows.

Speed: the packing is a chain ``start -> next start`` per document and epoch. The chains of
all documents of many epochs are followed in lock-step, one sample of each per round (one
``searchsorted`` on the token cumsum for all of them), so the work is proportional to the
samples, not the sentences, and the numpy calls to the longest chain: building 40 epochs
costs about what megatron-core's compiled loop does (benchmarks/bench_samples.py). Chains
still going after ``_LOCKSTEP_ROUNDS`` rounds (documents of thousands of sentences) are
finished by pointer doubling over their remaining sentences, O(sentences x log(chain)).
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass

import numpy as np

from megatron_taco.errors import ConfigError

logger = logging.getLogger(__name__)

# Part of every cache key: bump it whenever the rows this module produces change for the
# same inputs, so stale cached indices are rebuilt instead of silently reused.
SAMPLE_INDEX_VERSION = 2  # 2: counter-based targets, all epochs of a build at once

NUM_SPECIAL_TOKENS = 2  # [CLS] ... [SEP]; no NSP, so a single segment
MIN_TARGET_LENGTH = 2  # the shortest short-sequence target (Megatron's)
SPLIT_NAMES = ("train", "valid", "test")

# Independent streams derived from the seed: whether a target is short, its length, and
# the per-epoch shuffle must not share draws, or changing one would change the others.
_SHORT_STREAM = 0
_SHUFFLE_STREAM = 1
_LENGTH_STREAM = 2

# Lock-step rounds (one sample per still-going chain each) before pointer doubling takes the
# rest. Both give the same rows: this only trades numpy-call overhead for work. (A fixed
# count: the order rows come out in, which the shuffle permutes, must not depend on how
# many epochs are walked together.)
_LOCKSTEP_ROUNDS = 256
# (document, epoch) chains walked together: bounds the lock-step's memory (~100 bytes each).
# At most 2**15 epochs at once: the epoch slot is sorted as an int16.
_MAX_CHAINS = 1 << 21
_MAX_GROUP = 1 << 15

_U32 = np.uint32
_GOLDEN32 = _U32(0x9E3779B9)


@dataclass(frozen=True)
class SampleIndexStats:
    """What build_sample_index_with_stats did, for logs and the build_samples summary."""

    documents: int  # documents in the range
    empty_documents: int  # no sentences (skipped)
    short_documents: int  # 1 <= sentences < min_sentences (skipped)
    long_sentences: int  # sentences longer than the longest target, in used documents
    epochs: int
    samples: int  # rows in the index
    short_target_samples: int  # rows whose target is shorter than the longest
    tokens: int  # body tokens kept over all rows (after truncation to the target)
    truncated_tokens: int  # body tokens cut by truncation to the target


def parse_split(split: str) -> list[float]:
    """``"949,50,1"`` (or ``"949/50/1"``; missing parts are 0) -> normalised train/valid/test."""
    if not isinstance(split, str) or not split.strip():
        raise ConfigError(f"--split: expected weights like '949,50,1', got {split!r}")
    parts = [p.strip() for p in re.split(r"[,/]", split.strip())]
    if len(parts) > 3:
        raise ConfigError(
            f"--split: {split!r} has {len(parts)} parts; give at most 3 (train,valid,test)"
        )
    values = []
    for p in parts:
        try:
            v = float(p)
        except ValueError:
            raise ConfigError(f"--split: {p!r} in {split!r} is not a number") from None
        if not np.isfinite(v) or v < 0:
            raise ConfigError(f"--split: weights must be finite and >= 0, got {p!r} in {split!r}")
        values.append(v)
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ConfigError(f"--split: weights {split!r} add up to 0; at least one must be > 0")
    return [v / total for v in values]


def get_split_document_ranges(num_docs: int, split: str) -> list[tuple[int, int]]:
    """Contiguous train/valid/test document ranges ``[(start, end), ...]``.

    megatron-core's rounding: the boundaries are the cumulative normalised weights times
    the number of documents, each rounded (Python's round, as megatron-core), so splits
    tile ``[0, num_docs)`` with no gap or overlap.
    """
    if isinstance(num_docs, bool) or not isinstance(num_docs, (int, np.integer)) or num_docs < 0:
        raise ValueError(f"num_docs must be an integer >= 0, got {num_docs!r}")
    cumulative = itertools.accumulate(parse_split(split))
    bounds = [0] + [min(int(round(c * num_docs)), int(num_docs)) for c in cumulative]
    bounds[-1] = int(num_docs)  # the float sum may land a hair below 1.0
    bounds = list(itertools.accumulate(bounds, max))
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def _check_inputs(sizes, document_indices, doc_range) -> tuple[np.ndarray, np.ndarray, int, int]:
    sizes = np.asarray(sizes)
    document_indices = np.asarray(document_indices)
    if sizes.ndim != 1 or sizes.dtype.kind not in "iu":
        raise ValueError(f"sizes must be a 1-D integer array, got {sizes.dtype} {sizes.shape}")
    if document_indices.ndim != 1 or document_indices.dtype.kind not in "iu":
        raise ValueError(
            "document_indices must be a 1-D integer array, got "
            f"{document_indices.dtype} {document_indices.shape}"
        )
    if document_indices.shape[0] < 1:
        raise ValueError("document_indices must hold at least the leading 0")
    num_docs = document_indices.shape[0] - 1
    try:
        start, end = (int(x) for x in doc_range)
    except (TypeError, ValueError):
        raise ValueError(f"doc_range must be a (start, end) pair, got {doc_range!r}") from None
    if not 0 <= start <= end <= num_docs:
        raise ValueError(f"doc_range {doc_range!r} is outside the {num_docs} documents")
    bounds = document_indices[start : end + 1].astype(np.int64)
    if np.any(np.diff(bounds) < 0):
        raise ValueError("document_indices must be non-decreasing")
    if bounds.shape[0] and (bounds[0] < 0 or bounds[-1] > sizes.shape[0]):
        raise ValueError(
            f"document_indices point at sentences [{bounds[0]}, {bounds[-1]}) but sizes has "
            f"{sizes.shape[0]} entries"
        )
    return sizes, bounds, start, end


def _hash32(x: np.ndarray) -> np.ndarray:
    """A well-mixing bijection of uint32 ("lowbias32", wrapping arithmetic; overwrites
    ``x``). 32-bit: numpy multiplies uint32 arrays with SIMD, uint64 ones one at a time."""
    x ^= x >> _U32(16)
    x *= _U32(0x7FEB352D)
    x ^= x >> _U32(15)
    x *= _U32(0x846CA68B)
    x ^= x >> _U32(16)
    return x


def _epoch_keys(seed: int, stream: int, epochs: np.ndarray) -> np.ndarray:
    """uint32 key of (seed, stream, epoch) for each of ``epochs``."""
    words = [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, stream]
    key = np.zeros(1, dtype=np.uint32)
    for w in words:
        key = _hash32(key ^ _U32((w + 0x9E3779B9) & 0xFFFFFFFF))
    return _hash32(key ^ (np.asarray(epochs).astype(np.uint32) * _GOLDEN32))


def _draw(keys: np.ndarray, sentences: np.ndarray) -> np.ndarray:
    """uint32 uniform for each (key, sentence) pair: a counter-based generator (sentence
    numbers are taken modulo 2**32)."""
    x = sentences.astype(np.uint32)
    x *= _GOLDEN32
    x ^= keys
    return _hash32(x)


class _Packing:
    """The packing rule over one dataset range (see the module docstring).

    Most samples do not depend on the epoch: a chain of full-length samples (the "base"
    chain of a document) is the same in every epoch until a sample start draws a short
    target. So the base chains are walked once; an epoch keeps each document's base rows
    up to its first short start, and only the chains from there on are walked again, in
    lock-step for all documents and epochs of a group. The rows are exactly those of
    walking every chain of every epoch (tests/unit/test_samples.py compares the two).
    """

    def __init__(self, cum, max_target, short_seq_prob, min_sentences, seed, offset, dtype):
        self.cum = cum
        self.dtype = dtype  # of the rows
        self.offset = offset  # dataset number of local sentence 0
        self.max_target = max_target
        self.short_seq_prob = short_seq_prob
        self.min_sentences = min_sentences
        self.seed = seed
        # P(draw < threshold) = short_seq_prob, to 2**-32
        self.threshold = _U32(min(round(short_seq_prob * 2**32), 2**32 - 1))
        # Where a full-length sample from each sentence closes, before the document rules.
        self.end_max = np.searchsorted(cum, cum[:-1] + max_target, side="left").astype(np.int64)
        self.base: tuple[np.ndarray, ...] | None = None
        self.base_packed: tuple[np.ndarray, ...] | None = None

    def set_epochs(self, epochs: np.ndarray) -> None:
        self.short_keys = _epoch_keys(self.seed, _SHORT_STREAM, epochs)
        self.length_keys = _epoch_keys(self.seed, _LENGTH_STREAM, epochs)

    def targets(self, ep: np.ndarray | None, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(target body lengths, positions of the short ones) of the samples of epoch slots
        ``ep`` starting at sentences ``start``; ``ep`` None: all full-length."""
        target = np.full(start.shape[0], self.max_target, dtype=np.int64)
        if ep is None or self.short_seq_prob <= 0:
            return target, np.zeros(0, dtype=np.int64)
        if self.short_seq_prob >= 1:
            short = np.arange(start.shape[0])
        else:
            short = np.flatnonzero(_draw(self.short_keys[ep], start) < self.threshold)
        u = _draw(self.length_keys[ep[short]], start[short]).astype(np.int64)
        span = self.max_target - MIN_TARGET_LENGTH + 1
        target[short] = MIN_TARGET_LENGTH + ((u * span) >> 32)  # uniform in [2, max_target]
        return target, short

    def close(self, start, target, short, doc_end) -> np.ndarray:
        """End (exclusive) of the samples starting at sentences ``start``.

        The first end with enough tokens and sentences; closing there is allowed only if
        enough sentences remain for another sample, otherwise the sample runs to the
        document end. Only the short targets need a search: the rest share end_max.
        """
        cum, ms = self.cum, self.min_sentences
        end = self.end_max[start]
        if short.size:
            s = start[short]
            end[short] = np.searchsorted(cum, cum[s] + target[short], side="left")
        np.maximum(end, start + ms, out=end)
        return np.where(end <= doc_end - ms, end, doc_end)

    def walk(self, ep, cur, cur_end):
        """(epoch slot, start, end, target) of the samples of the chains starting at ``cur``
        (each inside [cur, cur_end)), in (round, chain) order; ``ep`` None: the base chains
        (full-length targets; the epoch slots returned are then empty)."""
        parts: list[tuple[np.ndarray | None, ...]] = []
        for _ in range(_LOCKSTEP_ROUNDS):
            if cur.size == 0:
                break
            target, short = self.targets(ep, cur)
            end = self.close(cur, target, short, cur_end)
            parts.append((ep, cur, end, target))
            going = end < cur_end
            cur, cur_end = end[going], cur_end[going]
            ep = None if ep is None else ep[going]
        if cur.size:
            parts.append(self._doubling(ep, cur, cur_end))
        empty = np.zeros(0, dtype=np.int64)
        if not parts:
            return empty, empty, empty, empty
        eps = np.concatenate([empty if p[0] is None else p[0] for p in parts])
        return (eps, *(np.concatenate([p[i] for p in parts]) for i in (1, 2, 3)))

    def base_rows(self, doc_start: np.ndarray, doc_end: np.ndarray) -> int:
        """Samples in the base chains (full-length targets) of the documents."""
        if self.base is None:
            _, b_start, b_end, _ = self.walk(None, doc_start, doc_end)
            order = np.argsort(b_start, kind="stable")
            b_start, b_end = b_start[order], b_end[order]
            b_doc = np.searchsorted(doc_start, b_start, side="right") - 1
            b_first = np.searchsorted(b_doc, np.arange(doc_start.shape[0]))  # first of each doc
            self.base = (b_start, b_end, b_doc, b_first)
        return int(self.base[0].shape[0])

    def _packed(self, start, end, target) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows [n, 3] with dataset sentence numbers, body tokens kept, tokens cut)."""
        body = self.cum[end] - self.cum[start]
        kept = np.minimum(body, target)
        rows = np.empty((start.shape[0], 3), dtype=self.dtype)
        np.add(start, self.offset, out=rows[:, 0], casting="unsafe")
        np.add(end, self.offset, out=rows[:, 1], casting="unsafe")
        rows[:, 2] = target
        return rows, kept, body - kept

    def rows(self, doc_start: np.ndarray, doc_end: np.ndarray, epochs: np.ndarray):
        """(rows [n, 3], body tokens kept per row, tokens cut per row, per epoch slot
        (a, b, walked)): slot k's rows, in the order its shuffle permutes, are rows a..b-1
        (the base rows it keeps, by start) then rows ``walked`` (the ones walked again, by
        round, then document); that order depends on nothing but the epoch."""
        self.set_epochs(epochs)
        n_epochs = epochs.shape[0]
        self.base_rows(doc_start, doc_end)
        b_start, b_end, b_doc, b_first = self.base
        n_base = b_start.shape[0]
        # [epochs, base rows]: does that epoch draw a short target at that base start?
        if self.short_seq_prob <= 0:
            short = np.zeros((n_epochs, n_base), dtype=bool)
        elif self.short_seq_prob >= 1:
            short = np.ones((n_epochs, n_base), dtype=bool)
        else:
            x = (b_start.astype(np.uint32) * _GOLDEN32)[None, :] ^ self.short_keys[:, None]
            short = _hash32(x) < self.threshold
        # The first short start of each (epoch, document): short starts come in (epoch, base
        # row) order, so each group's first is where the group key changes.
        walk_e, walk_j = np.nonzero(short)
        group = walk_e * doc_start.shape[0] + b_doc[walk_j]
        first = np.ones(group.shape[0], dtype=bool)
        first[1:] = group[1:] != group[:-1]
        walk_e, walk_j = walk_e[first], walk_j[first]
        stop = np.full((n_epochs, doc_start.shape[0]), n_base, dtype=np.int32)
        stop[walk_e, b_doc[walk_j]] = walk_j
        # An epoch keeps a document's base rows before its first short start; the chains
        # from there on are walked again.
        keep = np.arange(n_base, dtype=np.int32) < stop[:, b_doc]
        w_ep, w_start, w_end, w_target = self.walk(walk_e, b_start[walk_j], doc_end[b_doc[walk_j]])
        keep_at = np.concatenate(([0], np.cumsum(keep.sum(axis=1))))
        n_keep = int(keep_at[-1])
        if self.base_packed is None:
            self.base_packed = self._packed(b_start, b_end, np.full(n_base, self.max_target))
        b_rows, b_kept, b_cut = self.base_packed
        w_rows, w_kept, w_cut = self._packed(w_start, w_end, w_target)
        rows = np.empty((n_keep + w_rows.shape[0], 3), dtype=self.dtype)
        for c in range(2):
            # The kept base rows, row-major (epoch by epoch), then the walked ones. (One 1-D
            # column at a time: numpy selects from a broadcast 2-D array far faster.)
            rows[:n_keep, c] = np.broadcast_to(b_rows[:, c], keep.shape)[keep]
        rows[:n_keep, 2] = self.max_target
        rows[n_keep:] = w_rows
        walked = n_keep + np.argsort(w_ep.astype(np.int16), kind="stable")  # radix: O(n)
        walk_at = np.concatenate(([0], np.cumsum(np.bincount(w_ep, minlength=n_epochs))))
        slots = [
            (int(keep_at[k]), int(keep_at[k + 1]), walked[walk_at[k] : walk_at[k + 1]])
            for k in range(n_epochs)
        ]
        # Per whole epoch: (tokens kept, tokens cut, short targets), from the base rows it
        # drops (few) rather than the ones it keeps.
        drop_e, drop_j = np.nonzero(~keep)

        def per_epoch(base_total, base_values, walked_values):
            dropped = np.bincount(drop_e, weights=base_values[drop_j], minlength=n_epochs)
            walked_sum = np.bincount(w_ep, weights=walked_values, minlength=n_epochs)
            return (base_total - dropped + walked_sum).round().astype(np.int64)

        sums = np.stack(
            [
                per_epoch(int(b_kept.sum()), b_kept, w_kept),
                per_epoch(int(b_cut.sum()), b_cut, w_cut),
                np.bincount(w_ep[w_target < self.max_target], minlength=n_epochs),
            ],
            axis=1,
        )
        return rows, slots, sums

    def _doubling(self, ep, cur, cur_end):
        """The rest of the chains starting at ``cur`` (each inside [cur, cur_end)) by pointer
        doubling over their remaining sentences."""
        lengths = cur_end - cur
        offset = np.concatenate(([0], np.cumsum(lengths)))
        n = int(offset[-1])
        chain = np.repeat(np.arange(cur.shape[0]), lengths)  # chain of each position
        sentence = np.arange(n) - offset[chain] + cur[chain]
        chain_ep = None if ep is None else ep[chain]
        chain_end = cur_end[chain]
        target, short = self.targets(chain_ep, sentence)
        end = self.close(sentence, target, short, chain_end)
        # The position of the next sample's start, or the sentinel n after the chain's end.
        jump = np.append(np.where(end < chain_end, np.arange(n) + (end - sentence), n), n)
        reached = np.zeros(n + 1, dtype=bool)
        reached[n] = True
        reached[offset[:-1]] = True
        # After k rounds `reached` holds every position within 2**k - 1 steps of a chain
        # start and `jump` is the 2**k-step successor; stop at the fixed point.
        while True:
            successors = jump[np.flatnonzero(reached)]
            new = successors[~reached[successors]]
            if new.size == 0:
                break
            reached[new] = True
            jump = jump[jump]
        at = np.flatnonzero(reached[:n])
        return (None if ep is None else chain_ep[at]), sentence[at], end[at], target[at]


def build_sample_index_with_stats(
    sizes,
    document_indices,
    doc_range,
    *,
    num_epochs: int | None = None,
    num_samples: int | None = None,
    max_seq_length: int,
    short_seq_prob: float,
    min_sentences: int,
    seed: int,
    compact: bool = False,
) -> tuple[np.ndarray, SampleIndexStats]:
    """(int64 [N, 3] rows ``(start_sentence, end_sentence_exclusive, target_length)``, what
    was skipped and truncated).

    ``sizes`` are the sentence lengths and ``document_indices`` the document boundaries of
    an indexed dataset; only documents ``doc_range = (first, end)`` are used. Exactly one
    of ``num_epochs`` (that many full passes) and ``num_samples`` (passes until there are
    that many rows, then cut) is given. See the module docstring for the semantics.
    ``compact``: int32 rows when every sentence number fits (what the cache stores: half the
    bytes to build, write and page in)."""
    if (num_epochs is None) == (num_samples is None):
        raise ValueError(
            f"give exactly one of num_epochs and num_samples (got {num_epochs}, {num_samples})"
        )
    if num_epochs is not None and (isinstance(num_epochs, bool) or int(num_epochs) < 1):
        raise ValueError(f"num_epochs must be >= 1, got {num_epochs!r}")
    if num_samples is not None and (isinstance(num_samples, bool) or int(num_samples) < 0):
        raise ValueError(f"num_samples must be >= 0, got {num_samples!r}")
    if int(max_seq_length) < NUM_SPECIAL_TOKENS + MIN_TARGET_LENGTH:
        raise ValueError(
            f"max_seq_length must be >= {NUM_SPECIAL_TOKENS + MIN_TARGET_LENGTH}, got {max_seq_length}"
        )
    if not 0.0 <= float(short_seq_prob) <= 1.0:
        raise ValueError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")
    if int(min_sentences) < 1:
        raise ValueError(f"min_sentences must be >= 1, got {min_sentences}")
    if int(seed) < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    max_target = int(max_seq_length) - NUM_SPECIAL_TOKENS
    min_sentences = int(min_sentences)
    fits = max(np.asarray(sizes).shape[0], max_target) < np.iinfo(np.int32).max
    index_dtype = np.int32 if compact and fits else np.int64

    sizes, bounds, _, _ = _check_inputs(sizes, document_indices, doc_range)
    num_docs = max(bounds.shape[0] - 1, 0)
    lo = int(bounds[0]) if num_docs else 0
    hi = int(bounds[-1]) if num_docs else 0
    local_sizes = np.asarray(sizes[lo:hi], dtype=np.int64)
    if local_sizes.size and local_sizes.min() < 0:
        raise ValueError("sizes must be >= 0")
    cum = np.zeros(local_sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(local_sizes, out=cum[1:])
    local_bounds = bounds - lo
    sentences_per_doc = np.diff(local_bounds)
    used = sentences_per_doc >= min_sentences
    used_start = local_bounds[:-1][used]
    used_end = local_bounds[1:][used]

    blocks = []  # (rows, chosen): the index, block by block
    tokens = truncated = short_targets = 0
    total = 0
    epoch = 0
    wanted = None if num_samples is None else int(num_samples)
    per_epoch = 0
    cap = min(_MAX_GROUP, max(1, _MAX_CHAINS // max(int(used.sum()), 1)))
    packing = _Packing(
        cum, max_target, float(short_seq_prob), min_sentences, int(seed), lo, index_dtype
    )
    while (wanted is None and epoch < int(num_epochs)) or (wanted is not None and total < wanted):
        if wanted is None:
            group = int(num_epochs) - epoch
        else:
            # Full-length chains are about an epoch's samples (a few % fewer: short
            # targets add some), so this rarely computes an epoch that is not used.
            per_epoch = per_epoch or max(packing.base_rows(used_start, used_end), 1)
            group = -(-(wanted - total) // per_epoch)
        group = min(group, cap)
        epochs = np.arange(epoch, epoch + group, dtype=np.int64)
        rows, slots, sums = packing.rows(used_start, used_end, epochs)
        counts = [b - a + w.shape[0] for a, b, w in slots]
        if counts[0] == 0:
            if wanted is None:
                break  # every epoch is empty: the caller asked for epochs, not samples
            raise ValueError(
                f"documents [{doc_range[0]}, {doc_range[1]}) yield no samples: none has at "
                f"least {min_sentences} sentences (min_sentences), so {wanted} samples cannot "
                "be built"
            )
        for k, (a, b, walked) in enumerate(slots):
            if wanted is not None and total >= wanted:
                break
            shuffle = np.random.default_rng([int(seed), _SHUFFLE_STREAM, int(epochs[k])])
            take = counts[k] if wanted is None else min(counts[k], wanted - total)
            # int32 (rows per group < _MAX_CHAINS x chain lengths): half the bytes to shuffle
            chosen = np.concatenate((np.arange(a, b, dtype=np.int64), walked))
            if chosen.shape[0] and rows.shape[0] < np.iinfo(np.int32).max:
                chosen = chosen.astype(np.int32)
            shuffle.shuffle(chosen)  # = chosen[shuffle.permutation(n)], without the copy
            chosen = chosen[:take]
            blocks.append((rows, chosen))  # each epoch's rows in its own shuffled order
            if take == counts[k]:  # a whole epoch
                tokens, truncated, short_targets = (
                    x + int(y) for x, y in zip((tokens, truncated, short_targets), sums[k])
                )
            else:
                part = rows[chosen]
                body = cum[part[:, 1] - lo] - cum[part[:, 0] - lo]
                kept = np.minimum(body, part[:, 2])
                tokens += int(kept.sum())
                truncated += int((body - kept).sum())
                short_targets += int(np.count_nonzero(part[:, 2] < max_target))
            total += take
            epoch += 1
        per_epoch = min(counts)

    index = np.empty((total, 3), dtype=index_dtype)
    at = 0
    for rows, chosen in blocks:
        # np.take into a contiguous slice: ~2x faster than rows[chosen] and no second copy
        np.take(rows, chosen, axis=0, out=index[at : at + chosen.shape[0]])
        at += chosen.shape[0]
    long = np.concatenate(([0], np.cumsum(local_sizes > max_target)))
    stats = SampleIndexStats(
        documents=int(num_docs),
        empty_documents=int(np.count_nonzero(sentences_per_doc == 0)),
        short_documents=int(np.count_nonzero((sentences_per_doc > 0) & ~used)),
        long_sentences=int((long[used_end] - long[used_start]).sum()),
        epochs=epoch,
        samples=total,
        short_target_samples=short_targets,
        tokens=tokens,
        truncated_tokens=truncated,
    )
    return index, stats


def log_stats(stats: SampleIndexStats, what: str = "sample index") -> None:
    cut = stats.truncated_tokens / max(stats.tokens + stats.truncated_tokens, 1)
    logger.info(
        "%s: %d samples over %d epoch(s) from %d documents (%d empty, %d with fewer than "
        "min_sentences skipped); truncation to the target length cut %.1f%% of the tokens",
        what,
        stats.samples,
        stats.epochs,
        stats.documents,
        stats.empty_documents,
        stats.short_documents,
        100 * cut,
    )
    if stats.long_sentences:
        logger.warning(
            "%s: %d sentences are longer than a whole sample; they are kept and truncated "
            "(Megatron would drop their documents)",
            what,
            stats.long_sentences,
        )

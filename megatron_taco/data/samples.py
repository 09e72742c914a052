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
  packing walks the corpus, which is inherently sequential. Here every sentence gets a
  target drawn up front from a per-epoch seeded generator, and a sample uses the target
  of the sentence it starts at. Sample starts are distinct sentences, so targets are
  still independent per sample with exactly probability ``short_seq_prob`` of being short
  (Megatron rounds to ``1/round(1/p)``).
* Shuffling. Each epoch is shuffled on its own and epochs are concatenated, so every
  document is seen once per epoch before any is repeated (Megatron shuffles all epochs
  together). With ``num_samples`` the index is cut to exactly ``num_samples`` rows.

Speed: the packing is a chain ``start -> next start`` per document. ``next`` is computed for
every sentence at once (one ``searchsorted`` on the token cumsum); the chains are then
followed from the document starts by pointer doubling, so an epoch costs
O(sentences x log(longest chain)) numpy work whatever the document lengths are.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_taco.arguments import ConfigError

logger = logging.getLogger(__name__)

# Part of every cache key: bump it whenever the rows this module produces change for the
# same inputs, so stale cached indices are rebuilt instead of silently reused.
SAMPLE_INDEX_VERSION = 1

NUM_SPECIAL_TOKENS = 2  # [CLS] ... [SEP]; no NSP, so a single segment
MIN_TARGET_LENGTH = 2  # the shortest short-sequence target (Megatron's)
SPLIT_NAMES = ("train", "valid", "test")

# Independent generator streams derived from the seed: the per-epoch targets and the
# per-epoch shuffle must not share draws, or changing one would change the other.
_TARGET_STREAM = 0
_SHUFFLE_STREAM = 1

# Lock-step rounds (one sample per still-going document each) before switching to pointer
# doubling; both give the same rows, this only trades numpy-call overhead for work.
_LOCKSTEP_ROUNDS = 64


@dataclass(frozen=True)
class SampleIndexStats:
    """What build_sample_index did, for logs and the build_samples summary."""

    documents: int  # documents in the range
    empty_documents: int  # no sentences (skipped)
    short_documents: int  # 1 <= sentences < min_sentences (skipped)
    long_sentences: int  # sentences longer than the longest target, in used documents
    epochs: int
    samples: int  # rows in the index
    short_target_samples: int  # rows whose target is shorter than the longest
    tokens: int  # body tokens kept over all rows (after truncation to the target)
    truncated_tokens: int  # body tokens cut by truncation to the target

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
    weights = parse_split(split)
    bounds = [0]
    cumulative = 0.0
    for w in weights:
        cumulative += w
        bounds.append(min(int(round(cumulative * num_docs)), int(num_docs)))
    bounds[-1] = int(num_docs)  # the float sum may land a hair below 1.0
    for i in range(1, len(bounds)):
        bounds[i] = max(bounds[i], bounds[i - 1])
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


def _close_samples(
    cum: np.ndarray, start: np.ndarray, target: np.ndarray, doc_end: np.ndarray, min_sentences: int
) -> np.ndarray:
    """End (exclusive) of the samples starting at sentences ``start``.

    The first end with enough tokens and sentences; closing there is allowed only if enough
    sentences remain for another sample, otherwise the sample runs to the document end.
    """
    end = np.searchsorted(cum, cum[start] + target, side="left").astype(np.int64)
    np.maximum(end, start + min_sentences, out=end)
    return np.where(end <= doc_end - min_sentences, end, doc_end)


def _epoch_rows(
    cum: np.ndarray,
    doc_start: np.ndarray,
    doc_end: np.ndarray,
    rng: np.random.Generator,
    *,
    max_target: int,
    short_seq_prob: float,
    min_sentences: int,
) -> np.ndarray:
    """One epoch of rows (local sentence indices) for the documents ``[doc_start, doc_end)``."""
    m = cum.shape[0] - 1
    target = np.full(m, max_target, dtype=np.int64)
    if short_seq_prob > 0:
        short = rng.random(m) < short_seq_prob
        target[short] = rng.integers(MIN_TARGET_LENGTH, max_target + 1, size=int(short.sum()))

    # Walk all documents' chains in lock-step; cheap while most documents are short (each
    # round touches only the documents still going).
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    cur, cur_end = doc_start, doc_end
    for _ in range(_LOCKSTEP_ROUNDS):
        if cur.size == 0:
            break
        end = _close_samples(cum, cur, target[cur], cur_end, min_sentences)
        starts.append(cur)
        ends.append(end)
        going = end < cur_end
        cur, cur_end = end[going], cur_end[going]
    if cur.size:
        # Long documents remain: follow their chains by pointer doubling over every sentence,
        # O(sentences x log(longest chain)) however long the documents are.
        end_of = np.zeros(m, dtype=np.int64)
        end_of[doc_start] = doc_end
        end_of = np.maximum.accumulate(end_of)  # the end of the used document each sentence is in
        inside = end_of > np.arange(m)  # False for sentences of skipped documents
        every = np.flatnonzero(inside)
        end_all = np.zeros(m, dtype=np.int64)
        end_all[every] = _close_samples(cum, every, target[every], end_of[every], min_sentences)
        # A document end becomes the sentinel m, so the next document's first sentence is
        # never mistaken for a continuation (sentences of skipped documents are never reached).
        jump = np.append(np.where(inside & (end_all != end_of), end_all, m), m)
        reached = np.zeros(m + 1, dtype=bool)
        reached[m] = True
        reached[cur] = True
        # After k rounds `reached` holds every sentence within 2**k - 1 steps of a chain
        # start and `jump` is the 2**k-step successor; stop at the fixed point.
        while True:
            successors = jump[np.flatnonzero(reached)]
            new = successors[~reached[successors]]
            if new.size == 0:
                break
            reached[new] = True
            jump = jump[jump]
        rest = np.flatnonzero(reached[:m])
        starts.append(rest)
        ends.append(end_all[rest])
    if not starts:
        return np.zeros((0, 3), dtype=np.int64)
    start = np.concatenate(starts)
    return np.stack([start, np.concatenate(ends), target[start]], axis=1)


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
) -> tuple[np.ndarray, SampleIndexStats]:
    """:func:`build_sample_index` plus what it skipped and truncated."""
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

    rows: list[np.ndarray] = []
    total = 0
    epoch = 0
    wanted = None if num_samples is None else int(num_samples)
    while (wanted is None and epoch < int(num_epochs)) or (wanted is not None and total < wanted):
        rng = np.random.default_rng([int(seed), _TARGET_STREAM, epoch])
        epoch_rows = _epoch_rows(
            cum,
            used_start,
            used_end,
            rng,
            max_target=max_target,
            short_seq_prob=float(short_seq_prob),
            min_sentences=min_sentences,
        )
        if epoch_rows.shape[0] == 0:
            if wanted is None:
                break  # every epoch is empty: the caller asked for epochs, not samples
            raise ValueError(
                f"documents [{doc_range[0]}, {doc_range[1]}) yield no samples: none has at "
                f"least {min_sentences} sentences (min_sentences), so {wanted} samples cannot "
                "be built"
            )
        shuffle = np.random.default_rng([int(seed), _SHUFFLE_STREAM, epoch])
        rows.append(epoch_rows[shuffle.permutation(epoch_rows.shape[0])])
        total += epoch_rows.shape[0]
        epoch += 1

    index = np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.int64)
    if wanted is not None:
        index = index[:wanted]
    body = cum[index[:, 1]] - cum[index[:, 0]]
    kept = np.minimum(body, index[:, 2])
    stats = SampleIndexStats(
        documents=int(num_docs),
        empty_documents=int(np.count_nonzero(sentences_per_doc == 0)),
        short_documents=int(np.count_nonzero((sentences_per_doc > 0) & ~used)),
        long_sentences=int(
            np.count_nonzero((local_sizes > max_target) & np.repeat(used, sentences_per_doc))
        ),
        epochs=epoch,
        samples=int(index.shape[0]),
        short_target_samples=int(np.count_nonzero(index[:, 2] < max_target)),
        tokens=int(kept.sum()),
        truncated_tokens=int((body - kept).sum()),
    )
    index[:, :2] += lo
    return np.ascontiguousarray(index, dtype=np.int64), stats


def build_sample_index(
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
) -> np.ndarray:
    """int64 [N, 3] rows ``(start_sentence, end_sentence_exclusive, target_length)``.

    ``sizes`` are the sentence lengths and ``document_indices`` the document boundaries of
    an indexed dataset; only documents ``doc_range = (first, end)`` are used. Exactly one
    of ``num_epochs`` (that many full passes) and ``num_samples`` (passes until there are
    that many rows, then cut) is given. See the module docstring for the semantics.
    """
    index, stats = build_sample_index_with_stats(
        sizes,
        document_indices,
        doc_range,
        num_epochs=num_epochs,
        num_samples=num_samples,
        max_seq_length=max_seq_length,
        short_seq_prob=short_seq_prob,
        min_sentences=min_sentences,
        seed=seed,
    )
    log_stats(stats)
    return index


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


def sample_body_lengths(sizes: Sequence[int] | np.ndarray, sample_index: np.ndarray) -> np.ndarray:
    """Tokens of each row's body after truncation to its target (no [CLS]/[SEP])."""
    sizes = np.asarray(sizes)
    cum = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=cum[1:])
    index = np.asarray(sample_index)
    return np.minimum(cum[index[:, 1]] - cum[index[:, 0]], index[:, 2])

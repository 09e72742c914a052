"""Span sampling shared by every masking scheme, and SpanBERT token masking (MLM).

One span sampler works on "units": whole words for token masking, single
non-special tokens for TACO's position masking (position_masking.py), whole words
for SAS's replacement sets (sas_collator.py). One call handles one sample and is
seeded by the caller, so results depend only on the sample and its seed.

Span sampling:

* span length ``l`` (in units) ~ geometric(p) truncated at ``max_span``, i.e.
  ``P(l) ∝ p (1 - p)^(l - 1)`` for ``l = 1..max_span`` (SpanBERT's
  ``len_distrib``);
* the start is uniform among the units at which ``l`` consecutive, still free,
  adjacent units fit. Spans never overlap and never cross a special token.
  Drawing the start among places where the span fits (rather than truncating a
  span at the first obstacle) keeps span lengths exactly distributed as drawn;
  only when no place fits ``l`` any more (a nearly exhausted sequence) is the
  longest length that still fits used instead;
* spans are added until ``budget = round(mask_prob * maskable tokens)`` tokens
  are covered (at least 1 when anything is maskable, like Megatron's BERT). As
  in SpanBERT, the last span stops adding words once the budget is met, but a
  word is never split, so the overshoot is at most the last word's token count
  minus one (zero for positions, whose units are single tokens).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from megatron_taco.arguments import option, require

IGNORE_INDEX = -100
# Ids 0..4 are [PAD] [UNK] [CLS] [SEP] [MASK] (tokenizer.SPECIAL_PIECES); the
# tokenizer module is not imported so DataLoader workers stay light.
NUM_SPECIAL_IDS = 5

ACTION_MASK, ACTION_RANDOM, ACTION_KEEP = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class TokenMaskingConfig:
    """SpanBERT token masking (MLM): spans of whole words, 80/10/10 per span."""

    mask_prob: float = option(
        0.15, "Fraction of maskable tokens selected for MLM", flag="--mask-prob"
    )
    span_geometric_p: float = option(
        0.2, "Geometric p of MLM span lengths (in words)", flag="--span-geometric-p"
    )
    max_span_length: int = option(3, "Longest MLM span, in words", flag="--max-span-length")
    mask_replace_prob: float = option(
        0.8, "Probability a selected token span becomes [MASK]", flag="--mask-replace-prob"
    )
    random_replace_prob: float = option(
        0.1,
        "Probability a selected token span becomes random tokens (the rest is kept)",
        flag="--random-replace-prob",
    )

    def __post_init__(self) -> None:
        check_span_options(
            self,
            ("mask_prob", "span_geometric_p", "max_span_length"),
            ("mask_replace_prob", "random_replace_prob"),
            "random replacement",
        )


def check_span_options(config, span: tuple[str, str, str], actions: tuple[str, str], second: str):
    """Validate a masking config's (selection probability, span p, longest span) fields and
    its two per-span action probabilities (mask, then ``second``), which share one span."""
    cls = type(config)
    prob, geometric_p, max_span = span
    for name in (prob, geometric_p):
        value = getattr(config, name)
        require(0.0 < value <= 1.0, cls, name, f"must be in (0, 1], got {value}")
    value = getattr(config, max_span)
    require(isinstance(value, int) and value >= 1, cls, max_span, f"must be >= 1, got {value}")
    for name in actions:
        value = getattr(config, name)
        require(0.0 <= value <= 1.0, cls, name, f"must be in [0, 1], got {value}")
    require(
        sum(getattr(config, name) for name in actions) <= 1.0,
        cls,
        actions[1],
        f"mask and {second} probabilities must sum to at most 1",
    )


@functools.lru_cache(maxsize=32)
def span_length_probs(geometric_p: float, max_span: int) -> np.ndarray:
    """P(l) for l = 1..max_span of the geometric distribution truncated at max_span."""
    if not 0.0 < geometric_p <= 1.0:
        raise ValueError(f"geometric_p must be in (0, 1], got {geometric_p}")
    if max_span < 1:
        raise ValueError(f"max_span must be >= 1, got {max_span}")
    lengths = np.arange(1, max_span + 1)
    probs = geometric_p * (1.0 - geometric_p) ** (lengths - 1)
    probs /= probs.sum()
    probs.flags.writeable = False  # shared through the cache
    return probs


def mask_budget(mask_prob: float, num_maskable: int) -> int:
    if num_maskable <= 0 or mask_prob <= 0.0:
        return 0
    # Round half up, but predict at least one token so no sample is loss-free.
    return max(1, int(mask_prob * num_maskable + 0.5))


def sample_spans(
    unit_lengths: np.ndarray,
    linked: np.ndarray,
    budget: int,
    rng: np.random.Generator,
    *,
    geometric_p: float,
    max_span: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Non-overlapping spans of units covering at least ``budget`` tokens (see module doc).

    unit_lengths: tokens per unit, in sequence order. linked[u]: unit u + 1 directly
    follows unit u, so a span may continue from u into u + 1.
    Returns (first_unit, num_units, drawn_length) per span, in sampling order;
    num_units < drawn_length only for a budget-truncated last span or a span that
    did not fit anywhere.
    """
    num_units = len(unit_lengths)
    empty = np.zeros(0, dtype=np.int64)
    if budget <= 0 or num_units == 0:
        return empty, empty, empty
    cdf = np.cumsum(span_length_probs(geometric_p, max_span))
    # Each span covers >= 1 token, so `budget` draws always suffice; drawing them
    # up front costs O(budget) and keeps the per-span loop to index arithmetic.
    drawn = np.minimum(np.searchsorted(cdf, rng.random(budget), side="right"), max_span - 1) + 1
    picks = rng.random(budget)

    # breaks_prefix[w] = number of non-links among units 0..w-1.
    breaks_prefix = np.concatenate(([0], np.cumsum(~np.asarray(linked, dtype=bool))))
    occupied = np.zeros(num_units, dtype=np.int8)
    firsts, counts = [], []
    covered = 0
    for i in range(budget):
        if covered >= budget:
            break
        occupied_prefix = np.concatenate(([0], np.cumsum(occupied)))
        candidates = empty
        length = min(int(drawn[i]), num_units)
        while length >= 1:
            # Window [w, w + length): all units free and each linked to the next.
            free = occupied_prefix[length:] == occupied_prefix[: num_units - length + 1]
            joined = (
                breaks_prefix[length - 1 : num_units] == breaks_prefix[: num_units - length + 1]
            )
            candidates = np.flatnonzero(free & joined)
            if candidates.size:
                break
            length -= 1
        if not candidates.size:
            break  # every unit is taken
        first = int(candidates[int(picks[i] * candidates.size)])
        tokens = np.cumsum(unit_lengths[first : first + length])
        take = min(length, int(np.searchsorted(tokens, budget - covered)) + 1)
        occupied[first : first + take] = 1
        covered += int(tokens[take - 1])
        firsts.append(first)
        counts.append(take)
    n = len(firsts)
    return (
        np.asarray(firsts, dtype=np.int64),
        np.asarray(counts, dtype=np.int64),
        drawn[:n].astype(np.int64),
    )


def span_token_indices(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start + length) over spans."""
    offsets = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum())) - np.repeat(offsets - starts, lengths)


def span_actions(
    rng: np.random.Generator, num_spans: int, first_prob: float, second_prob: float
) -> np.ndarray:
    u = rng.random(num_spans)
    return np.where(
        u < first_prob,
        ACTION_MASK,
        np.where(u < first_prob + second_prob, ACTION_RANDOM, ACTION_KEEP),
    )


def word_units(
    word_starts: np.ndarray, maskable: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, linked) of the maskable words. A word is a word-start token and
    its continuation tokens; a continuation token right after a special token starts
    its own word, since it cannot join the special token's."""
    prev_maskable = np.concatenate(([False], maskable[:-1]))
    is_start = maskable & (np.asarray(word_starts, dtype=bool) | ~prev_maskable)
    starts = np.flatnonzero(is_start)
    boundaries = np.flatnonzero(np.concatenate((is_start | ~maskable, [True])))
    ends = boundaries[np.searchsorted(boundaries, starts, side="right")]
    linked = np.concatenate((ends[:-1] == starts[1:], [False]))
    return starts, ends, linked


def span_mask_tokens(
    tokens: np.ndarray,
    word_starts: np.ndarray,
    special: np.ndarray,
    length: int,
    rng: np.random.Generator,
    *,
    mask_id: int,
    vocab_size: int,
    mask_prob: float = 0.15,
    geometric_p: float = 0.2,
    max_span: int = 3,
    random_token_ids: np.ndarray | None = None,
    mask_replace_prob: float = 0.8,
    random_replace_prob: float = 0.1,
) -> tuple[np.ndarray, np.ndarray]:
    """SpanBERT whole-word span masking of one sample; returns (input_ids, labels).

    Each span, not each token, is replaced by [MASK] / by uniformly random tokens
    (one independent draw per token) / kept, with mask_replace_prob /
    random_replace_prob / the rest. Random tokens come from random_token_ids, or
    from [NUM_SPECIAL_IDS, vocab_size) when None.
    """
    tokens = np.asarray(tokens)
    maskable = ~np.asarray(special, dtype=bool)
    maskable[length:] = False
    starts, ends, linked = word_units(word_starts, maskable)
    budget = mask_budget(mask_prob, int(maskable.sum()))
    first, count, _ = sample_spans(
        ends - starts, linked, budget, rng, geometric_p=geometric_p, max_span=max_span
    )

    input_ids = tokens.astype(np.int64, copy=True)
    labels = np.full(tokens.shape, IGNORE_INDEX, dtype=np.int64)
    if not first.size:
        return input_ids, labels
    span_start = starts[first]
    span_tokens = ends[first + count - 1] - span_start
    selected = span_token_indices(span_start, span_tokens)
    labels[selected] = tokens[selected]
    actions = np.repeat(
        span_actions(rng, first.size, mask_replace_prob, random_replace_prob), span_tokens
    )
    input_ids[selected[actions == ACTION_MASK]] = mask_id
    replaced = selected[actions == ACTION_RANDOM]
    if replaced.size:
        if random_token_ids is not None:
            pool = np.asarray(random_token_ids)
            input_ids[replaced] = pool[rng.integers(pool.size, size=replaced.size)]
        else:
            input_ids[replaced] = rng.integers(NUM_SPECIAL_IDS, vocab_size, size=replaced.size)
    return input_ids, labels

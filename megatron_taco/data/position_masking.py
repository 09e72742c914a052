"""TACO's masked position modelling (appendix A.2): spans of positions are masked, shuffled
within the span, or kept; the task is to predict the true position."""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_taco.arguments import option
from megatron_taco.data.masking import (
    ACTION_MASK,
    ACTION_RANDOM,
    IGNORE_INDEX,
    check_span_options,
    mask_budget,
    sample_spans,
    span_actions,
    span_token_indices,
)

MASK_POSITION = -1


@dataclasses.dataclass(frozen=True)
class PositionMaskingConfig:
    position_mask_prob: float = option(
        0.15, "Fraction of non-special positions selected for MPM", flag="--position-mask-prob"
    )
    position_span_geometric_p: float = option(
        0.2, "Geometric p of MPM span lengths (in tokens)", flag="--position-span-geometric-p"
    )
    max_position_span_length: int = option(
        6, "Longest MPM span, in tokens", flag="--max-position-span-length"
    )
    position_mask_replace_prob: float = option(
        0.8,
        "Probability a selected position span becomes the mask position",
        flag="--position-mask-replace-prob",
    )
    position_shuffle_prob: float = option(
        0.1,
        "Probability a selected position span is shuffled (the rest is kept)",
        flag="--position-shuffle-prob",
    )

    def __post_init__(self) -> None:
        check_span_options(
            self,
            ("position_mask_prob", "position_span_geometric_p", "max_position_span_length"),
            ("position_mask_replace_prob", "position_shuffle_prob"),
            "shuffle",
        )


def true_position_ids(length: int, seq_length: int) -> np.ndarray:
    """Physical index for real tokens ([CLS] = 0); 0 on padding, which attention hides."""
    positions = np.arange(seq_length, dtype=np.int64)
    positions[length:] = 0
    return positions


def _corrupt_position_spans(
    position_ids: np.ndarray,
    labels: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    rng: np.random.Generator,
    *,
    num_positions: int,
    mask_replace_prob: float,
    shuffle_prob: float,
) -> None:
    """Apply A.2's per-span mask / shuffle / keep in place to spans of true positions."""
    if not starts.size:
        return
    selected = span_token_indices(starts, lengths)
    labels[selected] = position_ids[selected]
    actions = span_actions(rng, starts.size, mask_replace_prob, shuffle_prob)
    position_ids[selected[np.repeat(actions, lengths) == ACTION_MASK]] = MASK_POSITION
    for start, span in zip(starts[actions == ACTION_RANDOM], lengths[actions == ACTION_RANDOM]):
        start, span = int(start), int(span)
        if span == 1:
            # A random position of the absolute table (A.2: [0, max sequence length)),
            # never the original one, or the "shuffle" would be a keep.
            original = int(labels[start])
            drawn = int(rng.integers(num_positions - 1))
            position_ids[start] = drawn + (drawn >= original)
            continue
        # Uniform over non-identity permutations by rejection (accepts w.p. >= 1/2).
        while True:
            perm = rng.permutation(span)
            if (perm != np.arange(span)).any():
                break
        position_ids[start : start + span] = labels[start : start + span][perm]


def span_mask_positions(
    length: int,
    special: np.ndarray,
    rng: np.random.Generator,
    *,
    seq_length: int,
    num_positions: int | None = None,
    mask_prob: float = 0.15,
    geometric_p: float = 0.2,
    max_span: int = 6,
    mask_replace_prob: float = 0.8,
    shuffle_prob: float = 0.1,
) -> tuple[np.ndarray, np.ndarray]:
    """TACO position masking of one sample; returns (position_ids, position_labels).

    Spans are of non-special tokens. Per span: MASK_POSITION (mask_replace_prob),
    shuffled with a non-identity permutation, or for a one-token span replaced by a
    uniform other position in [0, num_positions) (shuffle_prob), else kept.
    ``num_positions`` is the absolute position table's size (default seq_length).
    """
    maskable = ~np.asarray(special, dtype=bool)
    maskable[length:] = False
    units = np.flatnonzero(maskable)
    linked = np.concatenate((units[1:] == units[:-1] + 1, [False]))
    budget = mask_budget(mask_prob, units.size)
    ones = np.ones(units.size, dtype=np.int64)  # a unit is one token
    first, count, _ = sample_spans(
        ones, linked, budget, rng, geometric_p=geometric_p, max_span=max_span
    )
    position_ids = true_position_ids(length, seq_length)
    labels = np.full(seq_length, IGNORE_INDEX, dtype=np.int64)
    _corrupt_position_spans(
        position_ids,
        labels,
        units[first],
        count,
        rng,
        num_positions=seq_length if num_positions is None else num_positions,
        mask_replace_prob=mask_replace_prob,
        shuffle_prob=shuffle_prob,
    )
    return position_ids, labels

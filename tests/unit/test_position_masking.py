import argparse

import numpy as np
import pytest

from megatron_taco.arguments import add_dataclass_args, dataclass_from_args
from megatron_taco.data.masking import IGNORE_INDEX, mask_budget, span_length_probs
from megatron_taco.data.position_masking import (
    MASK_POSITION,
    PositionMaskingConfig,
    _corrupt_position_spans,
    span_mask_positions,
    true_position_ids,
)
from megatron_taco.errors import ConfigError
from tests.helpers import masking_sample as make_sample

CLS, SEP = 2, 3
SEQ = 128
# TACO-base's absolute table is larger than the sequence: a one-position "shuffle" draws
# from the whole table.
TABLE = 512


def test_span_mask_positions_budget_specials_and_labels():
    rng = np.random.default_rng(5)
    selected_total, masked_total = 0, 0
    for _ in range(1500):
        _, _, special, length = make_sample(rng)
        position_ids, labels = span_mask_positions(length, special, rng, seq_length=SEQ)
        truth = true_position_ids(length, SEQ)
        selected = labels != IGNORE_INDEX
        assert selected.sum() == mask_budget(0.15, int((~special).sum()))
        assert not (selected & special).any()
        np.testing.assert_array_equal(labels[selected], np.flatnonzero(selected))
        np.testing.assert_array_equal(position_ids[~selected], truth[~selected])
        assert (position_ids[length:] == 0).all()
        assert ((position_ids >= MASK_POSITION) & (position_ids < SEQ)).all()
        selected_total += int(selected.sum())
        masked_total += int((position_ids == MASK_POSITION).sum())
    # Decisions are per span and independent of its length, so the token-weighted
    # mask fraction is 0.8 in expectation with variance 0.16 E[L^2] / (E[L]^2 N).
    probs = span_length_probs(0.2, 6)
    lengths = np.arange(1, 7)
    mean_len, mean_sq = (probs * lengths).sum(), (probs * lengths**2).sum()
    num_spans = selected_total / mean_len
    tol = 5 * np.sqrt(0.16 * mean_sq / mean_len**2 / num_spans)
    assert abs(masked_total / selected_total - 0.8) < tol


def test_position_span_corruption_per_span():
    rng = np.random.default_rng(6)
    lengths = np.tile(np.arange(1, 7), 4)
    starts = np.cumsum(lengths + 1) - lengths  # one untouched position between spans
    assert starts[-1] + lengths[-1] <= SEQ
    counts = {"mask": 0, "shuffle": 0, "keep": 0}
    single_random = []
    for _ in range(300):
        position_ids = true_position_ids(SEQ, SEQ)
        labels = np.full(SEQ, IGNORE_INDEX, dtype=np.int64)
        _corrupt_position_spans(
            position_ids,
            labels,
            starts,
            lengths,
            rng,
            num_positions=TABLE,
            mask_replace_prob=0.8,
            shuffle_prob=0.1,
        )
        for s, n in zip(starts, lengths):
            got, true = position_ids[s : s + n], np.arange(s, s + n)
            np.testing.assert_array_equal(labels[s : s + n], true)
            if (got == MASK_POSITION).all():
                counts["mask"] += 1
            elif (got == true).all():
                counts["keep"] += 1
            elif n == 1:
                single_random.append(int(got[0]))
                counts["shuffle"] += 1
            else:
                assert sorted(got) == list(true), "shuffle must permute within the span"
                counts["shuffle"] += 1
        outside = np.ones(SEQ, dtype=bool)
        outside[np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])] = False
        assert (labels[outside] == IGNORE_INDEX).all()
        np.testing.assert_array_equal(position_ids[outside], np.flatnonzero(outside))
    total = sum(counts.values())
    for kind, p in (("mask", 0.8), ("shuffle", 0.1), ("keep", 0.1)):
        tol = 5 * np.sqrt(p * (1 - p) / total)
        assert abs(counts[kind] / total - p) < tol, (kind, counts)
    single_random = np.array(single_random)
    assert single_random.size > 50
    # Uniform over the whole table (not only [0, seq)), never the original position.
    assert single_random.min() >= 0 and single_random.max() < TABLE
    assert single_random.min() < 40 and single_random.max() > TABLE - 40
    assert (single_random >= SEQ).mean() > 0.5


def test_position_shuffle_never_returns_identity():
    rng = np.random.default_rng(7)
    starts, lengths = np.arange(0, SEQ, 3), np.full(SEQ // 3 + 1, 2)
    lengths = lengths[: starts.size]
    for _ in range(50):
        position_ids = true_position_ids(SEQ, SEQ)
        labels = np.full(SEQ, IGNORE_INDEX, dtype=np.int64)
        _corrupt_position_spans(
            position_ids,
            labels,
            starts,
            lengths,
            rng,
            num_positions=TABLE,
            mask_replace_prob=0.0,
            shuffle_prob=1.0,
        )
        np.testing.assert_array_equal(position_ids[starts], starts + 1)
        np.testing.assert_array_equal(position_ids[starts + 1], starts)


def test_one_position_shuffle_never_keeps_the_original():
    rng = np.random.default_rng(8)
    starts = np.array([0, 5, TABLE - 1])
    for table in (2, 3, TABLE):
        starts_t = starts[starts < table]
        for _ in range(200):
            position_ids = np.arange(table, dtype=np.int64)
            labels = np.full(table, IGNORE_INDEX, dtype=np.int64)
            _corrupt_position_spans(
                position_ids,
                labels,
                starts_t,
                np.ones_like(starts_t),
                rng,
                num_positions=table,
                mask_replace_prob=0.0,
                shuffle_prob=1.0,
            )
            assert (position_ids[starts_t] != starts_t).all()
            assert (position_ids[starts_t] < table).all()


def test_position_masking_config_validation_and_flags():
    cfg = PositionMaskingConfig()
    assert cfg.max_position_span_length == 6
    with pytest.raises(ConfigError, match="--max-position-span-length"):
        PositionMaskingConfig(max_position_span_length=0)
    with pytest.raises(ConfigError, match="--position-shuffle-prob"):
        PositionMaskingConfig(position_shuffle_prob=-0.1)
    with pytest.raises(ConfigError, match="--position-shuffle-prob"):
        PositionMaskingConfig(position_mask_replace_prob=0.95, position_shuffle_prob=0.1)
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, PositionMaskingConfig)
    args = parser.parse_args(["--position-span-geometric-p", "0.3"])
    parsed = dataclass_from_args(PositionMaskingConfig, args)
    assert parsed == PositionMaskingConfig(position_span_geometric_p=0.3)

import numpy as np
import pytest

from megatron_taco.arguments import add_dataclass_args, dataclass_from_args
from megatron_taco.data.masking import (
    IGNORE_INDEX,
    NUM_SPECIAL_IDS,
    TokenMaskingConfig,
    mask_budget,
    sample_spans,
    span_length_probs,
    span_mask_tokens,
    word_units,
)
from megatron_taco.errors import ConfigError
from tests.helpers import masking_sample as make_sample

CLS, SEP, MASK = 2, 3, 4
SEQ = 128
MAX_WORD = 3  # masking_sample's longest word
# chi-square 0.999 quantiles (false-alarm rate 1e-3 per test), by degrees of freedom.
CHI2_999 = {2: 13.816, 5: 20.515}


def word_boundaries(word_starts, special):
    # A continuation right after a special token starts a new word.
    new_word = word_starts | special | np.concatenate(([True], special[:-1]))
    return new_word


def test_span_length_probs_truncated_geometric():
    probs = span_length_probs(0.2, 3)
    raw = np.array([0.2, 0.2 * 0.8, 0.2 * 0.8**2])
    np.testing.assert_allclose(probs, raw / raw.sum())
    assert span_length_probs(1.0, 6)[0] == 1.0
    with pytest.raises(ValueError):
        span_length_probs(0.0, 3)
    with pytest.raises(ValueError):
        span_length_probs(0.2, 0)


def test_mask_budget():
    assert mask_budget(0.15, 100) == 15
    assert mask_budget(0.15, 10) == 2  # 1.5 rounds up
    assert mask_budget(0.15, 3) == 1  # never a sample with nothing to predict
    assert mask_budget(0.15, 0) == 0


def test_word_units_split_after_special_and_link_only_adjacent_words():
    #            CLS  a   a'  b   SEP  c'  d   SEP PAD
    word_starts = np.array([1, 1, 0, 1, 1, 0, 1, 1, 0], bool)
    special = np.array([1, 0, 0, 0, 1, 0, 0, 1, 1], bool)
    starts, ends, linked = word_units(word_starts, ~special)
    np.testing.assert_array_equal(starts, [1, 3, 5, 6])
    np.testing.assert_array_equal(ends, [3, 4, 6, 7])
    np.testing.assert_array_equal(linked, [True, False, True, False])


@pytest.mark.parametrize("max_span", [3, 6])
def test_sample_spans_lengths_follow_truncated_geometric(max_span):
    rng = np.random.default_rng(11)
    drawn_all, tails_ok = [], True
    for _ in range(600):
        units = 120
        unit_lengths = rng.integers(1, MAX_WORD + 1, units)
        linked = rng.random(units) > 0.05
        budget = mask_budget(0.15, int(unit_lengths.sum()))
        first, count, drawn = sample_spans(
            unit_lengths, linked, budget, rng, geometric_p=0.2, max_span=max_span
        )
        drawn_all.append(drawn)
        # Only the last span may be cut short (by the budget); the others are exact.
        tails_ok &= bool((count[:-1] == drawn[:-1]).all()) and count[-1] <= drawn[-1]
        # No overlap, and a span never crosses an unlinked boundary.
        covered = np.concatenate([np.arange(f, f + c) for f, c in zip(first, count)])
        assert np.unique(covered).size == covered.size
        for f, c in zip(first, count):
            assert linked[f : f + c - 1].all()
    assert tails_ok
    # Whether a span is drawn is decided before its length is drawn (a stopping
    # time), so by Wald's identity the pooled drawn lengths are unbiased.
    drawn = np.concatenate(drawn_all)
    observed = np.bincount(drawn - 1, minlength=max_span)
    assert observed.size == max_span
    expected = span_length_probs(0.2, max_span) * drawn.size
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[max_span - 1], (observed, expected)


def test_span_mask_tokens_budget_words_specials_and_labels():
    rng = np.random.default_rng(0)
    budget_fractions, overshoots = [], []
    for _ in range(1500):
        tokens, word_starts, special, length = make_sample(rng)
        input_ids, labels = span_mask_tokens(
            tokens, word_starts, special, length, rng, mask_id=MASK, vocab_size=1000
        )
        selected = labels != IGNORE_INDEX
        maskable = ~special
        n = int(maskable.sum())
        budget = mask_budget(0.15, n)
        # Whole words only, so the overshoot is below one word.
        assert budget <= selected.sum() <= budget + MAX_WORD - 1
        assert not (selected & special).any()
        np.testing.assert_array_equal(labels[selected], tokens[selected])
        np.testing.assert_array_equal(input_ids[~selected], tokens[~selected])
        assert input_ids.dtype == labels.dtype == np.int64
        new_word = word_boundaries(word_starts, special)
        inside = ~new_word[1:]
        assert (selected[1:][inside] == selected[:-1][inside]).all(), "a word was split"
        budget_fractions.append(budget / n)
        overshoots.append(selected.sum() - budget)
    # The budget is 15% up to rounding, whose error (|e| <= 0.5/n, roughly uniform)
    # averages out: its mean over 1500 samples has sd ~1e-4.
    assert abs(np.mean(budget_fractions) - 0.15) < 0.002
    # Stopping as soon as the budget is met leaves only part of the last word over
    # it: ~0.67 tokens on average with 1..3-token words. Finishing whole spans
    # instead would overshoot by about a span (~2 words, ~4 tokens).
    assert np.mean(overshoots) < 1.0


def test_span_mask_tokens_single_token_words_hit_budget_exactly():
    rng = np.random.default_rng(1)
    for _ in range(300):
        tokens, _, special, length = make_sample(rng)
        word_starts = np.arange(SEQ) < length  # every token its own word
        _, labels = span_mask_tokens(
            tokens, word_starts, special, length, rng, mask_id=MASK, vocab_size=1000
        )
        assert (labels != IGNORE_INDEX).sum() == mask_budget(0.15, int((~special).sum()))


def test_span_mask_tokens_replacement_is_decided_per_span():
    # Blocks of [SEP] w w w: every word is isolated, so each selected word is one span.
    length = 125
    special = np.ones(SEQ, dtype=bool)
    special[:length] = np.arange(length) % 4 == 0
    word_starts = np.zeros(SEQ, dtype=bool)
    word_starts[:length] = np.arange(length) % 4 <= 1
    random_ids = np.arange(200, 300)
    rng = np.random.default_rng(2)
    counts = {"mask": 0, "random": 0, "keep": 0}
    for _ in range(1000):
        tokens = np.zeros(SEQ, dtype=np.int64)
        tokens[:length] = np.where(special[:length], SEP, rng.integers(100, 200, length))
        input_ids, labels = span_mask_tokens(
            tokens,
            word_starts,
            special,
            length,
            rng,
            mask_id=MASK,
            vocab_size=300,
            random_token_ids=random_ids,
        )
        for start in np.flatnonzero(labels != IGNORE_INDEX)[::3]:
            span = input_ids[start : start + 3]
            assert (labels[start : start + 3] != IGNORE_INDEX).all()
            if (span == MASK).all():
                counts["mask"] += 1
            elif ((span >= 200) & (span < 300)).all():
                counts["random"] += 1
            elif (span == tokens[start : start + 3]).all():
                counts["keep"] += 1
            else:
                pytest.fail(f"span mixes replacement kinds: {span} vs {tokens[start : start + 3]}")
    total = sum(counts.values())
    for kind, p in (("mask", 0.8), ("random", 0.1), ("keep", 0.1)):
        tol = 5 * np.sqrt(p * (1 - p) / total)
        assert abs(counts[kind] / total - p) < tol, (kind, counts)


def test_span_mask_tokens_default_random_ids_avoid_specials():
    rng = np.random.default_rng(3)
    seen = []
    for _ in range(300):
        tokens, word_starts, special, length = make_sample(rng)
        input_ids, labels = span_mask_tokens(
            tokens,
            word_starts,
            special,
            length,
            rng,
            mask_id=MASK,
            vocab_size=120,
            mask_replace_prob=0.0,
            random_replace_prob=1.0,
        )
        seen.append(input_ids[labels != IGNORE_INDEX])
    seen = np.concatenate(seen)
    assert seen.min() >= NUM_SPECIAL_IDS and seen.max() < 120
    assert seen.min() < 10 and seen.max() > 110  # drawn across the whole range


def test_span_mask_tokens_is_a_function_of_the_rng():
    tokens, word_starts, special, length = make_sample(np.random.default_rng(4))
    a = span_mask_tokens(
        tokens, word_starts, special, length, np.random.default_rng(9), mask_id=MASK, vocab_size=300
    )
    b = span_mask_tokens(
        tokens, word_starts, special, length, np.random.default_rng(9), mask_id=MASK, vocab_size=300
    )
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_masking_config_validation_and_flags():
    assert TokenMaskingConfig().max_span_length == 3
    with pytest.raises(ConfigError, match="--mask-prob"):
        TokenMaskingConfig(mask_prob=0.0)
    with pytest.raises(ConfigError, match="--span-geometric-p"):
        TokenMaskingConfig(span_geometric_p=1.5)
    with pytest.raises(ConfigError, match="--max-span-length"):
        TokenMaskingConfig(max_span_length=0)
    with pytest.raises(ConfigError, match="--random-replace-prob"):
        TokenMaskingConfig(mask_replace_prob=0.95, random_replace_prob=0.1)

    import argparse

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, TokenMaskingConfig)
    args = parser.parse_args(["--mask-prob", "0.2", "--max-span-length", "5"])
    parsed = dataclass_from_args(TokenMaskingConfig, args)
    assert parsed == TokenMaskingConfig(mask_prob=0.2, max_span_length=5)

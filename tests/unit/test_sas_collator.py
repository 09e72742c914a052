"""SAS's replaced sets S and cold-start replacements (data/sas_collator.py)."""

import math

import numpy as np
import pytest
import torch

from megatron_taco.arguments import ConfigError
from megatron_taco.data.masking import IGNORE_INDEX
from megatron_taco.data.sas_collator import (
    ColdStart,
    ReplacementConfig,
    SasCollator,
    cold_start_probs,
    replaced_positions,
)

PAD, CLS, SEP = 0, 2, 3
VOCAB, SEQ = 60, 40
SPECIAL = np.zeros(VOCAB, dtype=bool)
SPECIAL[:5] = True


def make_sample(index, length=None, epoch=0, seed=0):
    rng = np.random.default_rng([seed, index])
    length = length or int(rng.integers(10, SEQ + 1))
    tokens = np.full(SEQ, PAD, dtype=np.int64)
    tokens[1 : length - 1] = rng.integers(5, VOCAB, length - 2)
    tokens[0], tokens[length - 1] = CLS, SEP
    special = np.ones(SEQ, dtype=bool)
    special[1 : length - 1] = False
    word_starts = np.zeros(SEQ, dtype=bool)
    word_starts[: length - 1] = rng.random(length - 1) < 0.6  # multi-piece words
    word_starts[0] = word_starts[length - 1] = word_starts[1] = True
    return dict(
        tokens=tokens, length=length, special=special, word_starts=word_starts, index=index,
        epoch=epoch,
    )  # fmt: skip


def collator(cold="uniform", probs=None, mask_prob=0.15, seed=7):
    config = ReplacementConfig(mask_prob=mask_prob, cold_start=cold)
    probs = probs if probs is not None else (~SPECIAL) / (~SPECIAL).sum()
    return SasCollator(
        pad_id=PAD, seq_length=SEQ, seed=seed, config=config, source=ColdStart(probs, seed)
    )


def test_replaced_set_size_specials_and_whole_words():
    for index in range(300):
        s = make_sample(index)
        where = replaced_positions(s["word_starts"], s["special"], s["length"], 0.15, 7, index)
        k = s["length"] - 2
        assert where.size == math.ceil(0.15 * k)
        assert len(set(where.tolist())) == where.size
        assert not s["special"][where].any() and (where < s["length"]).all()
        # Whole words, except possibly the last one drawn (cut to the exact size).
        starts = s["word_starts"][where[:-1]] | np.isin(where[:-1] - 1, where)
        assert starts.all()


def test_replaced_set_is_the_same_in_every_epoch_and_seeded():
    c = collator()
    for index in range(20):
        a = c.positions(make_sample(index, epoch=0))
        b = c.positions(make_sample(index, epoch=3))
        np.testing.assert_array_equal(a, b)
    other = collator(seed=8)
    assert any(
        not np.array_equal(c.positions(make_sample(i)), other.positions(make_sample(i)))
        for i in range(20)
    )


def test_batch_labels_and_rtd_hits():
    c = collator()
    samples = [make_sample(i, length=30) for i in range(16)]
    batch = c(samples)
    assert set(batch) == {
        "input_ids", "attention_mask", "mlm_labels", "rtd_labels", "instance_ids", "epoch",
        "replaced_positions",
    }  # fmt: skip
    for i, s in enumerate(samples):
        where = batch["replaced_positions"][i]
        where = where[where >= 0].numpy()
        tokens = torch.from_numpy(s["tokens"])
        selected = batch["mlm_labels"][i] != IGNORE_INDEX
        assert selected.nonzero().squeeze(1).tolist() == sorted(where.tolist())
        assert torch.equal(batch["mlm_labels"][i][selected], tokens[selected])
        # RTD label 1 exactly where the input differs from the original; hits count as 0.
        expected = (batch["input_ids"][i] != tokens).long()
        expected[s["length"] :] = IGNORE_INDEX
        assert torch.equal(batch["rtd_labels"][i], expected)
        assert torch.equal(batch["input_ids"][i][~selected], tokens[~selected])
        assert batch["attention_mask"][i].sum() == s["length"]
    # Over 16 samples a few replacements hit the original (vocabulary of 55 tokens).
    hits = (batch["mlm_labels"] == batch["input_ids"]) & (batch["mlm_labels"] != IGNORE_INDEX)
    assert (batch["rtd_labels"][hits] == 0).all()


def test_uniform_cold_start_never_draws_specials():
    source = ColdStart(
        cold_start_probs(ReplacementConfig(cold_start="uniform"), [], [], SPECIAL), 1
    )
    draws = np.concatenate([source.replacements(i, 0, np.arange(20)) for i in range(2000)])
    assert draws.min() >= 5 and draws.max() < VOCAB
    counts = np.bincount(draws, minlength=VOCAB)[5:]
    expected = draws.size / 55
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 110  # df 54: 0.999 quantile ~ 93


def test_unigram_cold_start_follows_the_counts_and_blends(tmp_path):
    counts_a = np.arange(VOCAB, dtype=np.int64)  # skewed; specials counted but excluded
    counts_b = np.zeros(VOCAB, dtype=np.int64)
    counts_b[10] = 5
    np.save(tmp_path / "a_unigram.npy", counts_a)
    np.save(tmp_path / "b_unigram.npy", counts_b)
    config = ReplacementConfig(cold_start="unigram")
    probs = cold_start_probs(config, [str(tmp_path / "a")], [1.0], SPECIAL)
    assert probs[:5].sum() == 0
    np.testing.assert_allclose(probs[5:], counts_a[5:] / counts_a[5:].sum())
    blend = cold_start_probs(
        config, [str(tmp_path / "a"), str(tmp_path / "b")], [0.75, 0.25], SPECIAL
    )
    assert blend[10] == pytest.approx(0.75 * probs[10] + 0.25)
    source = ColdStart(probs, 3)
    draws = np.concatenate([source.replacements(i, 0, np.arange(25)) for i in range(4000)])
    observed = np.bincount(draws, minlength=VOCAB)
    expected = probs * draws.size
    keep = expected > 0
    assert observed[~keep].sum() == 0
    chi2 = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    assert chi2 < 110  # df 54
    # A mutation (uniform draws) fails the same statistic.
    uniform = ColdStart((~SPECIAL) / 55.0, 3)
    udraws = np.concatenate([uniform.replacements(i, 0, np.arange(25)) for i in range(4000)])
    uobs = np.bincount(udraws, minlength=VOCAB)
    assert ((uobs[keep] - expected[keep]) ** 2 / expected[keep]).sum() > 1000


def test_cold_start_errors_name_the_file(tmp_path):
    config = ReplacementConfig(cold_start="unigram")
    with pytest.raises(ConfigError, match="missing_unigram.npy does not exist"):
        cold_start_probs(config, [str(tmp_path / "missing")], [1.0], SPECIAL)
    np.save(tmp_path / "short_unigram.npy", np.ones(7, dtype=np.int64))
    with pytest.raises(ConfigError, match=r"short_unigram.npy holds int64 \(7,\)"):
        cold_start_probs(config, [str(tmp_path / "short")], [1.0], SPECIAL)
    with pytest.raises(ConfigError, match="--cold-start"):
        ReplacementConfig(cold_start="zipf")
    with pytest.raises(ConfigError, match="--mask-prob"):
        ReplacementConfig(mask_prob=0.0)


def test_cold_start_draws_are_seeded_per_instance_and_epoch():
    source = ColdStart((~SPECIAL) / 55.0, 3)
    a = source.replacements(5, 0, np.arange(30))
    np.testing.assert_array_equal(a, source.replacements(5, 0, np.arange(30)))
    assert not np.array_equal(a, source.replacements(5, 1, np.arange(30)))
    assert not np.array_equal(a, source.replacements(6, 0, np.arange(30)))

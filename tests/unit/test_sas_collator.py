"""SAS's replaced sets S and cold-start replacements (data/sas_collator.py)."""

import math

import numpy as np
import pytest
import torch

from megatron_taco.data.masking import IGNORE_INDEX
from megatron_taco.data.sas_collator import (
    ColdStart,
    MaskedColdStart,
    ReplacementConfig,
    SasCollator,
    cold_start_probs,
    make_cold_start,
    replaced_positions,
    tempered,
)
from megatron_taco.errors import ConfigError
from tests.helpers import chi2_goodness_of_fit

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


def collator(cold="uniform", probs=None, mask_prob=0.15, seed=7, source=None, **kwargs):
    config = ReplacementConfig(mask_prob=mask_prob, cold_start=cold)
    probs = probs if probs is not None else (~SPECIAL) / (~SPECIAL).sum()
    return SasCollator(
        pad_id=PAD, seq_length=SEQ, seed=seed, config=config,
        source=source or ColdStart(probs, seed), **kwargs,
    )  # fmt: skip


def words_of(sample) -> list[np.ndarray]:
    """The sample's words, derived independently of the code under test: a word starts at a
    word-start token and runs to the next word start or the closing [SEP]."""
    length = sample["length"]
    starts = np.flatnonzero(sample["word_starts"][1 : length - 1]) + 1
    ends = np.r_[starts[1:], length - 1]
    return [np.arange(a, b) for a, b in zip(starts, ends)]


def check_replaced_set(sample, where, mask_prob=0.15):
    """|S| = ceil(mask_prob * k), distinct real tokens, and whole words: every chosen word
    with all its pieces, except at most one word cut at the size limit, which must be the
    last one drawn and keep a prefix of its pieces."""
    k = sample["length"] - 2
    assert where.size == math.ceil(mask_prob * k)
    assert len(set(where.tolist())) == where.size
    assert not sample["special"][where].any() and (where < sample["length"]).all()
    chosen = set(where.tolist())
    partial = [w for w in words_of(sample) if 0 < len(chosen & set(w.tolist())) < w.size]
    assert len(partial) <= 1, f"{len(partial)} words chosen without all their pieces"
    if partial:
        word = partial[0]
        taken = np.sort(where[np.isin(where, word)])
        np.testing.assert_array_equal(taken, word[: taken.size])  # a prefix of the word
        assert set(where[-taken.size :].tolist()) == set(taken.tolist())  # drawn last


def test_replaced_set_size_specials_and_whole_words():
    multi_piece = 0
    for index in range(300):
        s = make_sample(index)
        where = replaced_positions(s["word_starts"], s["special"], s["length"], 0.15, 7, index)
        check_replaced_set(s, where)
        multi_piece += sum(w.size > 1 and np.isin(w, where).all() for w in words_of(s))
    assert multi_piece > 100  # the check above saw many whole multi-piece words


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


def test_replaced_set_is_redrawn_per_epoch_without_self_augmentation():
    """The Unig-MLM-RTD ablation: S drawn afresh per epoch, seeded by (seed, instance, epoch),
    whole words of the right size in every epoch, each position equally likely over epochs
    (chi-square); the fixed S of self-augmentation fails the same statistic."""
    dynamic = collator(fixed_positions=False)
    for index in range(30):
        sets = [dynamic.positions(make_sample(index, epoch=e)) for e in range(4)]
        for e, where in enumerate(sets):
            check_replaced_set(make_sample(index, epoch=e), where)
            np.testing.assert_array_equal(where, dynamic.positions(make_sample(index, epoch=e)))
        assert len({tuple(w.tolist()) for w in sets}) > 1
    # One instance of single-piece words over 2000 epochs: every real position equally often.
    s = make_sample(5, length=SEQ)
    s["word_starts"][:] = True
    real = np.arange(1, SEQ - 1)

    def position_counts(c):
        counts = np.zeros(SEQ)
        for epoch in range(2000):
            counts[c.positions({**s, "epoch": epoch})] += 1
        return counts[real]

    counts = position_counts(dynamic)
    _, p = chi2_goodness_of_fit(counts, np.full(real.size, counts.sum() / real.size))
    assert p > 1e-3
    fixed = position_counts(collator())
    _, p = chi2_goodness_of_fit(fixed, np.full(real.size, fixed.sum() / real.size))
    assert p < 1e-12


def test_batch_labels_and_rtd_hits():
    c = collator()
    samples = [make_sample(i, length=30) for i in range(16)]
    batch = c(samples)
    assert set(batch) == {
        "input_ids", "attention_mask", "mlm_labels", "rtd_labels", "instance_ids", "epoch",
        "replaced_positions", "dropped_slots", "from_store",
    }  # fmt: skip
    assert not batch["dropped_slots"].any() and (batch["from_store"] == 0).all()  # cold start
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


class FakeStore:
    """A replacement source that reads "stored" tokens from epoch 1 on: the original token
    at every third slot (a hit), another token elsewhere."""

    def __init__(self, tokens_of):
        self.tokens_of = tokens_of

    def replacements(self, instance, epoch, positions, global_index=None):
        original = self.tokens_of(instance)[positions]
        other = (original - 5 + 1 + instance % 7) % (VOCAB - 5) + 5
        return np.where(np.arange(positions.size) % 3 == 0, original, other)

    def reads_store(self, epoch):
        return epoch >= 1

    def detects(self, epoch):
        return True


def test_store_tokens_are_counted_and_hits_dropped_on_request():
    samples = {i: make_sample(i, length=36) for i in range(12)}
    store = FakeStore(lambda i: samples[i]["tokens"])
    keep = collator(source=store)
    drop = collator(source=store, drop_hits=True)
    for epoch in (0, 1):
        batch = [{**samples[i], "epoch": epoch} for i in range(12)]
        kept, dropped = keep(batch), drop(batch)
        sizes = (kept["replaced_positions"] >= 0).sum(1)
        # Without dropping, hits stay in S (RTD label 0, MLM label kept).
        assert not kept["dropped_slots"].any()
        assert torch.equal(kept["from_store"], sizes if epoch else torch.zeros_like(sizes))
        assert torch.equal(kept["input_ids"], dropped["input_ids"])
        assert torch.equal(kept["rtd_labels"], dropped["rtd_labels"])
        if epoch == 0:  # the cold start is never dropped from
            assert not dropped["dropped_slots"].any()
            continue
        for i in range(12):
            where = kept["replaced_positions"][i][: sizes[i]]
            hit = torch.arange(int(sizes[i])) % 3 == 0
            assert torch.equal(dropped["dropped_slots"][i][: sizes[i]], hit)
            assert torch.equal(kept["input_ids"][i][where[hit]], kept["mlm_labels"][i][where[hit]])
            assert (dropped["mlm_labels"][i][where[hit]] == IGNORE_INDEX).all()
            assert (dropped["mlm_labels"][i][where[~hit]] != IGNORE_INDEX).all()
            assert (dropped["rtd_labels"][i][where[hit]] == 0).all()
            assert dropped["from_store"][i] == int((~hit).sum())


def test_cold_start_warmup_draws_from_the_tempered_distribution():
    """The first warmup_samples of the stream draw from p^power (chi-square), later ones and
    evaluation samples (no global index) from p; the mutation "no warm-up" fails."""
    counts = np.zeros(VOCAB)
    counts[5:] = np.arange(1, VOCAB - 4) ** 2  # skewed, as unigram counts are
    probs = counts / counts.sum()
    warm = tempered(probs, 0.5)
    np.testing.assert_allclose(warm[5:], np.sqrt(counts[5:]) / np.sqrt(counts[5:]).sum())
    source = ColdStart(probs, 3, warmup_probs=warm, warmup_samples=4000)

    def draws(global_index):
        out = [source.replacements(i, 0, np.arange(20), global_index(i)) for i in range(4000)]
        return np.bincount(np.concatenate(out), minlength=VOCAB)[5:]

    early, late, evaluation = draws(lambda i: i), draws(lambda i: 4000 + i), draws(lambda i: None)
    n = early.sum()
    assert chi2_goodness_of_fit(early, warm[5:] * n)[1] > 1e-3
    assert chi2_goodness_of_fit(early, probs[5:] * n)[1] < 1e-12
    for observed in (late, evaluation):
        assert chi2_goodness_of_fit(observed, probs[5:] * n)[1] > 1e-3
    with pytest.raises(ConfigError, match="--cold-start-warmup-power"):
        ReplacementConfig(cold_start_warmup_power=0.0)
    with pytest.raises(ConfigError, match="--cold-start-warmup-iters"):
        ReplacementConfig(cold_start_warmup_iters=-1)


def test_hit_dropping_needs_self_augmentation():
    from megatron_taco.recipes.sas_augmentation import SelfAugmentationConfig

    assert SelfAugmentationConfig(drop_replacement_hits=True).drop_replacement_hits
    with pytest.raises(ConfigError, match="^--drop-replacement-hits: .*no store"):
        SelfAugmentationConfig(self_augmentation=False, drop_replacement_hits=True)


@pytest.mark.parametrize("temperature", [0.0, float("inf"), float("nan")])
def test_sampling_temperature_is_finite_and_positive(temperature):
    from megatron_taco.recipes.sas_augmentation import SelfAugmentationConfig

    with pytest.raises(ConfigError, match="^--sampling-temperature: must be finite and > 0"):
        SelfAugmentationConfig(sampling_temperature=temperature)


MASK = 4  # the tokenizer's [MASK] id (data/tokenizer.py)


def masked_collator(kind, **kwargs):
    config = ReplacementConfig(cold_start=kind, **kwargs)
    probs = cold_start_probs(config, [], [], SPECIAL)
    return SasCollator(
        pad_id=PAD, seq_length=SEQ, seed=7, config=config,
        source=make_cold_start(config, probs, 7, mask_id=MASK),
    )  # fmt: skip


def test_mask_cold_start_puts_mask_at_every_position_of_s_with_rtd_label_1():
    samples = [make_sample(i) for i in range(20)]
    c = masked_collator("mask")
    batch = c(samples)
    for i, sample in enumerate(samples):
        where = c.positions(sample)
        check_replaced_set(sample, where)
        ids, tokens = batch["input_ids"][i].numpy(), sample["tokens"]
        assert (ids[where] == MASK).all()
        outside = np.setdiff1d(np.arange(sample["length"]), where)
        np.testing.assert_array_equal(ids[outside], tokens[outside])
        np.testing.assert_array_equal(batch["mlm_labels"][i].numpy()[where], tokens[where])
        rtd = batch["rtd_labels"][i].numpy()
        assert (rtd[where] == 1).all() and (rtd[outside] == 0).all()
        assert (rtd[sample["length"] :] == IGNORE_INDEX).all()


def test_mlm_cold_start_is_berts_80_10_10_with_mlm_labels_only():
    """Over ~2,400 positions of S: the share of [MASK], random and kept tokens is BERT's
    (chi-square), the random ones are uniform over the non-special vocabulary, every
    position of S (kept ones included) has its MLM label, and no token has an RTD label."""
    samples = [make_sample(i, length=SEQ) for i in range(400)]
    c = masked_collator("mlm")
    batch = c(samples)
    kinds = np.zeros(3)
    randoms = []
    for i, sample in enumerate(samples):
        where = c.positions(sample)
        ids, tokens = batch["input_ids"][i].numpy()[where], sample["tokens"][where]
        np.testing.assert_array_equal(batch["mlm_labels"][i].numpy()[where], tokens)
        is_mask = ids == MASK
        # A random draw equal to the original is indistinguishable from a kept token.
        kept = ids == tokens
        kinds += [is_mask.sum(), (~is_mask & ~kept).sum(), kept.sum()]
        randoms.extend(ids[~is_mask & ~kept].tolist())
    assert (batch["rtd_labels"] == IGNORE_INDEX).all()
    n = kinds.sum()
    p_equal = 1 / (~SPECIAL).sum()  # a random token that happens to be the original
    expected = n * np.array([0.8, 0.1 * (1 - p_equal), 0.1 + 0.1 * p_equal])
    assert chi2_goodness_of_fit(kinds, expected)[1] > 1e-3, kinds
    counts = np.bincount(randoms, minlength=VOCAB)
    assert counts[SPECIAL].sum() == 0
    assert (
        chi2_goodness_of_fit(
            counts[~SPECIAL], np.full((~SPECIAL).sum(), len(randoms) / (~SPECIAL).sum())
        )[1]
        > 1e-3
    )


def test_masked_cold_starts_are_for_the_first_epoch_only():
    """From epoch 2 the store's tokens (here FakeStore's) are read and RTD labels are back,
    whatever the cold start was."""
    from megatron_taco.recipes.sas_augmentation import StoreSource

    config = ReplacementConfig(cold_start="mlm")
    cold = make_cold_start(config, cold_start_probs(config, [], [], SPECIAL), 7, mask_id=MASK)
    source = StoreSource(cold, "unused")
    assert not source.detects(0) and source.detects(1) and not source.reads_store(0)
    samples = [make_sample(i, epoch=0) for i in range(8)]
    c = SasCollator(pad_id=PAD, seq_length=SEQ, seed=7, config=config, source=source)
    assert (c(samples)["rtd_labels"] == IGNORE_INDEX).all()
    assert (c(samples)["input_ids"] == MASK).any()


def test_masked_cold_starts_refuse_the_sampling_warmup():
    with pytest.raises(ConfigError, match="--cold-start-warmup-iters: flattens"):
        ReplacementConfig(cold_start="mlm", cold_start_warmup_iters=10)
    with pytest.raises(ValueError, match="not a masked cold start"):
        MaskedColdStart("unigram", np.ones(3) / 3, MASK, 0)


def test_a_higher_replacement_rate_replaces_more_of_each_instance():
    """--mask-prob 0.3 (a departure, ELECTRA issue 49): |S| = ceil(0.3 k), whole words, and
    the store rows are as wide as the largest S."""
    c15, c30 = collator(mask_prob=0.15), collator(mask_prob=0.3)
    assert c30.width == math.ceil(0.3 * (SEQ - 2)) > c15.width
    for index in range(50):
        sample = make_sample(index)
        check_replaced_set(sample, c30.positions(sample), mask_prob=0.3)
        batch = c30([sample])
        assert (batch["rtd_labels"][0] == 1).sum() <= (batch["mlm_labels"][0] >= 0).sum()
        assert (batch["mlm_labels"][0] >= 0).sum() == math.ceil(0.3 * (sample["length"] - 2))


def test_stored_mask_share_puts_mask_at_part_of_s_in_the_store_epochs_only():
    """--stored-mask-share 0.5 (a departure): in epoch 2 about half of each S reads [MASK]
    (seeded per instance and epoch) with its MLM label and no RTD label, the rest the stored
    token with both; from_store counts only the slots that read the store; epoch 1 (the cold
    start) is untouched; share 0 is the paper."""
    samples = {i: make_sample(i, length=SEQ) for i in range(200)}
    store = FakeStore(lambda i: samples[i]["tokens"])
    config = ReplacementConfig(cold_start="uniform", stored_mask_share=0.5)
    probs = (~SPECIAL) / (~SPECIAL).sum()
    half = SasCollator(pad_id=PAD, seq_length=SEQ, seed=7, config=config,
                       source=ColdStart(probs, 7), mask_id=MASK)  # fmt: skip
    half.source = store
    paper = collator(source=store)
    first = half([{**samples[i], "epoch": 0} for i in range(200)])
    assert not (first["input_ids"] == MASK).any()
    batch = [{**samples[i], "epoch": 1} for i in range(200)]
    out, plain = half(batch), paper(batch)
    masks = total = 0
    for i in range(200):
        where = out["replaced_positions"][i]
        where = where[where >= 0]
        is_mask = out["input_ids"][i][where] == MASK
        masks, total = masks + int(is_mask.sum()), total + where.numel()
        assert torch.equal(out["mlm_labels"][i], plain["mlm_labels"][i])
        assert (out["rtd_labels"][i][where[is_mask]] == IGNORE_INDEX).all()
        assert torch.equal(
            out["rtd_labels"][i][where[~is_mask]], plain["rtd_labels"][i][where[~is_mask]]
        )
        assert torch.equal(
            out["input_ids"][i][where[~is_mask]], plain["input_ids"][i][where[~is_mask]]
        )
        assert out["from_store"][i] == int((~is_mask).sum())
    sd = (total * 0.25) ** 0.5
    assert abs(masks - 0.5 * total) < 5 * sd, (masks, total)
    assert torch.equal(half(batch)["input_ids"], out["input_ids"])  # seeded
    again = half([{**samples[i], "epoch": 2} for i in range(200)])
    assert not torch.equal(again["input_ids"], out["input_ids"])  # redrawn per epoch
    with pytest.raises(ValueError, match="mask_id"):
        SasCollator(pad_id=PAD, seq_length=SEQ, seed=7, config=config, source=store)
    with pytest.raises(ConfigError, match="--stored-mask-share"):
        ReplacementConfig(stored_mask_share=1.5)


@pytest.mark.parametrize("kind", ["mask", "mlm"])
def test_masked_cold_starts_draw_uniform_tokens_even_beside_unigram_counts(kind, tmp_path):
    """BERT's 10% random tokens (and evaluation's samples) are uniform over the non-special
    vocabulary, not the corpus's unigram counts that a --data-path prefix carries."""
    from megatron_taco.data.indexed_dataset import unigram_path

    prefix = str(tmp_path / "corpus")
    counts = np.arange(VOCAB, dtype=np.int64) ** 2  # far from uniform
    np.save(unigram_path(prefix), counts)
    skewed = cold_start_probs(ReplacementConfig(cold_start="unigram"), [prefix], [1.0], SPECIAL)
    assert not np.allclose(skewed[~SPECIAL], skewed[~SPECIAL][0])  # the counts are read
    probs = cold_start_probs(ReplacementConfig(cold_start=kind), [prefix], [1.0], SPECIAL)
    np.testing.assert_allclose(probs, (~SPECIAL) / (~SPECIAL).sum(), rtol=1e-15, atol=0)

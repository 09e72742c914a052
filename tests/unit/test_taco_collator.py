import pickle

import numpy as np
import pytest
import torch

from megatron_taco.data.masking import IGNORE_INDEX, TokenMaskingConfig, mask_budget
from megatron_taco.data.position_masking import PositionMaskingConfig
from megatron_taco.data.taco_collator import TacoMaskingCollator

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SEQ = 64
VOCAB = 500


def make_sample(index, seq_length=SEQ):
    """A BertSampleDataset-shaped sample; content depends only on index."""
    rng = np.random.default_rng(1000 + index)
    length = int(rng.integers(20, seq_length + 1))
    sep = int(rng.integers(3, length - 3))
    tokens = np.full(seq_length, PAD, dtype=np.int64)
    tokens[:length] = rng.integers(5, VOCAB, length)
    tokens[[0, sep, length - 1]] = [CLS, SEP, SEP]
    special = np.ones(seq_length, dtype=bool)
    special[1 : length - 1] = False
    special[sep] = True
    word_starts = np.zeros(seq_length, dtype=bool)
    word_starts[:length] = (rng.random(length) < 0.7) | special[:length]
    sentence_ids = np.full(seq_length, -1, dtype=np.int64)
    sentence_ids[1:sep] = 0
    sentence_ids[sep + 1 : length - 1] = 1
    return {
        "tokens": tokens,
        "length": length,
        "sentence_ids": sentence_ids,
        "word_starts": word_starts,
        "special": special,
        "index": index,
    }


def collator(**overrides):
    kwargs = dict(mask_id=MASK, pad_id=PAD, vocab_size=VOCAB, seq_length=SEQ, seed=1234)
    kwargs.update(overrides)
    return TacoMaskingCollator(**kwargs)


def test_batch_layout_shapes_and_dtypes():
    samples = [make_sample(i) for i in range(4)]
    batch = collator()(samples)
    b = len(samples)
    assert set(batch) == {"input_ids", "position_ids", "attention_mask", "mlm_labels", "mpm_labels"}
    for key, dtype in [
        ("input_ids", torch.int64),
        ("position_ids", torch.int64),
        ("attention_mask", torch.bool),
        ("mlm_labels", torch.int64),
        ("mpm_labels", torch.int64),
    ]:
        assert batch[key].shape == (2 * b, SEQ), key
        assert batch[key].dtype == dtype, key
    arange = torch.arange(SEQ)
    for i, sample in enumerate(samples):
        length = sample["length"]
        tokens = torch.from_numpy(sample["tokens"])
        real = arange < length
        true_positions = torch.where(real, arange, 0)
        special = torch.from_numpy(sample["special"])
        mlm_row, mpm_row = i, b + i
        assert torch.equal(batch["attention_mask"][mlm_row], real)
        assert torch.equal(batch["attention_mask"][mpm_row], real)
        # MLM rows: true positions, corrupted tokens, MLM labels only.
        assert torch.equal(batch["position_ids"][mlm_row], true_positions)
        assert (batch["mpm_labels"][mlm_row] == IGNORE_INDEX).all()
        mlm = batch["mlm_labels"][mlm_row]
        predicted = mlm != IGNORE_INDEX
        assert predicted.sum() >= mask_budget(0.15, int((~special).sum()))
        assert torch.equal(mlm[predicted], tokens[predicted])
        assert not (predicted & special).any()
        assert torch.equal(batch["input_ids"][mlm_row][~predicted], tokens[~predicted])
        # MPM rows: true tokens, corrupted positions, MPM labels only.
        assert torch.equal(batch["input_ids"][mpm_row], tokens)
        assert (batch["mlm_labels"][mpm_row] == IGNORE_INDEX).all()
        mpm = batch["mpm_labels"][mpm_row]
        selected = mpm != IGNORE_INDEX
        assert selected.sum() == mask_budget(0.15, int((~special).sum()))
        assert torch.equal(mpm[selected], arange[selected])
        assert not (selected & special).any()
        positions = batch["position_ids"][mpm_row]
        assert torch.equal(positions[~selected], true_positions[~selected])


def test_masking_depends_only_on_seed_and_index():
    samples = {i: make_sample(i) for i in (3, 7, 11)}
    first = collator()([samples[3], samples[7], samples[11]])
    # A fresh, pickled collator (as in a DataLoader worker) with another batch order.
    other = pickle.loads(pickle.dumps(collator()))
    second = other([samples[11], samples[3]])
    for key in first:
        assert torch.equal(first[key][0], second[key][1]), key  # index 3, MLM row
        assert torch.equal(first[key][3], second[key][3]), key  # index 3, MPM row
        assert torch.equal(first[key][2], second[key][0]), key  # index 11, MLM row
        assert torch.equal(first[key][5], second[key][2]), key  # index 11, MPM row


def test_different_seed_or_index_gives_different_masks():
    sample = make_sample(5)
    base = collator()([sample])
    reseeded = collator(seed=99)([sample])
    reindexed = collator()([dict(sample, index=6)])
    for other in (reseeded, reindexed):
        assert not torch.equal(base["mlm_labels"], other["mlm_labels"])
        assert not torch.equal(base["mpm_labels"], other["mpm_labels"])


def test_token_and_position_streams_are_independent():
    # With one-token words and equal span settings, the two samplers see the same
    # units; sharing one rng stream would make them select identical spans.
    samples = []
    for i in range(20):
        sample = make_sample(i)
        sample["word_starts"] = np.arange(SEQ) < sample["length"]
        samples.append(sample)
    batch = collator(
        masking=TokenMaskingConfig(max_span_length=3),
        position_masking=PositionMaskingConfig(max_position_span_length=3),
    )(samples)
    b = len(samples)
    same = sum(
        torch.equal(
            batch["mlm_labels"][i] != IGNORE_INDEX, batch["mpm_labels"][b + i] != IGNORE_INDEX
        )
        for i in range(b)
    )
    assert same <= 2


def test_masking_config_is_used():
    samples = [make_sample(i) for i in range(8)]
    cfg = TokenMaskingConfig(mask_prob=0.5, mask_replace_prob=1.0, random_replace_prob=0.0)
    pos = PositionMaskingConfig(
        position_mask_prob=0.3, position_mask_replace_prob=1.0, position_shuffle_prob=0.0
    )
    batch = collator(masking=cfg, position_masking=pos)(samples)
    b = len(samples)
    for i, sample in enumerate(samples):
        n = int((~sample["special"]).sum())
        predicted = batch["mlm_labels"][i] != IGNORE_INDEX
        assert predicted.sum() >= mask_budget(0.5, n)
        assert (batch["input_ids"][i][predicted] == MASK).all()
        selected = batch["mpm_labels"][b + i] != IGNORE_INDEX
        assert selected.sum() == mask_budget(0.3, n)
        assert (batch["position_ids"][b + i][selected] == -1).all()


def test_random_token_sources():
    cfg = TokenMaskingConfig(mask_replace_prob=0.0, random_replace_prob=1.0, mask_prob=0.5)
    samples = [make_sample(i) for i in range(30)]
    special_ids = [PAD, UNK, CLS, SEP, MASK] + list(range(5, 400))
    # (the collator's special_ids option, which no product code passed, moved here)
    random_token_ids = np.setdiff1d(np.arange(VOCAB), special_ids)
    batch = collator(masking=cfg, random_token_ids=random_token_ids)(samples)
    replaced = batch["input_ids"][:30][batch["mlm_labels"][:30] != IGNORE_INDEX]
    assert replaced.numel() > 100
    assert (replaced >= 400).all() and (replaced < VOCAB).all()

    class FakeTokenizer:
        mask_id, pad_id, vocab_size = MASK, PAD, VOCAB

        def is_special_mask(self):
            mask = np.zeros(VOCAB, dtype=bool)
            mask[: VOCAB - 10] = True
            return mask

    batch = TacoMaskingCollator.from_tokenizer(
        FakeTokenizer(), seq_length=SEQ, seed=1, masking=cfg
    )(samples)
    replaced = batch["input_ids"][:30][batch["mlm_labels"][:30] != IGNORE_INDEX]
    assert (replaced >= VOCAB - 10).all()


def test_rejects_malformed_samples():
    with pytest.raises(ValueError, match="shape"):
        collator()([dict(make_sample(0), tokens=np.zeros(SEQ + 1, dtype=np.int64))])
    sample = make_sample(1)
    assert sample["length"] < SEQ
    tokens = sample["tokens"].copy()
    tokens[-1] = 77
    with pytest.raises(ValueError, match="padding"):
        collator()([dict(sample, tokens=tokens)])
    with pytest.raises(ValueError, match="random_token_ids"):
        collator(random_token_ids=[VOCAB])

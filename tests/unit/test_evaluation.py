"""megatron_taco/evaluation: each adapter gives what its model's own training forward
computes (ours, transformers' BERT, ELECTRA and DeBERTa-v2), the word-order rows and the
sentences compared, the RTD zero-shot score and the frozen probe by hand. (The demo's run on
checkpoints trained at tensor parallel 2 under ZeRO is in the e2e tests of pretrain_taco.py
and pretrain_sas.py; the Figure-1 probe: test_word_order_probe.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_taco.evaluation.encoders import (
    FrozenEncoder,
    OurEncoder,
    TransformersEncoder,
    pad_rows,
)
from megatron_taco.evaluation.probe import mean_pooled, probe
from megatron_taco.evaluation.word_order import (
    clip_to_fit,
    fitting,
    originality_scores,
    swap_adjacent,
    train_dev_rows,
)
from tests.helpers import botchan_sentences


def _ids_and_labels(vocab: int, seed: int = 0):
    """ids [3, 10] (row 2 padded after 7 tokens), labels at column 2 and (1, 5), and the
    ids with the labelled tokens [MASK]ed (id 4)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, 10), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[2, 7:] = False
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    labels[1, 5] = ids[1, 5]
    return ids, mask, labels, ids.masked_fill(labels != -100, 4)


def test_sentences_longer_than_the_position_table_are_left_out_not_cut(tokenizer_model):
    from megatron_taco.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_model)
    sentences = botchan_sentences(min_words=8, max_words=40)[:30]
    lengths = [len(tok.encode(s)) + 2 for s in sentences]
    limit = sorted(lengths)[len(lengths) // 2]
    assert min(lengths) <= limit < max(lengths)  # some fit, some do not
    originals, shuffles = fitting(tok, sentences, seeds=2, limit=limit)
    assert len(originals) == sum(n <= limit for n in lengths) and len(shuffles) == 2
    for rows in (originals, *shuffles):
        assert len(rows) == len(originals)
        assert all(len(r) <= limit and r[0] == tok.cls_id and r[-1] == tok.sep_id for r in rows)
    for shuffled in shuffles:
        # Each pair holds the same pieces in another order: a cut shuffle would not.
        for a, b in zip(originals, shuffled):
            assert sorted(a) == sorted(b) and a != b


def test_clip_to_fit_keeps_the_longest_word_prefix_that_fits(tokenizer_model):
    from megatron_taco.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_model)
    sentences = botchan_sentences(min_words=8, max_words=40)[:40]
    limit = sorted(len(tok.encode(s)) + 2 for s in sentences)[len(sentences) // 3]
    clipped = clip_to_fit(tok, sentences, limit)
    kept = iter(clipped)
    for sentence in sentences:
        words = sentence.split()
        fits = [k for k in range(8, len(words) + 1)
                if len(tok.encode(" ".join(words[:k]))) + 2 <= limit]  # fmt: skip
        if fits:  # the longest prefix of 8 words or more, in the input's order
            assert next(kept) == " ".join(words[: max(fits)])
    assert next(kept, None) is None
    assert 0 < len(clipped) < len(sentences)  # some cut, some too long even at 8 words
    assert any(c in sentences for c in clipped) and any(c not in sentences for c in clipped)
    originals, _ = fitting(tok, clipped, seeds=1, limit=limit)
    assert len(originals) > 0.9 * len(clipped)  # shuffled, the same words mostly fit too


def test_held_out_sentences_of_the_validation_or_the_test_documents(tokenizer_model, tmp_path):
    """Ten one-sentence documents, --split 80,10,10: document 8 is validation, 9 test (0-7
    train, never read); ``parts`` picks one side (the campaign's lr choice on validation,
    its figures on test), the default reads both in order."""
    from megatron_taco.data.indexed_dataset import (
        IndexedDatasetBuilder,
        data_file_path,
        index_file_path,
    )
    from megatron_taco.data.tokenizer import Tokenizer
    from megatron_taco.evaluation.word_order import held_out_sentences

    tok = Tokenizer(tokenizer_model)
    sentences = botchan_sentences(min_words=8, max_words=40)[:10]
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32)
    for s in sentences:
        builder.add_item(tok.encode(s))
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    decoded = [" ".join(tok.decode(tok.encode(s)).split()) for s in sentences]
    assert held_out_sentences(prefix, tok, "80,10,10", parts=("valid",)) == [decoded[8]]
    assert held_out_sentences(prefix, tok, "80,10,10", parts=("test",)) == [decoded[9]]
    assert held_out_sentences(prefix, tok, "80,10,10") == decoded[8:]


def test_word_order_rows_in_both_forms_split_by_sentence():
    """Each sentence gives an original and a swapped row, on the same side of the split: no
    dev sentence is seen in training in either form. 10 sentences -> 2 dev (4 rows), 8 train."""
    sentences = [f"w{i} a b c d e f g" for i in range(10)]
    rows = train_dev_rows(sentences, "swap", np.random.default_rng(0), both_forms=True)
    assert (len(rows["dev"]), len(rows["train"])) == (4, 16)
    for side in rows.values():
        originals = [t for t, label in side if label == "original"]
        swapped = [t for t, label in side if label == "swapped"]
        assert len(originals) == len(swapped) == len(side) // 2
        # The swapped rows are the originals' words, reordered, and never unchanged.
        assert sorted(sorted(t.split()) for t in swapped) == sorted(
            sorted(t.split()) for t in originals
        )
        assert not set(swapped) & set(originals)
    dev_sentences = {t for t, label in rows["dev"] if label == "original"}
    train_words = {t.split()[0] for t, _ in rows["train"]} | {
        t.split()[1] for t, _ in rows["train"]
    }
    assert not {t.split()[0] for t in dev_sentences} & train_words
    # The one-form default is the task file's, unchanged: half of the sentences swapped.
    one = train_dev_rows(sentences, "swap", np.random.default_rng(0))
    assert (len(one["dev"]), len(one["train"])) == (2, 8)
    assert sum(label == "swapped" for side in one.values() for _, label in side) == 5
    assert swap_adjacent("a b", np.random.default_rng(0)) == "b a"


def test_rtd_zero_shot_scores_the_probability_of_no_replacement():
    """Two sentences of 4 words: A's pieces all look mildly original (logit -2); B has one
    word flagged as replaced (+5) and three confidently original (-7). Under the RTD head, B
    is the one with a replaced word (P(all original) 0.0067 x ~1 vs 0.88^4): its score must be
    lower. A mean of logits says the opposite (-3.5 < -2), which is the inversion measured on
    a long-trained SAS."""
    import types

    logits = {
        1: torch.tensor([0.0, -2, -2, -2, -2, 0.0], dtype=torch.float64),
        2: torch.tensor([0.0, 5, -7, -7, -7, 0.0], dtype=torch.float64),
    }

    class Heads(FrozenEncoder):
        heads = ("rtd",)

        def rtd_logits(self, ids, mask):
            return torch.stack([logits[int(row[1])] for row in ids])

    tok = types.SimpleNamespace(pad_id=0, sep_id=9, mask_id=8)
    rows = [[7, 1, 5, 5, 5, 9], [7, 2, 5, 5, 5, 9]]  # [CLS] w w w w [SEP]; row[1] picks logits
    a, b = originality_scores(Heads(), rows, tok, head="rtd")
    assert b < a
    # By hand: log P(original) = log(1 / (1 + e^z)) per word, averaged over the 4 words
    # ([CLS] and [SEP] left out).
    assert a == pytest.approx(-math.log1p(math.exp(-2)), rel=1e-12)
    want = -(math.log1p(math.exp(5)) + 3 * math.log1p(math.exp(-7))) / 4
    assert b == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kind", ["TACO", "SAS"])
def test_our_encoder_mlm_nll_is_the_models_own_mlm_loss(kind):
    """The zero-shot MLM score's per-token NLL must be what the model trains on: its own
    forward's mlm_loss over the same labelled tokens (a swapped positions/mask argument, or
    the wrong head, gives another number)."""
    from tests.helpers import (
        build,
        build_sas,
        make_batch,
        make_sas_batch,
        tiny_config,
        tiny_sas_config,
    )

    if kind == "TACO":
        model = build(tiny_config()).double().eval()
        batch = make_batch(b=2)
        rows = slice(0, 2)  # the MLM rows; rows [b, 2b) carry the MPM labels
        pos = batch["position_ids"][rows]
    else:
        model = build_sas(tiny_sas_config()).double().eval()
        batch = make_sas_batch(b=3)
        rows, pos = slice(None), None
    enc = OurEncoder(model, kind)
    assert enc.heads == (("mlm",) if kind == "TACO" else ("rtd", "mlm"))
    with torch.no_grad():
        own = model(batch)["mlm_loss"]
        nll = enc.mlm_nll(
            batch["input_ids"][rows], pos, batch["attention_mask"][rows], batch["mlm_labels"][rows]
        )
    assert nll.dtype == torch.float64 and nll.numel() == int((batch["mlm_labels"] != -100).sum())
    torch.testing.assert_close(nll.mean(), own.double(), rtol=1e-10, atol=0)


def test_electra_adapter_is_the_peers_own_heads():
    """The downstream benchmarks' ELECTRA (benchmarks.learning.peers.Electra: generator and
    discriminator, read by benchmarks/learning/downstream.peer_encoder) read as ours are:
    the generator's MLM loss as the peer trains it, the discriminator's own RTD logits and
    vectors."""
    from benchmarks.learning.downstream import peer_encoder
    from benchmarks.learning.peers import Electra, Size

    torch.manual_seed(0)
    net = Electra(60, Size(1, 32, 2, 64, max_positions=16), embedding=16).double().eval()
    ids, mask, labels, masked = _ids_and_labels(60)
    enc = peer_encoder(net)
    assert isinstance(enc, TransformersEncoder) and enc.kind == "ELECTRA"
    assert enc.heads == ("rtd", "mlm") and enc.max_positions == 16
    # The generator's MLM loss as the peer trains it (rows doubled: it reads the first half).
    twice = {
        "input_ids": masked.repeat(2, 1),
        "attention_mask": mask.repeat(2, 1),
        "mlm_labels": labels.repeat(2, 1),
    }
    with torch.no_grad():
        own = net(twice)["mlm_loss"]
        nll = enc.mlm_nll(masked, None, mask, labels)
        assert nll.dtype == torch.float64 and nll.shape == (4,)
        torch.testing.assert_close(nll.mean(), own, rtol=1e-12, atol=0)
        # RTD logits: the discriminator's own (transformers' ElectraForPreTraining.logits).
        theirs = net.disc(input_ids=ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(enc.rtd_logits(ids, mask), theirs, rtol=1e-12, atol=0)
        vectors = enc.hidden(ids, mask, None)
        assert vectors.shape == (3, 10, 32)


def test_bert_peer_adapter_is_the_peers_own_mlm_loss():
    """The downstream benchmarks' BERT (benchmarks.learning.peers.BertMlm, TACO's peer):
    its MLM loss as the peer trains it on [MASK]ed rows, its base model's vectors, no RTD
    head."""
    from benchmarks.learning.downstream import peer_encoder
    from benchmarks.learning.peers import BertMlm, Size

    torch.manual_seed(0)
    net = BertMlm(60, Size(1, 32, 2, 64, max_positions=16), all_rows=True).double().eval()
    ids, mask, labels, masked = _ids_and_labels(60)
    enc = peer_encoder(net)
    assert isinstance(enc, TransformersEncoder) and enc.kind == "BERT"
    assert enc.heads == ("mlm",) and enc.max_positions == 16
    batch = {"input_ids": masked, "attention_mask": mask, "mlm_labels": labels}
    with torch.no_grad():
        own = net(batch)["mlm_loss"]
        nll = enc.mlm_nll(masked, None, mask, labels)
        assert nll.dtype == torch.float64 and nll.shape == (4,)
        torch.testing.assert_close(nll.mean(), own, rtol=1e-12, atol=0)
        want = net.bert.bert(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        torch.testing.assert_close(enc.hidden(ids, mask, None), want, rtol=1e-12, atol=0)
    with pytest.raises(NotImplementedError, match="no RTD head"):
        enc.rtd_logits(ids, mask)


@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
def test_transformers_mlm_adapter_is_the_libraries_own_loss(family):
    """BERT and DeBERTa-v2 masked LMs: the per-token NLL averages to transformers' own
    masked-LM loss on the same labels, the vectors are the base model's, and no RTD head is
    claimed."""
    transformers = pytest.importorskip("transformers")
    sizes = dict(
        vocab_size=60,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    if family == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(**sizes))
    else:
        config = transformers.DebertaV2Config(
            **sizes, relative_attention=True, pos_att_type=["p2c", "c2p"]
        )
        model = transformers.DebertaV2ForMaskedLM(config)
    model = model.double().eval()
    ids, mask, labels, masked = _ids_and_labels(60, seed=1)
    enc = TransformersEncoder(model, mlm=model)
    assert enc.kind == family and enc.heads == ("mlm",) and enc.we_width is None
    with torch.no_grad():
        own = model(input_ids=masked, attention_mask=mask.long(), labels=labels).loss
        nll = enc.mlm_nll(masked, None, mask, labels)
        assert nll.dtype == torch.float64 and nll.shape == (4,)
        torch.testing.assert_close(nll.mean(), own, rtol=1e-12, atol=0)
        base = model.base_model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        torch.testing.assert_close(enc.hidden(ids, mask, None), base, rtol=1e-12, atol=0)
    with pytest.raises(NotImplementedError, match="no RTD head"):
        enc.rtd_logits(ids, mask)


def test_mean_pooled_features_ignore_padding():
    """A row's features are the mean of its own real tokens' vectors: the same padded in a
    batch beside a longer row as encoded alone (a pooling over the padding, or attention to
    it, would differ)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=60,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    enc = TransformersEncoder(transformers.BertModel(config).double())
    rows = [[2, 11, 12, 13, 3], [2, 21, 22, 23, 24, 25, 26, 3]]
    together = mean_pooled(enc, rows, pad=0)
    assert together.shape == (2, 32) and together.dtype == np.float64
    for i, row in enumerate(rows):
        ids, mask, pos = pad_rows([row], pad=0)
        with torch.no_grad():
            alone = enc.hidden(ids, mask, pos)[0].mean(0).numpy()
        np.testing.assert_allclose(together[i], alone, rtol=1e-10, atol=1e-12)


def test_probe_by_hand():
    """Features that say nothing (the same vector for both forms of a sentence) leave every
    test pair predicted alike: exactly half right. Features whose one coordinate is the form
    (+1 original, -1 shuffled; the others noise shared by both forms) are read perfectly."""
    rng = np.random.default_rng(0)
    noise = rng.normal(size=(200, 8))
    assert probe(noise, noise, size=64, seed=1) == 0.5
    orig, shuf = noise.copy(), noise.copy()
    orig[:, 0], shuf[:, 0] = 1.0, -1.0
    assert probe(orig, shuf, size=64, seed=1) == 1.0

"""examples/demo_evaluate.py's own parts: which held-out sentences it compares, and bad input
as one line. (Its run on checkpoints trained at tensor parallel 2 under ZeRO is in the e2e
tests of pretrain_taco.py and pretrain_sas.py.)"""

from __future__ import annotations

import sys

import pytest

from tests.helpers import REPO, botchan_sentences

sys.path.insert(0, str(REPO / "examples"))


def test_sentences_longer_than_the_position_table_are_left_out_not_cut(tokenizer_model):
    import demo_evaluate as de

    from megatron_taco.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_model)
    sentences = botchan_sentences(min_words=8, max_words=40)[:30]
    lengths = [len(tok.encode(s)) + 2 for s in sentences]
    limit = sorted(lengths)[len(lengths) // 2]
    assert min(lengths) <= limit < max(lengths)  # some fit, some do not
    originals, shuffles = de.fitting(tok, sentences, seeds=2, limit=limit)
    assert len(originals) == sum(n <= limit for n in lengths) and len(shuffles) == 2
    for rows in (originals, *shuffles):
        assert len(rows) == len(originals)
        assert all(len(r) <= limit and r[0] == tok.cls_id and r[-1] == tok.sep_id for r in rows)
    for shuffled in shuffles:
        # Each pair holds the same pieces in another order: a cut shuffle would not.
        for a, b in zip(originals, shuffled):
            assert sorted(a) == sorted(b) and a != b


def test_bad_input_is_one_line(tmp_path, capsys):
    import demo_evaluate as de

    missing = tmp_path / "nothing"
    assert de.main(["--load", str(missing), "--data-path", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"demo_evaluate.py: error: --load: {missing} is not a directory"], err
    with pytest.raises(SystemExit):
        de.main(["--load", str(missing), "--data-path", "x", "--random-twins", "0"])
    assert "--random-twins must be >= 1, got 0" in capsys.readouterr().err


def test_rtd_zero_shot_scores_the_probability_of_no_replacement():
    """Two sentences of 4 words: A's pieces all look mildly original (logit -2); B has one
    word flagged as replaced (+5) and three confidently original (-7). Under the RTD head, B
    is the one with a replaced word (P(all original) 0.0067 x ~1 vs 0.88^4): its score must be
    lower. A mean of logits says the opposite (-3.5 < -2), which is the inversion measured on
    a long-trained SAS."""
    import math
    import types

    import demo_evaluate as de
    import torch

    logits = {1: torch.tensor([0.0, -2, -2, -2, -2, 0.0], dtype=torch.float64),
              2: torch.tensor([0.0, 5, -7, -7, -7, 0.0], dtype=torch.float64)}  # fmt: skip

    class Heads(de.Encoder):
        def __init__(self):
            self.heads = ("rtd",)

        def rtd_logits(self, ids, mask):
            return torch.stack([logits[int(row[1])] for row in ids])

    tok = types.SimpleNamespace(pad_id=0, sep_id=9, mask_id=8)
    rows = [[7, 1, 5, 5, 5, 9], [7, 2, 5, 5, 5, 9]]  # [CLS] w w w w [SEP]; row[1] picks logits
    a, b = de.originality_scores(Heads(), rows, tok, head="rtd")
    assert b < a
    # By hand: log P(original) = log(1 / (1 + e^z)) per word, averaged over the 4 words
    # ([CLS] and [SEP] left out).
    assert a == pytest.approx(-math.log1p(math.exp(-2)), rel=1e-12)
    assert b == pytest.approx(-(math.log1p(math.exp(5)) + 3 * math.log1p(math.exp(-7))) / 4,
                              rel=1e-12)  # fmt: skip


@pytest.mark.parametrize("kind", ["TACO", "SAS"])
def test_encoder_mlm_nll_is_the_models_own_mlm_loss(kind):
    """The zero-shot MLM score's per-token NLL must be what the model trains on: its own
    forward's mlm_loss over the same labelled tokens (a swapped positions/mask argument, or
    the wrong head, gives another number)."""
    import demo_evaluate as de
    import torch

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
    enc = de.Encoder(model, kind)
    with torch.no_grad():
        own = model(batch)["mlm_loss"]
        nll = enc.mlm_nll(batch["input_ids"][rows], pos, batch["attention_mask"][rows],
                          batch["mlm_labels"][rows])  # fmt: skip
    assert nll.dtype == torch.float64 and nll.numel() == int((batch["mlm_labels"] != -100).sum())
    torch.testing.assert_close(nll.mean(), own.double(), rtol=1e-10, atol=0)

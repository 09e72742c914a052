"""benchmarks/bench_sas_downstream.py's own parts and benchmarks/learning/{downstream,
campaign}.py: timing, bad input, the learning-rate and FLOPs choices, the fine-tuning
classifiers ([CLS] and mean-pooled), model selection on dev, the campaign's runs. (The
ELECTRA adapter and the word-order rows: tests/unit/test_evaluation.py.)"""

from __future__ import annotations

import torch

from benchmarks import bench_sas_downstream as bd
from benchmarks.learning import downstream as dn
from benchmarks.learning.peers import Electra, Size


def test_sas_train_seconds_counts_each_windows_iterations(tmp_path):
    """The driver closes a train window at every log interval and every epoch's end; each
    record's elapsed_ms is its window's mean. Hand-derived: windows of 100, 25 (an epoch
    ended at 125), 75 and 100 iterations."""
    import json

    import pytest

    from megatron_taco.errors import ConfigError

    metrics = tmp_path / "metrics.jsonl"
    records = [(100, 10.0), (125, 20.0), (200, 12.0), (300, 11.0)]
    metrics.write_text("".join(json.dumps({"split": "train", "iteration": it, "elapsed_ms": ms})
                               + "\n" for it, ms in records)
                       + json.dumps({"split": "valid", "iteration": 200, "mlm_acc": 0.1}) + "\n")  # fmt: skip
    assert bd.sas_train_seconds(str(metrics), 300) == pytest.approx(
        (100 * 10 + 25 * 20 + 75 * 12 + 100 * 11) / 1e3, rel=1e-12
    )
    assert bd.sas_train_seconds(str(metrics), 200) == pytest.approx(2.4, rel=1e-12)
    with pytest.raises(ConfigError, match="only to iteration 300, not to the checkpoint's 400"):
        bd.sas_train_seconds(str(metrics), 400)


def test_bad_input_is_one_line(tmp_path, capsys):
    import pytest

    sas = tmp_path / "paper_s1"
    (sas / "checkpoints").mkdir(parents=True)
    electra = tmp_path / "electra_s1"
    electra.mkdir()
    common = ["--data-path", "x", "--split", "90,5,5", "--electra", str(electra)]

    def error(*argv: str) -> str:
        with pytest.raises(SystemExit) as e:
            bd.main([*common, *argv])
        assert e.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
        return line

    # No metrics.jsonl in the SAS run: its training seconds cannot be read.
    assert "holding checkpoints/ and metrics.jsonl" in error("--sas", f"paper={sas}")
    (sas / "metrics.jsonl").write_text("")
    assert "--sas nope=" in error("--sas", f"nope={sas}")
    assert "SAS variant" in error("--sas", f"taco={sas}")  # not read as a SAS
    assert "--seeds must be >= 1, got 0" in error("--sas", f"paper={sas}", "--seeds", "0")
    assert "no metrics.jsonl" in error("--sas", f"paper={sas}")
    (electra / "metrics.jsonl").write_text(
        '{"split": "valid", "iteration": 5, "train_seconds": 1}\n'
    )
    assert "no peer_iter_*.pt" in error("--sas", f"paper={sas}")
    assert "--ft-seeds must be >= 1, got 0" in error("--sas", f"paper={sas}", "--ft-seeds", "0")
    assert "--ft-lrs must all be > 0" in error("--sas", f"paper={sas}", "--ft-lrs", "1e-4", "0")


def test_select_lr_takes_the_best_mean_not_the_best_median():
    """The SAS paper reports the configuration whose mean over seeds is best. Hand-derived:
    1e-4 has mean 0.70 and median 0.80, 3e-4 mean 0.75 and median 0.75, so the mean picks
    3e-4 where a median would pick 1e-4; of a tie in the mean, the first listed."""

    assert dn.select_lr({1e-4: [0.5, 0.8, 0.8], 3e-4: [0.75, 0.75, 0.75]}) == 3e-4
    assert dn.select_lr({1e-3: [0.6, 0.8], 1e-4: [0.7, 0.7], 3e-4: [0.5, 0.9]}) == 1e-3


def test_nearest_picks_electras_evaluation_at_sas_flops():
    """ELECTRA evaluated at iterations 250, 500, 750 at 2 FLOPs per iteration: SAS at 1100
    FLOPs is nearest 500's 1000 (off 100, 750's is off 400); at 1250 the two are off 250
    each and the first, 500, is kept."""

    points = [(250, 10.0, "a"), (500, 20.0, "b"), (750, 30.0, "c")]
    assert bd.nearest(points, lambda q: 2 * q[0], 1100)[2] == "b"
    assert bd.nearest(points, lambda q: 2 * q[0], 1250)[2] == "b"
    assert bd.nearest(points, lambda q: q[1], 29.0)[2] == "c"


def test_classifiers_start_from_the_pretrained_encoders():
    """The fine-tuning models hold the pretrained encoders unchanged: ELECTRA's classifier
    gives the discriminator's own last layer, our TaskModel the pretraining model's; each
    returns its cross entropy on the [CLS] logits, and with pooling "mean" on the head
    applied to the mean of the real tokens' vectors (padding left out)."""
    from megatron_taco.evaluation.encoders import OurEncoder
    from tests.helpers import VOCAB, build_sas, make_sas_batch, tiny_sas_config

    torch.manual_seed(0)
    net = Electra(60, Size(1, 32, 2, 64, max_positions=16), embedding=16).double().eval()
    ids = torch.randint(5, 60, (3, 10))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[2, 7:] = False
    labels = torch.tensor([0, 1, 1])
    # Another seed than the discriminator's: built alike, a seed-0 classifier would start
    # from its weights even without the copy.
    model, step = dn.classifier(dn.peer_encoder(net), seed=5)
    model.double().eval()
    with torch.no_grad():
        want = net.disc.electra(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        got = model.base(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        loss, logits = step(ids, mask, labels)
        ce = torch.nn.functional.cross_entropy(logits, labels)
        torch.testing.assert_close(loss, ce, rtol=1e-12, atol=0)
        assert logits.shape == (3, 2)

    pre = build_sas(tiny_sas_config(), seed=1).double().eval()
    model, step = dn.classifier(OurEncoder(pre, "SAS"), seed=0)
    model.double().eval()
    batch = make_sas_batch(3, vocab=VOCAB)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        torch.testing.assert_close(model.encode(ids, mask), pre.sas(ids, mask), rtol=1e-12, atol=0)
        loss, logits = step(ids, mask, labels)
        ce = torch.nn.functional.cross_entropy(logits, labels)
        torch.testing.assert_close(loss.double(), ce.double(), rtol=1e-12, atol=0)

    mean_model, mean_step = dn.classifier(OurEncoder(pre, "SAS"), seed=0, pooling="mean")
    mean_model.double().eval()
    with torch.no_grad():
        hidden = pre.sas(ids, mask)
        m = mask[..., None].double()
        pooled = (hidden * m).sum(1) / m.sum(1)
        want = mean_model.head(pooled)
        loss, logits = mean_step(ids, mask, labels)
        torch.testing.assert_close(logits, want, rtol=1e-12, atol=0)
        # Not the [CLS] logits of the same head.
        assert not torch.allclose(logits, mean_model.head(hidden[:, 0]))

    model, step = dn.classifier(dn.peer_encoder(net), seed=5, pooling="mean")
    model.double().eval()
    ids, mask = torch.randint(5, 60, (3, 10)), torch.ones(3, 10, dtype=torch.bool)
    mask[2, 7:] = False
    with torch.no_grad():
        hidden = net.disc.electra(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        m = mask[..., None].double()
        _, logits = step(ids, mask, labels)
        torch.testing.assert_close(logits, model.head((hidden * m).sum(1) / m.sum(1)),
                                   rtol=1e-12, atol=0)  # fmt: skip


def test_taco_and_bert_classifiers_start_from_their_pretrained_encoders():
    """TACO (our TaskModel; its vectors [h_WE; h_PE] at true positions) and its peer BERT
    (PeerClassifier over a copy of BertForMaskedLM's BertModel) fine-tune from their
    pretrained encoders, under [CLS] and mean pooling; the copy leaves the peer alone."""
    from benchmarks.learning.peers import BertMlm
    from megatron_taco.evaluation.encoders import OurEncoder
    from tests.helpers import VOCAB, build, tiny_config

    ids = torch.randint(5, VOCAB, (3, 10))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[2, 7:] = False
    labels = torch.tensor([0, 1, 1])
    pre = build(tiny_config(), seed=1).double().eval()
    enc = OurEncoder(pre, "TACO")
    for pooling in dn.POOLINGS:
        model, step = dn.classifier(enc, seed=0, pooling=pooling)
        model.double().eval()
        with torch.no_grad():
            want = enc.hidden(ids, mask, torch.arange(10).expand(3, 10))
            torch.testing.assert_close(model.encode(ids, mask), want, rtol=1e-12, atol=0)
            _, logits = step(ids, mask, labels)
            pooled = dn.pool(want, mask, pooling)
            torch.testing.assert_close(logits.double(), model.head(pooled), rtol=1e-12, atol=0)

    torch.manual_seed(0)
    net = BertMlm(60, Size(1, 32, 2, 64, max_positions=16)).double().eval()
    ids = ids % 60
    with torch.no_grad():
        want = net.bert.bert(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    for pooling, pooled in (("cls", want[:, 0]), ("mean", dn.pool(want, mask, "mean"))):
        model, step = dn.classifier(dn.peer_encoder(net), seed=5, pooling=pooling)
        model.double().eval()
        with torch.no_grad():
            _, logits = step(ids, mask, labels)
            torch.testing.assert_close(logits, model.head(pooled), rtol=1e-12, atol=0)
    with torch.no_grad():
        model.base.encoder.layer[0].output.dense.weight.add_(1.0)
        again = net.bert.bert(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        torch.testing.assert_close(again, want, rtol=0, atol=0)


def _setting(**kw):
    from benchmarks.learning.setting import Setting

    base = dict(prefix="p", tokenizer="t", cache="c", seq_length=16, batch=4, iters=10,
                lr=1e-3, warmup_fraction=0.1, eval_interval=5, eval_iters=1, split="90,5,5",
                seed=1, layers=1, hidden=32)  # fmt: skip
    return Setting(**{**base, **kw})


def test_campaign_reads_a_taco_run_as_taco_and_a_misfit_peer_in_one_line(tmp_path, monkeypatch):
    """A TACO run's encoder and its random twins are TACO's (its [h_WE; h_PE] vectors); a
    BERT whose weights do not fit --layers/--hidden is a ConfigError naming the file."""
    import pytest

    from benchmarks.learning import campaign
    from benchmarks.learning.peers import BertMlm
    from megatron_taco.errors import ConfigError
    from tests.helpers import build, tiny_config

    pre = build(tiny_config(), seed=1).eval()
    info = type("Info", (), {"iteration": 10})()
    monkeypatch.setattr(campaign, "twins", lambda *a, **k: (info, pre, [pre]))
    run = campaign.Run("taco", None, 1, str(tmp_path))
    enc, it, flops = campaign.load(run, _setting(), 1000)
    assert enc.kind == "TACO" and enc.we_width == pre.config.we_hidden_size and it == 10
    (twin,) = campaign.random_twins("taco", [run], _setting(), 1000, 1)
    assert twin.kind == "TACO"

    folder = tmp_path / "bert_s1"
    folder.mkdir()
    torch.save(BertMlm(60, _setting().size()).state_dict(), folder / "peer_iter_0000010.pt")
    enc, it, _ = campaign.load(campaign.Run("bert", None, 1, str(folder)), _setting(), 60)
    assert enc.kind == "BERT" and it == 10
    with pytest.raises(ConfigError, match="peer_iter_0000010.pt is not a bert of --layers 2"):
        campaign.load(campaign.Run("bert", None, 1, str(folder)), _setting(layers=2), 60)


def test_each_variant_is_paired_with_its_own_peer():
    """Hand-derived: SAS's row against ELECTRA's, TACO's against BERT's, over the seeds both
    have (TACO's third seed has no BERT twin: two seeds, no p-value); the peers and random
    rows are not paired."""
    from benchmarks.learning.campaign import paired

    def row(variant, model, scores, lr=1e-3):
        return {"variant": variant, "model": model, "lr": lr,
                "by_seed": {s: {"probe_32": v} for s, v in scores.items()}}  # fmt: skip

    rows = [
        row("paper", "sas", {1: 0.60, 2: 0.70, 3: 0.65}),
        row("electra", "electra", {1: 0.50, 2: 0.55, 3: 0.60}),
        row("taco", "taco", {1: 0.80, 2: 0.90, 3: 0.99}),
        row("bert", "bert", {1: 0.70, 2: 0.60}, lr=None),  # a campaign without a grid
        row("taco random x2", "taco", {0: 0.5}, lr=None),
    ]
    paired(rows)
    sas, electra, taco, bert, randoms = rows
    assert sas["peer"] == "electra" and taco["peer"] == "bert"
    got = sas["vs_peer"]["probe_32"]
    assert abs(got["diff"] - 0.1) < 1e-12 and got["seeds"] == [1, 2, 3]
    # diffs 0.10, 0.15, 0.05: mean 0.1, sd 0.05, t = 0.1 / (0.05 / sqrt 3) = 3.464, df 2
    assert abs(got["p"] - 0.0742) < 1e-3
    got = taco["vs_peer"]["probe_32"]
    assert abs(got["diff"] - 0.2) < 1e-12 and got["seeds"] == [1, 2] and got["p"] is None
    assert all("vs_peer" not in r for r in (electra, bert, randoms))


def test_select_and_test_chooses_lr_and_epoch_on_dev_and_reports_test():
    """Hand-derived: lr 1e-4's dev means by epoch are 0.60, 0.70, 0.65; 7.5e-5's 0.55, 0.72,
    0.60: the best mean (0.72) is 7.5e-5 at epoch 2, whose test accuracies (0.50, 0.70) are
    reported, mean 0.60, though 1e-4 has the best test figure (0.90)."""
    runs = {
        1e-4: [{"dev": [0.6, 0.7, 0.6], "test": [0.9, 0.9, 0.9], "loss": [0.7, 0.6, 0.5]},
               {"dev": [0.6, 0.7, 0.7], "test": [0.9, 0.9, 0.9], "loss": [0.7, 0.6, 0.5]}],
        7.5e-5: [{"dev": [0.5, 0.74, 0.6], "test": [0.1, 0.5, 0.1], "loss": [0.7, 0.4, 0.5]},
                 {"dev": [0.6, 0.70, 0.6], "test": [0.1, 0.7, 0.1], "loss": [0.7, 0.2, 0.5]}],
    }  # fmt: skip
    got = dn.select_and_test(runs)
    assert (got["lr"], got["epoch"]) == (7.5e-5, 2)
    assert abs(got["dev"] - 0.72) < 1e-12 and abs(got["test"] - 0.60) < 1e-12
    assert got["test_by_seed"] == [0.5, 0.7] and abs(got["train_loss"] - 0.3) < 1e-12


def test_campaign_finds_the_runs_that_ended_by_variant_lr_and_seed(tmp_path):
    from benchmarks.learning.campaign import Run, discover

    (tmp_path / "mlm_lambda_small_lr0.001_s1234" / "checkpoints").mkdir(parents=True)
    (tmp_path / "electra_lr0.0005_s1235").mkdir()
    (tmp_path / "electra_lr0.0005_s1235" / "peer_iter_0001909.pt").write_bytes(b"")
    (tmp_path / "paper_s1234" / "checkpoints").mkdir(parents=True)
    (tmp_path / "paper_s1236").mkdir()  # did not end: no checkpoint
    (tmp_path / "electra_s7").mkdir()  # did not end: no weights
    (tmp_path / "bert_lr0.001_s1234").mkdir()
    (tmp_path / "bert_lr0.001_s1234" / "peer_iter_0000800.pt").write_bytes(b"")
    (tmp_path / "taco_lr0.001_s1234" / "checkpoints").mkdir(parents=True)
    (tmp_path / "nonsense_s1" / "checkpoints").mkdir(parents=True)  # not a variant
    runs = discover(str(tmp_path))
    assert sorted((r.variant, r.lr, r.seed) for r in runs) == [
        ("bert", 1e-3, 1234),
        ("electra", 5e-4, 1235),
        ("mlm_lambda_small", 1e-3, 1234),
        ("paper", None, 1234),
        ("taco", 1e-3, 1234),
    ]
    assert {r.variant: r.kind for r in runs if r.model not in dn.PEERS} == {
        "mlm_lambda_small": "SAS", "paper": "SAS", "taco": "TACO"}  # fmt: skip
    assert all(isinstance(r, Run) for r in runs)
    assert [r.variant for r in discover(str(tmp_path), ["paper"])] == ["paper"]

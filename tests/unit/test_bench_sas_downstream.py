"""benchmarks/bench_sas_downstream.py reads transformers' ELECTRA as demo_evaluate reads
ours: its adapter must give what the peer's own training forward computes."""

from __future__ import annotations

import sys

import torch

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "examples"))


def test_electra_adapter_is_the_peers_own_heads():
    import bench_sas_downstream as bd
    from learning_peers import Electra, Size

    torch.manual_seed(0)

    net = Electra(60, Size(1, 32, 2, 64, max_positions=16), embedding=16).double().eval()
    ids = torch.randint(5, 60, (3, 10))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[2, 7:] = False
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    labels[1, 5] = ids[1, 5]
    masked = ids.masked_fill(labels != -100, 4)
    enc = bd.ElectraEncoder(net)
    # The generator's MLM loss as the peer trains it (rows doubled: it reads the first half).
    twice = {"input_ids": masked.repeat(2, 1), "attention_mask": mask.repeat(2, 1),
             "mlm_labels": labels.repeat(2, 1)}  # fmt: skip
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


def test_sas_train_seconds_counts_each_windows_iterations(tmp_path):
    """The driver closes a train window at every log interval and every epoch's end; each
    record's elapsed_ms is its window's mean. Hand-derived: windows of 100, 25 (an epoch
    ended at 125), 75 and 100 iterations."""
    import json

    import bench_sas_downstream as bd
    import pytest

    from megatron_taco.arguments import ConfigError

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
    import bench_sas_downstream as bd
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
    assert "--seeds must be >= 1, got 0" in error("--sas", f"paper={sas}", "--seeds", "0")
    assert "no metrics.jsonl" in error("--sas", f"paper={sas}")
    (electra / "metrics.jsonl").write_text(
        '{"split": "valid", "iteration": 5, "train_seconds": 1}\n'
    )
    assert "no peer_iter_*.pt" in error("--sas", f"paper={sas}")

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

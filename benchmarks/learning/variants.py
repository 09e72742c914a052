"""The variants that bench_sas_variants trains (SAS's: the paper's recipe, the reference
release's cold starts, the named departures and their pairs, SAS^c, SAS^DA; our TACO; the
peers), each model's peer, and each model's training FLOPs per iteration, by which the
campaigns and bench_sas_downstream match them."""

from __future__ import annotations

import dataclasses

from benchmarks.learning.setting import Setting

LAMBDA_SMALL = ("--rtd-weight", "1", "--rtd-weight-final", "4")  # the paper's x 0.02
LAMBDA_ZERO = ("--rtd-weight", "0", "--rtd-weight-final", "0")
GDES = ("--gradient-disentangled-embedding",)
MASK_SHARE = ("--stored-mask-share", "0.8")

# name -> (model, cold start, extra flags, what it is). "{warmup}" is half the run.
VARIANTS = {
    "paper": ("sas", "unigram", (), "the paper: unigram cold start, lambda 50 -> 200"),
    "uniform": ("sas", "uniform", (), "the paper's Table 4 alternative cold start"),
    "mask": ("sas", "mask", (), "release: [MASK] at S in epoch 1"),
    "mlm": ("sas", "mlm", (), "release: BERT's MLM in epoch 1, no RTD loss"),
    "gdes": ("sas", "unigram", GDES, "departure: RTD kept out of the word embedding"),
    "rtd_warmup": ("sas", "unigram", ("--rtd-weight-warmup-iters", "{warmup}"),
                   "departure: lambda 0 for the first half"),
    "rate30": ("sas", "unigram", ("--mask-prob", "0.3"), "departure: 30% replaced"),
    "lambda_small": ("sas", "unigram", LAMBDA_SMALL, "departure: lambda 1 -> 4"),
    "mask_share": ("sas", "unigram", MASK_SHARE, "departure: 80% of S [MASK] from epoch 2"),
    "mlm_gdes": ("sas", "mlm", GDES, "release mlm + GDES"),
    "mlm_warmup": ("sas", "mlm", ("--rtd-weight-warmup-iters", "{warmup}"),
                   "release mlm + lambda 0 for the first half"),
    "mlm_rate30": ("sas", "mlm", ("--mask-prob", "0.3"), "release mlm + 30% replaced"),
    "mlm_lambda_small": ("sas", "mlm", LAMBDA_SMALL, "release mlm + lambda 1 -> 4"),
    "mlm_lambda0": ("sas", "mlm", LAMBDA_ZERO, "release mlm + no RTD loss: MLM on own samples"),
    "mlm_mask_share": ("sas", "mlm", (*MASK_SHARE, *LAMBDA_SMALL),
                       "release mlm + 80% of S [MASK] later + lambda 1 -> 4"),
    "mlm_gdes_lambda_small": ("sas", "mlm", (*GDES, *LAMBDA_SMALL),
                              "release mlm + GDES + lambda 1 -> 4"),
    "bert_control": ("sas", "mlm", ("--stored-mask-share", "1", *LAMBDA_ZERO),
                     "control: every epoch [MASK] at S, no RTD (BERT in SAS's code)"),
    "sas_c": ("sas_c", "unigram", (), "SAS^c: the paper's recipe with a constant lambda 50"),
    "sas_da": ("sas_da", "unigram", (), "SAS^DA: the paper's recipe with DeBERTa's attention"),
    "sas_c_mlm_lambda_small": ("sas_c", "mlm", ("--rtd-weight", "1", "--rtd-weight-final", "1"),
                               "SAS^c: release mlm + constant lambda 1"),
    "sas_da_mlm_lambda_small": ("sas_da", "mlm", LAMBDA_SMALL,
                                "SAS^DA: release mlm + lambda 1 -> 4"),
    "electra": ("electra", "unigram", (), "transformers' ELECTRA (generator 1/4 wide)"),
    "bert": ("bert", "unigram", (), "transformers' BERT ([MASK] MLM)"),
    "taco": ("taco", "unigram", (), "our TACO (TACO-small's widths; SpanBERT MLM + MPM)"),
}  # fmt: skip

# Each of our models' peer (the method it replaces), judged beside it at equal FLOPs; the
# peers are transformers' models that benchmarks/learning/peer_loop.py trains.
PEER_OF = {"sas": "electra", "sas_c": "electra", "sas_da": "electra", "taco": "bert"}
PEERS = ("electra", "bert")


def flops_reference(models) -> str:
    """The model whose FLOPs at --iters are an --equal-flops campaign's budget: TACO where
    the campaign trains it (TACO against BERT), else SAS."""
    return "taco" if "taco" in models else "sas"


def train_flops_per_iteration(
    model: str, s: Setting, vocab: int, taco_flags: tuple[str, ...] = ()
) -> float:
    """ELECTRA's convention (tools/count_flops.py) for one iteration of ``s.batch`` rows;
    ``taco_flags``: our TACO's size flags beyond its preset (bench_learning --taco-flags)."""
    from megatron_taco.models import flops

    size = s.size()
    shape = flops.EncoderShape(
        layers=size.layers, hidden=size.hidden, ffn=size.ffn, heads=size.heads,
        head_size=size.hidden // size.heads, embedding_size=size.hidden, vocab_size=vocab,
        seq_length=s.seq_length,
    )  # fmt: skip
    if model == "electra":
        disc = dataclasses.replace(shape, embedding_size=size.hidden // 2)
        return flops.electra_train_flops(disc, flops.generator_shape(disc), s.batch, 1)
    if model == "bert":
        return flops.bert_train_flops(shape, s.batch, 1)
    if model == "taco":  # our TACO's widths as the driver reads them; MLM and MPM rows
        import argparse

        from benchmarks.learning.setting import OURS
        from megatron_taco.models.taco.config import TacoConfig

        parser = argparse.ArgumentParser(add_help=False)
        TacoConfig.add_args(parser)
        known, _ = parser.parse_known_args([*OURS["taco"][1], *taco_flags])
        config = TacoConfig.from_args(known, vocab_size=vocab)
        return flops.taco_electra_train_flops(config, s.seq_length, s.batch, 1)
    return flops.sas_train_flops(shape, s.batch, 1, disentangled_attention=model == "sas_da")

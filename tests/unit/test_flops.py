"""FLOPs counters: the SAS paper's Tables 1-2 in the ELECTRA convention, and TACO's
throughput FLOPs with separate value head sizes.

Configs are plain test dataclasses with TacoConfig's attribute names: the counters are
duck-typed, and the TACO config module is being moved.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from megatron_taco.models.flops import (
    EncoderShape,
    bert_train_flops,
    binary_head_flops,
    block_flops,
    disentangled_attention_flops,
    electra_train_flops,
    generator_shape,
    input_embedding_flops,
    output_softmax_flops,
    relative_buckets_used,
    sas_encoder_shape,
    sas_train_flops,
    sas_train_flops_executed,
    taco_electra_train_flops,
    taco_forward_flops,
    taco_train_flops,
    value_channels,
)

# SAS paper, Table 5: small models at batch 512 x 250k steps, seq 128; base at batch 256, seq 512.
SMALL = EncoderShape(
    layers=12, hidden=256, ffn=1024, heads=4, head_size=64, embedding_size=256, seq_length=128
)
ELECTRA_SMALL = dataclasses.replace(SMALL, embedding_size=128)
BASE = EncoderShape(
    layers=12, hidden=768, ffn=3072, heads=12, head_size=64, embedding_size=768, seq_length=512
)
BATCH, STEPS = 512, 250_000


# ---------------------------------------------------------------------------------------
# The papers' numbers


def _electra_small() -> float:
    gen = EncoderShape(
        layers=12, hidden=64, ffn=256, heads=1, head_size=64, embedding_size=128, seq_length=128
    )
    return electra_train_flops(ELECTRA_SMALL, gen, BATCH, STEPS)


def _electra_small_pp() -> float:
    # ELECTRA-Small++: seq 512, 4M steps at batch 128 (only batch x steps matters).
    disc = dataclasses.replace(ELECTRA_SMALL, seq_length=512)
    return electra_train_flops(disc, generator_shape(disc), 128, 4_000_000)


# (model, FLOPs, the string the paper prints): Table 1 (small) and Table 2 (base).
PRINTED = [
    ("BERT-Small", lambda: bert_train_flops(SMALL, BATCH, STEPS), "1.274e+18"),
    ("BERT-Small-1.5x", lambda: bert_train_flops(SMALL, BATCH, 375_000), "1.911e+18"),
    ("ELECTRA-Small", _electra_small, "1.294e+18"),
    ("ELECTRA-Small++", _electra_small_pp, "2.403e+19"),
    ("SAS-Small", lambda: sas_train_flops(SMALL, BATCH, STEPS), "1.279e+18"),
    ("BERT-Base", lambda: bert_train_flops(BASE, 256, 1_000_000), "6.430e+19"),
    (
        "ELECTRA-Base",
        lambda: electra_train_flops(BASE, generator_shape(BASE, divisor=3), 256, 766_000),
        "6.426e+19",
    ),
]


@pytest.mark.parametrize("name,flops,printed", PRINTED, ids=[p[0] for p in PRINTED])
def test_paper_tables_reproduced(name, flops, printed):
    value = flops()
    assert value == pytest.approx(float(printed), rel=0.01)
    # Per-element LayerNorm after attention (module doc) gives every printed digit.
    assert f"{value:.3e}" == printed


def test_sas_small_matches_the_leads_value():
    assert sas_train_flops(SMALL, BATCH, STEPS) == pytest.approx(1.278e18, rel=1e-3)


@pytest.mark.parametrize(
    "flops,paper",
    [
        (lambda: sas_train_flops(SMALL, BATCH, STEPS, disentangled_attention=True), 1.385e18),
        (lambda: sas_train_flops(BASE, 256, 833_000, disentangled_attention=True), 6.226e19),
        (
            lambda: (
                bert_train_flops(SMALL, BATCH, STEPS)
                + 2 * STEPS * disentangled_attention_flops(SMALL, BATCH)
            ),
            1.381e18,  # DeBERTa-Small
        ),
    ],
    ids=["SAS^DA-Small", "SAS^DA-Base", "DeBERTa-Small"],
)
def test_disentangled_models_close_to_paper(flops, paper):
    # The paper does not publish its DA terms; ours land ~0.15% below its numbers.
    assert flops() == pytest.approx(paper, rel=0.01)


def test_generator_shape_follows_electra():
    gen = generator_shape(ELECTRA_SMALL)
    assert (gen.hidden, gen.ffn, gen.heads, gen.head_size, gen.layers) == (64, 256, 1, 64, 12)
    assert gen.embedding_size == 128
    assert EncoderShape.electra(768, 12) == BASE


# ---------------------------------------------------------------------------------------
# Structure of the ELECTRA convention


def _forward_per_token(shape: EncoderShape, frac: float) -> float:
    return (
        shape.layers * block_flops(shape)
        + input_embedding_flops(shape)
        + output_softmax_flops(shape, frac)
    )


def test_train_is_twice_forward():
    s = SMALL.seq_length
    assert bert_train_flops(SMALL, 3, 7) == pytest.approx(
        2 * 7 * 3 * s * _forward_per_token(SMALL, 0.15625)
    )
    sas = _forward_per_token(SMALL, 0.15625) + binary_head_flops(SMALL)
    assert sas_train_flops(SMALL, 3, 7) == pytest.approx(2 * 7 * 3 * s * sas)


def test_output_softmax_scales_with_output_frac():
    h, e, v = 256, 128, 30522
    shape = dataclasses.replace(SMALL, hidden=h, embedding_size=e, vocab_size=v)
    one_token = 2 * h * e + e + 8 * e + 5 * e + 2 * e * v + 5 * v + 2 * v
    assert output_softmax_flops(shape, 1.0) == one_token
    assert output_softmax_flops(shape, 0.3) == pytest.approx(0.3 * one_token)
    tokens = 2 * 10 * 4 * SMALL.seq_length
    gap = bert_train_flops(shape, 4, 10, output_frac=0.5) - bert_train_flops(shape, 4, 10, 0.0)
    assert gap == pytest.approx(tokens * 0.5 * one_token)


def test_block_counts_one_layer_by_hand():
    h, i, s, heads = 256, 1024, 128, 4
    attention = 6 * h * h + 3 * h + 2 * h * s + 10 * s * heads + 2 * h * s
    attention += 2 * h * h + h + 4 * h + h + 5 * h
    ffn = 2 * h * i + i + 8 * i + 2 * i * h + h + 4 * h + h + 5 * h
    assert block_flops(SMALL) == attention + ffn


def _da_extra_by_hand(shape: EncoderShape, batch: int, k: int) -> float:
    # Per layer: c2p + p2c (each 2 * s * 2k * head_size per head per sequence), scale + add
    # of the two gathered maps (4 per score), and per step the 2k rows' dropout and their
    # projection by the shared W_Q, W_K with bias; once per step the rows' LayerNorm.
    s, h, d, heads, rows = shape.seq_length, shape.hidden, shape.head_size, shape.heads, 2 * k
    per_sequence = heads * (2 * (2 * s * rows * d) + 4 * s * s)
    per_step = 4 * rows * h + 2 * (2 * rows * h * heads * d + rows * heads * d)
    return shape.layers * (batch * per_sequence + per_step) + 5 * rows * h


@pytest.mark.parametrize("k", [None, 64, 256])
def test_disentangled_attention_difference(k):
    plain = sas_train_flops(SMALL, BATCH, STEPS)
    da = sas_train_flops(SMALL, BATCH, STEPS, disentangled_attention=True, relative_span=k)
    span = SMALL.seq_length if k is None else k
    assert da > plain
    assert da - plain == pytest.approx(2 * STEPS * _da_extra_by_hand(SMALL, BATCH, span))


def test_monotonic_in_layers_and_sequence():
    gen = generator_shape(ELECTRA_SMALL)
    for field, lo, hi in (("layers", 6, 12), ("seq_length", 64, 128)):
        a, b = dataclasses.replace(SMALL, **{field: lo}), dataclasses.replace(SMALL, **{field: hi})
        assert bert_train_flops(a, 8, 10) < bert_train_flops(b, 8, 10)
        assert sas_train_flops(a, 8, 10, True) < sas_train_flops(b, 8, 10, True)
        ga, gb = dataclasses.replace(gen, **{field: lo}), dataclasses.replace(gen, **{field: hi})
        assert electra_train_flops(a, ga, 8, 10) < electra_train_flops(b, gb, 8, 10)


def test_electra_tied_embeddings_use_discriminator_size():
    gen = dataclasses.replace(generator_shape(ELECTRA_SMALL), embedding_size=64)
    tied = electra_train_flops(ELECTRA_SMALL, gen, 8, 10, tied_embeddings=True)
    untied = electra_train_flops(ELECTRA_SMALL, gen, 8, 10, tied_embeddings=False)
    as_128 = dataclasses.replace(gen, embedding_size=128)
    assert tied == electra_train_flops(ELECTRA_SMALL, as_128, 8, 10, tied_embeddings=False)
    assert untied < tied  # e = h = 64: no projection, a narrower decoder


# ---------------------------------------------------------------------------------------
# TACO


@dataclass(frozen=True)
class FakeTaco:
    """TacoConfig's attribute names, base sizes (Table 7); no value-channel fields."""

    num_layers: int = 12
    we_hidden_size: int = 648
    pe_hidden_size: int = 120
    we_attention_heads: int = 12
    pe_attention_heads: int = 6
    kv_channels: int = 64
    we_ffn_hidden_size: int = 2592
    pe_ffn_hidden_size: int = 480
    relative_embedding_size: int = 768
    max_relative_distance: int = 511
    max_position_embeddings: int = 512
    vocab_size: int = 30522

    @property
    def conv_out_channels(self) -> int:
        return self.we_attention_heads + self.pe_attention_heads

    def conv_in_channels(self, first_layer: bool) -> int:
        base = 3 * self.we_attention_heads + self.pe_attention_heads
        return base if first_layer else base + self.conv_out_channels


@dataclass(frozen=True)
class FakeTacoWithValues(FakeTaco):
    we_value_channels: int | None = None
    pe_value_channels: int | None = None


TINY = FakeTaco(
    num_layers=2,
    we_hidden_size=48,
    pe_hidden_size=16,
    we_attention_heads=4,
    pe_attention_heads=2,
    kv_channels=8,
    we_ffn_hidden_size=96,
    pe_ffn_hidden_size=40,
    relative_embedding_size=24,
    max_relative_distance=63,
    max_position_embeddings=64,
    vocab_size=100,
)


def _taco_forward_by_parameters(c, s: int, rows: int, frac: float, dv_we: int, dv_pe: int):
    # Matmul FLOPs = 2 x (weight elements) per token, plus the pair products; written from
    # the weight shapes rather than the module's grouping.
    L, d = c.num_layers, c.kv_channels
    dw, dp, hw, hp = c.we_hidden_size, c.pe_hidden_size, c.we_attention_heads, c.pe_attention_heads
    weights = (
        dw * (hw * d) * 2 + dw * (hw * dv_we) + (hw * dv_we) * dw
        + dp * (hp * d) * 2 + dp * (hp * dv_pe) + (hp * dv_pe) * dp
        + 2 * dw * c.we_ffn_hidden_size + 2 * dp * c.pe_ffn_hidden_size
    )  # fmt: skip
    n = 2 * min(s - 1, c.max_relative_distance) + 2
    pairs = s * s * (hw * d + hp * d + hw * dv_we + hp * dv_pe) + 2 * hw * s * n * d
    c_out = hw + hp
    conv_weights = c_out * (3 * hw + hp) + (L - 1) * c_out * (3 * hw + hp + c_out)
    relative = L * n * c.relative_embedding_size * 2 * hw * d
    heads = (
        frac
        * s
        * rows
        / 2
        * ((dw + dp) * dw + dw * c.vocab_size + (dw + dp) * dp + dp * c.max_position_embeddings)
    )
    return 2.0 * (rows * s * L * weights + rows * L * pairs + rows * s * s * conv_weights
                  + relative + heads)  # fmt: skip


# taco_forward_flops(base, 128, rows=4, labelled_fraction=0.15) and the tiny preset at seq 16,
# from the formula before value head sizes existed (values as wide as keys).
BEFORE_VALUES = [(FakeTaco(), 128, 88348612608.0), (TINY, 16, 6149120.0)]


@pytest.mark.parametrize("config,s,before", BEFORE_VALUES, ids=["base", "tiny"])
def test_taco_throughput_unchanged_with_key_sized_values(config, s, before):
    d = config.kv_channels
    explicit = FakeTacoWithValues(
        **dataclasses.asdict(config), we_value_channels=d, pe_value_channels=d
    )
    assert _taco_forward_by_parameters(config, s, 4, 0.15, d, d) == pytest.approx(before)
    for c in (config, explicit):
        assert taco_forward_flops(c, s, 4, 0.15) == pytest.approx(before)
        assert taco_train_flops(c, s, 4, 0.15) == pytest.approx(3 * before)


def test_taco_throughput_with_other_value_sizes():
    base = FakeTaco()
    s, rows, d = 128, 4, base.kv_channels
    cfg = FakeTacoWithValues(**dataclasses.asdict(base), we_value_channels=54, pe_value_channels=20)
    got = taco_forward_flops(cfg, s, rows, 0.15)
    assert got == pytest.approx(_taco_forward_by_parameters(base, s, rows, 0.15, 54, 20))
    # Narrower values: V, W^O and the weighted values shrink, and nothing else moves.
    dw, dp, hw, hp, L = 648, 120, 12, 6, 12
    saved = (
        2
        * rows
        * L
        * (
            s * (2 * dw * hw * (d - 54) + 2 * dp * hp * (d - 20))
            + s * s * (hw * (d - 54) + hp * (d - 20))
        )
    )
    assert taco_forward_flops(base, s, rows, 0.15) - got == pytest.approx(saved)


def test_value_channels_resolution():
    assert value_channels(FakeTaco()) == (64, 64)
    # None means hidden / heads, as TacoConfig documents it.
    assert value_channels(FakeTacoWithValues()) == (54, 20)
    assert value_channels(FakeTacoWithValues(we_value_channels=32, pe_value_channels=16)) == (
        32,
        16,
    )

    @dataclass(frozen=True)
    class Resolved(FakeTacoWithValues):
        @property
        def we_value_size(self) -> int:
            return 7

        @property
        def pe_value_size(self) -> int:
            return 5

    assert value_channels(Resolved()) == (7, 5)


def test_taco_electra_linear_in_steps_affine_in_batch():
    f = taco_electra_train_flops
    assert f(TINY, 16, 4, 20) == pytest.approx(20 * f(TINY, 16, 4, 1))
    # Per-step terms (relative rows) make it affine, not linear, in the batch.
    one, two, three = (f(TINY, 16, b, 1) for b in (1, 2, 3))
    assert three - two == pytest.approx(two - one)
    assert two < 2 * one


def test_taco_electra_heads_term():
    c, s, frac = TINY, 16, 0.25
    hidden, dw, dp, v, p = 64, 48, 16, c.vocab_size, c.max_position_embeddings
    mlm = 2 * hidden * dw + dw + 8 * dw + 5 * dw + 2 * dw * v + 5 * v + 2 * v
    mpm = 2 * hidden * dp + dp + 8 * dp + 5 * dp + 2 * dp * p + 5 * p + 2 * p
    gap = taco_electra_train_flops(c, s, 3, 5, frac) - taco_electra_train_flops(c, s, 3, 5, 0.0)
    assert gap == pytest.approx(2 * 5 * 3 * frac * s * (mlm + mpm))


def test_taco_electra_value_channels():
    base = FakeTacoWithValues(**dataclasses.asdict(TINY), we_value_channels=8, pe_value_channels=8)
    wider = dataclasses.replace(base, we_value_channels=10)
    s, b, steps, dw, hw, L = 16, 3, 5, 48, 4, 2
    # Per token per layer: V projection (+ bias) and W^O grow by 2 columns per WE head, and
    # the weighted values by 2 * s * 2 per head.
    per_token = 2 * dw * hw * 2 + hw * 2 + 2 * hw * 2 * dw + 2 * s * hw * 2
    gap = taco_electra_train_flops(wider, s, b, steps) - taco_electra_train_flops(base, s, b, steps)
    assert gap == pytest.approx(2 * steps * b * 2 * s * L * per_token)
    assert taco_electra_train_flops(base, s, b, steps) == taco_electra_train_flops(
        TINY, s, b, steps
    )


def test_taco_electra_conv_per_pair():
    @dataclass(frozen=True)
    class OneMoreChannel(FakeTaco):
        def conv_in_channels(self, first_layer: bool) -> int:
            return super().conv_in_channels(first_layer) + 1

    wider = OneMoreChannel(**dataclasses.asdict(TINY))
    s, b, steps, c_out, L = 16, 3, 5, 6, 2
    gap = taco_electra_train_flops(wider, s, b, steps) - taco_electra_train_flops(TINY, s, b, steps)
    # 2 * C_in * C_out per (i, j) pair: one more input channel adds 2 * C_out per pair.
    assert gap == pytest.approx(2 * steps * b * 2 * L * s * s * 2 * c_out)


def test_taco_electra_monotonic_and_against_throughput():
    for field, lo, hi in (("num_layers", 6, 12), ("max_relative_distance", 31, 127)):
        a, b = (dataclasses.replace(FakeTaco(), **{field: x}) for x in (lo, hi))
        assert taco_electra_train_flops(a, 128, 8, 1) < taco_electra_train_flops(b, 128, 8, 1)
    c = FakeTaco()
    assert taco_electra_train_flops(c, 64, 8, 1) < taco_electra_train_flops(c, 128, 8, 1)
    assert relative_buckets_used(c, 128) == 256
    # Same matmuls, but ELECTRA takes 2x forward (not 3x), adds element-wise work and counts
    # the input lookups as dense matmuls; without those lookups only element-wise is left.
    s, samples = 128, 8
    electra = taco_electra_train_flops(c, s, samples, 1)
    lookups = 2 * samples * 2 * s * (2 * 648 * 30522 + 2 * 120 * (s + 1))
    matmuls = taco_train_flops(c, s, 2 * samples, 0.15625) * 2 / 3
    assert 1.0 < (electra - lookups) / matmuls < 1.05


def test_taco_electra_needs_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        taco_electra_train_flops(dataclasses.replace(TINY, vocab_size=0), 16, 1, 1)


# ---------------------------------------------------------------------------------------
# Model FLOPs against what runs: torch's FlopCounterMode over a real forward + backward


def _inplace_gemm(self, a, b, *args, out_shape=None, **kwargs) -> int:
    # FlopCounterMode counts addmm and baddbmm but not their in-place forms, which the
    # relative-attention backward and TACO's 1x1 conv use: 2 per multiply-add, as for mm/bmm.
    return 2 * math.prod(a) * b[-1]


def _counted(model, batch) -> tuple[float, dict[str, int]]:
    """(FLOPs of forward + backward, the forward's FLOPs by op)."""
    from torch.utils.flop_counter import FlopCounterMode

    inplace = {torch.ops.aten.addmm_: _inplace_gemm, torch.ops.aten.baddbmm_: _inplace_gemm}
    with FlopCounterMode(display=False, custom_mapping=inplace) as forward:
        loss = model(batch)["loss"]
    with FlopCounterMode(display=False, custom_mapping=inplace) as backward:
        loss.backward()
    by_op = {str(op): n for op, n in forward.get_flop_counts()["Global"].items()}
    return forward.get_total_flops() + backward.get_total_flops(), by_op


@pytest.mark.parametrize("disentangled", [False, True], ids=["SAS", "SAS^DA"])
def test_sas_model_flops_match_flop_counter(disentangled):
    """Every matmul of a SAS / SAS^DA step: the count is exact (the embedding lookup is a
    gather; the MLM decoder over the padded vocabulary on the labelled tokens only)."""
    from tests.helpers import build_sas, make_sas_batch, tiny_sas_config

    config = tiny_sas_config(disentangled_attention=disentangled)
    model, s = build_sas(config), 64
    batch = make_sas_batch(b=4, s=s)
    padded = model.sas.embeddings.word_embeddings.weight.shape[0]
    shape = dataclasses.replace(sas_encoder_shape(config, s), vocab_size=padded)
    labelled = int((batch["mlm_labels"] != -100).sum())
    rows = model.sas.relative_rows_used(s)
    assert (rows > 0) == disentangled
    want = sas_train_flops_executed(shape, 4, labelled, relative_rows=rows)
    assert want == pytest.approx(_counted(model, batch)[0], rel=1e-12)


@pytest.mark.parametrize("shape,ratio", [(SMALL, 1.70), (BASE, 1.25)], ids=["small", "base"])
def test_electra_convention_overstates_what_runs(shape, ratio):
    """What SAS's TFLOP/s used to be: ELECTRA's count x 1.5 (its backward = forward made 3x),
    which counts the word lookup as a one-hot matmul over the vocabulary: 1.70x what SAS-small
    runs, 1.25x for SAS-base. The paper's tables keep ELECTRA's convention."""
    executed = sas_train_flops_executed(shape, 1, 0.15 * (shape.seq_length - 2))
    assert 1.5 * sas_train_flops(shape, 1, 1) / executed == pytest.approx(ratio, abs=0.005)


def test_taco_model_flops_match_flop_counter():
    """TACO's count against what runs, less the content and position maps its backward
    recomputes instead of saving (recompute is overhead, not model FLOPs): within 0.1%, the
    heads' labelled tokens entering as one average share of both rows."""
    from tests.helpers import build, make_batch, tiny_config

    config = tiny_config()
    model, s, b = build(config), 64, 4
    batch = make_batch(b=b, s=s)
    measured, forward = _counted(model, batch)
    recomputed = forward["aten.baddbmm"]  # _dot_maps: the only baddbmm of the forward
    labelled = int((batch["mlm_labels"] != -100).sum() + (batch["mpm_labels"] != -100).sum())
    vocab = model.taco.embeddings.word_embeddings.weight.shape[0]
    want = taco_train_flops(config, s, 2 * b, labelled / (2 * b * s), vocab_size=vocab)
    assert want == pytest.approx(measured - recomputed, rel=1e-3)


@pytest.mark.parametrize("task_kind", ["classification", "regression", "span", "multiple_choice"])
@pytest.mark.parametrize("encoder", ["TACO", "SAS", "SAS^DA"])
def test_finetune_model_flops_match_flop_counter(encoder, task_kind):
    """The encoder without its pretraining heads plus the task head, exactly (TACO less its
    recomputed maps, as above)."""
    from tests.helpers import FINETUNE_HEADS, finetune_model

    model, s, b = finetune_model(encoder, task_kind).train(), 40, 3
    choices = FINETUNE_HEADS[task_kind] if task_kind == "multiple_choice" else None
    shape = (b, choices, s) if choices else (b, s)
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(5, 90, shape, generator=g),
        "attention_mask": torch.ones(shape, dtype=torch.bool),
    }
    if task_kind == "span":
        batch["start_positions"] = batch["end_positions"] = torch.tensor([1, 2, 3])
    elif task_kind == "regression":
        batch["labels"] = torch.rand(b, dtype=torch.float64)
    else:
        batch["labels"] = torch.tensor([0, 1, 0])
    measured, forward = _counted(model, batch)
    measured -= forward.get("aten.baddbmm", 0) if encoder == "TACO" else 0
    rows = b * (choices or 1)
    assert model.train_flops(rows, s) == pytest.approx(measured, rel=1e-9)

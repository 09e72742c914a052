import argparse
import dataclasses
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from megatron_taco.errors import ConfigError
from megatron_taco.models.sas.config import PRESETS, SasConfig
from megatron_taco.models.sas.model import SasForPretraining, rtd_labels
from megatron_taco.parallel.random import MODEL_PARALLEL_RNG, model_parallel_seed
from megatron_taco.parallel.state import ParallelState, single_process_state
from megatron_taco.training.configure import build_parser, configs_from_args
from tests.helpers import (
    SAS_METRIC_KEYS,
    SAS_SEQ,
    VOCAB,
    build_sas,
    make_sas_batch,
    normal_std_pvalue,
    tiny_sas_config,
)

VARIANTS = {"sas": {}, "sas_da": {"disentangled_attention": True}}


def _cfg(variant: str, **overrides) -> SasConfig:
    return tiny_sas_config(**VARIANTS[variant], **overrides)


# ---------------------------------------------------------------------------------------
# Config


def test_presets_are_table5():
    small, base = SasConfig.preset("small"), SasConfig.preset("base")
    sizes = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
    assert [getattr(small, f) for f in sizes] == [12, 256, 1024, 4]
    assert [getattr(base, f) for f in sizes] == [12, 768, 3072, 12]
    assert (small.embedding_size, base.embedding_size) == (256, 768)
    assert small.head_size == base.head_size == 64
    assert small.max_position_embeddings == base.max_position_embeddings == 512
    assert SasConfig() == dataclasses.replace(base, model_size=None)
    assert base.norm_epsilon == 1e-12 and base.init_method_std == 0.02
    assert base.hidden_dropout == base.attention_dropout == 0.1
    for name in PRESETS:
        SasConfig.preset(name).validate_parallel(2)


def test_derived_properties():
    c = SasConfig()
    assert c.uses_position_embeddings and c.relative_table_size == 0
    da = SasConfig(disentangled_attention=True)
    assert not da.uses_position_embeddings  # DeBERTa-v2/v3 default
    assert da.position_biased_input is None  # resolved in the property, never mutated
    assert (da.relative_positions, da.relative_span, da.relative_table_size) == (512, 256, 512)
    clipped = SasConfig(disentangled_attention=True, position_buckets=0, max_relative_positions=128)
    assert (clipped.relative_span, clipped.relative_table_size) == (128, 256)
    assert SasConfig(
        disentangled_attention=True, position_biased_input=True
    ).uses_position_embeddings
    assert not SasConfig(
        disentangled_attention=True, position_biased_input=False
    ).uses_position_embeddings
    tiny = tiny_sas_config()
    assert tiny.embedding_size != tiny.hidden_size and tiny.head_size == 12


def _parse(argv):
    parser = argparse.ArgumentParser()
    SasConfig.add_args(parser)
    return SasConfig.from_args(parser.parse_args(argv))


def test_flags():
    c = _parse(["--model-size", "small", "--disentangled-attention", "--num-layers", "3"])
    assert c.model_size == "small" and c.num_layers == 3 and c.hidden_size == 256
    assert c.disentangled_attention and c.position_biased_input is None
    assert not c.uses_position_embeddings
    c = _parse(["--disentangled-attention", "--position-biased-input", "--position-buckets", "0"])
    assert c.uses_position_embeddings and c.relative_span == 512
    assert not _parse(
        ["--disentangled-attention", "--no-position-biased-input"]
    ).uses_position_embeddings
    assert _parse([]) == SasConfig()


def test_layernorm_epsilon_follows_the_variant():
    # SAS^DA follows DeBERTa (transformers' DebertaV2Config), SAS/SAS^c BERT and ELECTRA.
    from transformers import DebertaV2Config, ElectraConfig

    assert SasConfig(disentangled_attention=True).norm_epsilon == DebertaV2Config().layer_norm_eps
    assert SasConfig().norm_epsilon == ElectraConfig().layer_norm_eps == 1e-12
    assert SasConfig(disentangled_attention=True, layernorm_epsilon=1e-5).norm_epsilon == 1e-5
    assert _parse(["--disentangled-attention"]).layernorm_epsilon is None  # resolved, not stored
    model = build_sas(tiny_sas_config(disentangled_attention=True))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and {m.eps for m in norms} == {1e-7}
    norms = [m for m in build_sas(tiny_sas_config()).modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and {m.eps for m in norms} == {1e-12}


def test_order_blind_encoder_is_a_config_error():
    with pytest.raises(ConfigError, match="--position-biased-input: without --disentangled"):
        SasConfig(position_biased_input=False)
    with pytest.raises(ConfigError, match="order-blind"):
        _parse(["--model-size", "small", "--no-position-biased-input"])
    assert not SasConfig(
        disentangled_attention=True, position_biased_input=False
    ).uses_position_embeddings


def _output_projections(model):
    layers = model.sas.layers
    return [layer.attention.dense.weight for layer in layers] + [
        layer.mlp.fc2.weight for layer in layers
    ]


def _input_projections(model):
    layers = model.sas.layers
    return [layer.attention.qkv.weight for layer in layers] + [
        layer.mlp.fc1.weight for layer in layers
    ]


def test_output_layer_init_megatron_or_electra():
    """Megatron's scaled init (std / sqrt(2L)) by default, ELECTRA's normal(std) on request,
    each checked with a chi-square test of the weights' variance; transformers' own ELECTRA
    init passes the ELECTRA test and fails Megatron's."""
    from transformers import ElectraConfig, ElectraModel

    sizes = dict(num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4)
    scaled = 0.02 / math.sqrt(2 * 4)
    for init, std in (("megatron", scaled), ("electra", 0.02)):
        config = tiny_sas_config(**sizes, output_layer_init=init)
        assert config.output_layer_std == pytest.approx(std)
        model = build_sas(config, seed=3)
        out = torch.cat([w.flatten() for w in _output_projections(model)])  # 4 * 2 * 65536
        assert normal_std_pvalue(out, std) > 1e-3, init
        other = 0.02 if init == "megatron" else scaled
        assert normal_std_pvalue(out, other) < 1e-12, init
        inputs = torch.cat([w.flatten() for w in _input_projections(model)])
        assert normal_std_pvalue(inputs, 0.02) > 1e-3, init
    torch.manual_seed(3)
    electra = ElectraModel(
        ElectraConfig(
            vocab_size=VOCAB, embedding_size=32, hidden_size=128, num_hidden_layers=4,
            num_attention_heads=4, intermediate_size=512,
        )
    )  # fmt: skip
    reference = torch.cat(
        [layer.attention.output.dense.weight.flatten() for layer in electra.encoder.layer]
        + [layer.output.dense.weight.flatten() for layer in electra.encoder.layer]
    )
    assert normal_std_pvalue(reference, 0.02) > 1e-3
    assert normal_std_pvalue(reference, scaled) < 1e-12
    with pytest.raises(ConfigError, match="--output-layer-init"):
        SasConfig(output_layer_init="xavier")


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"num_layers": 0}, "--num-layers"),
        ({"hidden_size": -4}, "--hidden-size"),
        ({"ffn_hidden_size": 0}, "--ffn-hidden-size"),
        ({"embedding_size": 0}, "--embedding-size"),
        ({"num_attention_heads": 5}, "--num-attention-heads"),  # 768 % 5
        ({"max_position_embeddings": 0}, "--max-position-embeddings"),
        ({"position_buckets": -1}, "--position-buckets"),
        ({"position_buckets": 1}, "--position-buckets"),
        ({"position_buckets": 256, "max_relative_positions": 129}, "--max-relative-positions"),
        ({"max_relative_positions": 0}, "--max-relative-positions"),
        ({"hidden_dropout": 1.0}, "--hidden-dropout"),
        ({"attention_dropout": -0.1}, "--attention-dropout"),
        ({"layernorm_epsilon": 0.0}, "--layernorm-epsilon"),
        ({"init_method_std": 0.0}, "--init-method-std"),
        ({"model_size": "huge"}, "--model-size"),
    ],
)
def test_invalid_values_name_the_flag(overrides, flag):
    with pytest.raises(ConfigError, match=flag):
        SasConfig(**overrides)


@pytest.mark.parametrize(
    "overrides, tp, flag",
    [({}, 5, "--num-attention-heads"), ({"ffn_hidden_size": 3070}, 4, "--ffn-hidden-size")],
)
def test_validate_parallel_names_the_flag(overrides, tp, flag):
    with pytest.raises(ConfigError, match=flag) as err:
        SasConfig(**overrides).validate_parallel(tp)
    assert "--tensor-model-parallel-size" in str(err.value)


def test_model_needs_the_vocabulary_and_a_tracker_for_tp():
    with pytest.raises(ConfigError, match="--vocab-size"):
        SasForPretraining(SasConfig.preset("tiny"), single_process_state())
    with pytest.raises(ValueError, match="rng_tracker"):
        # Rank 0 of a tp=2 layout; the check fires before any collective.
        tp2 = ParallelState(world_size=2, rank=0, tp_size=2, tp_group=None, dp_group=None)
        SasForPretraining(tiny_sas_config(), tp2)


# ---------------------------------------------------------------------------------------
# Forward / outputs


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_and_outputs(variant):
    cfg = _cfg(variant)
    model = build_sas(cfg)
    batch = make_sas_batch()
    hidden = model.sas(batch["input_ids"], batch["attention_mask"])
    assert hidden.shape == (2, SAS_SEQ, cfg.hidden_size)
    out = model(batch)
    assert set(out) == {*SAS_METRIC_KEYS, "mlm_logits", "mlm_positions"}
    n = (batch["mlm_labels"] != -100).sum().item()
    assert out["mlm_tokens"].item() == n
    assert out["rtd_tokens"].item() == batch["attention_mask"].sum().item()
    assert out["mlm_tokens"].dtype == out["rtd_tokens"].dtype == torch.int64
    assert out["mlm_logits"].shape == (n, 128) and out["mlm_logits"].dtype == torch.float32
    for key in SAS_METRIC_KEYS:
        assert out[key].dim() == 0 and torch.isfinite(out[key]), key
    for key in ("mlm_acc", "rtd_acc", "rtd_acc_replaced", "rtd_acc_original", "replaced_share"):
        assert not out[key].requires_grad and 0 <= out[key].item() <= 1, key
    assert not out["mlm_logits"].requires_grad
    # Untrained: MLM near uniform over the vocabulary, RTD near log 2.
    assert abs(out["mlm_loss"].item() - math.log(VOCAB)) < 1.0
    assert abs(out["rtd_loss"].item() - math.log(2)) < 0.1


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parameter_gets_a_gradient(variant):
    # position_biased_input on for SAS^DA too, so the absolute table is covered.
    model = build_sas(_cfg(variant, position_biased_input=True))
    model(make_sas_batch())["loss"].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_overfits_one_batch(variant):
    torch.manual_seed(0)
    model = build_sas(_cfg(variant, hidden_dropout=0.0, attention_dropout=0.0))
    model.set_rtd_weight(1.0)
    batch = make_sas_batch(seed=5)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(50):
        opt.zero_grad()
        out = model(batch)
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert losses[-1] < 0.1 * losses[0], losses[::10]
    assert out["mlm_acc"].item() == 1.0 and out["rtd_acc"].item() == 1.0


def test_loss_combines_with_the_rtd_weight():
    model = build_sas(tiny_sas_config())
    batch = make_sas_batch()
    assert model.rtd_weight == 50.0
    model.set_rtd_weight(7.5)
    out = model(batch)
    assert out["rtd_weight"].item() == 7.5
    assert out["loss"].item() == (out["mlm_loss"] + 7.5 * out["rtd_loss"]).item()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="RTD loss weight"):
            model.set_rtd_weight(bad)


def test_rtd_labels_and_accuracy_splits_on_a_hand_built_batch():
    #            CLS  a  b  c  d  e  PAD PAD
    original = torch.tensor([[2, 10, 11, 12, 13, 14, 0, 0]])
    ids = torch.tensor([[2, 10, 30, 12, 31, 14, 0, 0]])  # S = {2, 3, 4}; 3 is a hit
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    mlm = torch.full_like(ids, -100)
    mlm[0, [2, 3, 4]] = original[0, [2, 3, 4]]
    labels = rtd_labels(ids, mlm, mask)
    assert labels.tolist() == [[0, 0, 1, 0, 1, 0, -100, -100]]  # the hit is "original"

    model = build_sas(tiny_sas_config(hidden_dropout=0.0, attention_dropout=0.0)).eval()
    batch = dict(input_ids=ids, attention_mask=mask, mlm_labels=mlm, rtd_labels=labels)
    out = model(batch)
    with torch.no_grad():
        logits = model.heads.rtd_logits(model.sas(ids, mask))[0, :6]
    pred = (logits > 0).long()
    target = labels[0, :6]
    correct = (pred == target).float()
    assert out["rtd_acc"].item() == pytest.approx(correct.mean().item())
    assert out["rtd_acc_replaced"].item() == pytest.approx(correct[target == 1].mean().item())
    assert out["rtd_acc_original"].item() == pytest.approx(correct[target == 0].mean().item())
    assert out["replaced_share"].item() == pytest.approx(1 / 3)
    assert (out["mlm_tokens"].item(), out["rtd_tokens"].item()) == (3, 6)
    expected = F.binary_cross_entropy_with_logits(logits, target.float())
    assert out["rtd_loss"].item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_gets_no_rtd_loss(variant):
    model = build_sas(_cfg(variant, hidden_dropout=0.0, attention_dropout=0.0)).eval()
    batch = make_sas_batch(b=3)
    real = batch["attention_mask"]
    with torch.no_grad():
        out = model(batch)
        logits = model.heads.rtd_logits(model.sas(batch["input_ids"], real))
        expected = F.binary_cross_entropy_with_logits(
            logits[real], batch["rtd_labels"][real].float()
        )
        assert out["rtd_loss"].item() == pytest.approx(expected.item(), rel=1e-6)
        # Whatever sits in the padded columns changes nothing.
        noisy = dict(batch, input_ids=batch["input_ids"].masked_fill(~real, 7))
        torch.testing.assert_close(model(noisy)["rtd_loss"], out["rtd_loss"])
        torch.testing.assert_close(model(noisy)["mlm_loss"], out["mlm_loss"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_mlm_logits_rows_are_the_replaced_positions(variant):
    model = build_sas(_cfg(variant, hidden_dropout=0.0, attention_dropout=0.0)).eval()
    batch = make_sas_batch(b=3, seed=4)
    with torch.no_grad():
        out = model(batch)
        hidden = model.sas(batch["input_ids"], batch["attention_mask"]).flatten(0, 1)
        word = model.sas.embeddings.word_embeddings.weight
    flat_labels = batch["mlm_labels"].reshape(-1)
    positions = out["mlm_positions"]
    assert positions.tolist() == (flat_labels != -100).nonzero().squeeze(1).tolist()
    rows = model.heads.mlm_logits(hidden[positions], word)
    torch.testing.assert_close(out["mlm_logits"], rows)
    loss = F.cross_entropy(out["mlm_logits"][:, :VOCAB], flat_labels[positions])
    assert out["mlm_loss"].item() == pytest.approx(loss.item(), rel=1e-6)
    row, col = positions // SAS_SEQ, positions % SAS_SEQ
    assert torch.equal(batch["mlm_labels"][row, col], flat_labels[positions])


@pytest.mark.parametrize("variant", VARIANTS)
def test_batches_without_labels_give_no_nan(variant):
    model = build_sas(_cfg(variant))
    batch = make_sas_batch()
    no_s = dict(batch, mlm_labels=torch.full_like(batch["mlm_labels"], -100))
    no_s["rtd_labels"] = rtd_labels(no_s["input_ids"], no_s["mlm_labels"], batch["attention_mask"])
    out = model(no_s)
    assert out["mlm_tokens"].item() == 0 and out["mlm_loss"].item() == 0.0
    assert out["mlm_logits"].shape == (0, 128) and out["replaced_share"].item() == 0.0
    assert out["rtd_acc_replaced"].item() == 0.0  # no replaced token: 0, not NaN
    out["loss"].backward()
    empty = {k: v[:0] for k, v in batch.items()}
    padded = dict(batch, attention_mask=torch.zeros_like(batch["attention_mask"]))
    padded["rtd_labels"] = torch.full_like(batch["rtd_labels"], -100)
    for b in (empty, padded):
        out = model(b)
        for key in SAS_METRIC_KEYS:
            assert torch.isfinite(out[key]), key
        assert out["rtd_tokens"].item() == 0 and out["rtd_loss"].item() == 0.0
        out["loss"].backward()


def _relative_close(a: dict, b: dict, rtol: float) -> None:
    for name, x in a.items():
        tol = rtol * max(x.abs().max().item(), 1e-30)
        assert (b[name] - x).abs().max().item() <= tol, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_recompute_gives_identical_loss_and_gradients(variant):
    results = []
    for recompute in (False, True):
        tracker = model_parallel_seed(
            11, single_process_state(), device="cpu"
        )  # also seeds the default RNG
        cfg = _cfg(variant, recompute_activations=recompute, hidden_dropout=0.2)
        model = SasForPretraining(cfg, single_process_state(), tracker).double()
        out = model(make_sas_batch(b=3, seed=2))
        out["loss"].backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((out["loss"].item(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-12)
    _relative_close(grads_a, grads_b, rtol=1e-10)
    # Dropout is really on: another seed gives another loss.
    tracker = model_parallel_seed(12, single_process_state(), device="cpu")
    model = SasForPretraining(_cfg(variant, hidden_dropout=0.2), single_process_state(), tracker)
    assert model.double()(make_sas_batch(b=3, seed=2))["loss"].item() != pytest.approx(loss_a)


def test_relative_rows_in_use_are_compact():
    model = build_sas(_cfg("sas_da"))
    lo, hi, index, index_t = model.sas.relative_index(SAS_SEQ, torch.device("cpu"))
    # 24 tokens, 16 buckets (mid 8, log range to 64): |delta| <= 23 buckets to
    # ceil(log(23/8) / log(63/8) * 7) + 8 = 12, i.e. rows 16 - 12 .. 16 + 12 of 32.
    assert (lo, hi) == (4, 28)
    assert index.min().item() == 0 and index.max().item() == hi - lo
    assert torch.equal(index_t, index.transpose(1, 2))
    assert model.sas.relative_index(SAS_SEQ, torch.device("cpu"))[2] is index  # cached


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "pair_mask"])
def test_relative_bias_backward_matches_autograd(masked):
    from megatron_taco.models.common.relative import deberta_relative_index
    from megatron_taco.models.sas.model import relative_bias

    h, b, s, d, span = 2, 2, 5, 3, 4
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(h, b, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    q_r, k_r = (torch.randn(h, 2 * span, d, generator=g, dtype=torch.float64) for _ in range(2))
    index = deberta_relative_index(s, span, 0, span)
    index_t = index.transpose(1, 2).contiguous()
    pad = torch.tensor([[False] * s, [False] * (s - 2) + [True] * 2])
    mask = (pad[:, :, None] | pad[:, None, :]).unsqueeze(0) if masked else None
    inputs = tuple(t.requires_grad_() for t in (q, k, q_r, k_r))

    def fn(q, k, q_r, k_r):
        return relative_bias(q, k, q_r, k_r, index, index_t, 0.5, mask)

    assert torch.autograd.gradcheck(fn, inputs)
    # DeBERTa's relative terms: q_i.K_r[idx(i, j)] + k_j.Q_r[idx(i, j)] (SDPA adds c2c).
    i = index[0]
    want = torch.einsum("hbid,hijd->hbij", q, k_r[:, i])
    want = 0.5 * (want + torch.einsum("hbjd,hijd->hbij", k, q_r[:, i]))
    if masked:
        want = want.masked_fill(mask, torch.finfo(want.dtype).min)
    torch.testing.assert_close(fn(*inputs), want)


def test_attention_dropout_is_drawn_inside_sdpa_from_the_tracker_stream():
    """SDPA's dropout runs under the tracker's fork: the layer equals a hand-written
    attention whose mask is drawn from the tracker stream, not from the default one (each
    tp rank must drop different elements of its heads)."""
    cfg = _cfg("sas", attention_dropout=0.3)
    parallel = single_process_state()
    tracker = model_parallel_seed(5, parallel, device="cpu")
    attention = SasForPretraining(cfg, parallel, tracker).double().sas.layers[0].attention
    b, s, h, d = 2, SAS_SEQ, attention.heads, attention.d
    x = torch.randn(b, s, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator())
    stream = tracker.get_states()
    default = torch.get_rng_state()
    out = attention(x, None)
    # The default stream is left untouched by the attention dropout.
    assert torch.equal(torch.get_rng_state(), default)

    def by_hand(rng_state):
        q, k, v = attention.qkv(x).view(b, s, h, 3 * d).transpose(1, 2).split(d, dim=-1)
        probs = torch.softmax(q @ k.transpose(-1, -2) * attention.scale, dim=-1)
        torch.set_rng_state(rng_state)
        probs = F.dropout(probs, cfg.attention_dropout)  # the same bernoulli draw as SDPA's
        return attention.dense((probs @ v).transpose(1, 2).reshape(b, s, h * d))

    torch.testing.assert_close(out, by_hand(stream[MODEL_PARALLEL_RNG]), rtol=1e-12, atol=0)
    assert not torch.allclose(out, by_hand(default))


# ---------------------------------------------------------------------------------------
# Departures from the paper (off by default)


def test_gradient_disentangled_embedding_keeps_the_rtd_loss_out_of_the_word_embedding():
    """GDES: with E_delta = 0 the model computes what SAS computes; the RTD loss's gradient
    reaches E_delta and never E; E's gradient is the tied decoder's alone, and E's plus
    E_delta's is what plain SAS gives E (float64, exact up to summation order)."""
    no_dropout = dict(hidden_dropout=0.0, attention_dropout=0.0)
    plain = build_sas(tiny_sas_config(**no_dropout)).double()
    gdes = build_sas(tiny_sas_config(gradient_disentangled_embedding=True, **no_dropout)).double()
    result = gdes.load_state_dict(plain.state_dict(), strict=False)
    assert result.missing_keys == ["sas.embeddings.word_embeddings_delta.weight"]
    delta = gdes.sas.embeddings.word_embeddings_delta.weight
    assert (delta == 0).all()
    batch = make_sas_batch()
    word = {m: m.sas.embeddings.word_embeddings.weight for m in (plain, gdes)}

    out_plain, out_gdes = plain(batch), gdes(batch)
    assert out_gdes["loss"].item() == out_plain["loss"].item()
    out_gdes["rtd_loss"].backward(retain_graph=True)
    assert word[gdes].grad is None or not word[gdes].grad.any()
    assert delta.grad.abs().sum() > 0
    out_plain["rtd_loss"].backward(retain_graph=True)
    torch.testing.assert_close(delta.grad, word[plain].grad, rtol=1e-12, atol=1e-15)

    for model in (plain, gdes):
        model.zero_grad(set_to_none=True)
    out_plain["mlm_loss"].backward()
    out_gdes["mlm_loss"].backward()
    assert word[gdes].grad.abs().sum() > 0  # through the tied decoder
    torch.testing.assert_close(
        word[gdes].grad + delta.grad, word[plain].grad, rtol=1e-12, atol=1e-15
    )


class _Log:
    def __init__(self):
        self.lines = []

    def print(self, line):
        self.lines.append(line)


def test_rtd_weight_warmup_is_zero_for_the_first_iterations_then_the_schedule():
    from types import SimpleNamespace

    from megatron_taco.recipes.sas import RtdScheduleConfig, RtdWeightSchedule

    model = build_sas(tiny_sas_config())
    config = RtdScheduleConfig(rtd_weight_warmup_iters=3)
    trainer = SimpleNamespace(logger=_Log(), num_epochs=lambda: 3)
    schedule = RtdWeightSchedule(model, config, whole_epochs=3)
    state = SimpleNamespace(iteration=0)
    schedule.on_epoch_start(trainer, state, 0)
    assert trainer.logger.lines == [" epoch 1/3: lambda 50 (0 until iteration 3)"]
    seen = []
    for it in range(6):
        state.iteration = it
        if it == 4:  # a new epoch: its own lambda, still after the warm-up
            schedule.on_epoch_start(trainer, state, 1)
        schedule.on_step_start(trainer, state)
        seen.append(model(make_sas_batch())["rtd_weight"].item())
    assert seen == [0.0, 0.0, 0.0, 50.0, 125.0, 125.0]
    assert "0 for the first 3 iterations" in config.describe(Fraction(3))
    # Off (the paper): the schedule from the first iteration.
    plain = RtdWeightSchedule(model, RtdScheduleConfig(), whole_epochs=3)
    plain.on_epoch_start(trainer, state, 0)
    state.iteration = 0
    plain.on_step_start(trainer, state)
    assert model.rtd_weight == 50.0
    with pytest.raises(ConfigError, match="--rtd-weight-warmup-iters"):
        RtdScheduleConfig(rtd_weight_warmup_iters=-1)


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--cold-start", "mlm", "--no-self-augmentation"), r"^--cold-start mlm: .*every epoch"),
        (("--cold-start", "mask", "--no-self-augmentation"), r"^--cold-start mask: .*every epoch"),
        (("--stored-mask-share", "0.5", "--no-self-augmentation"), r"^--stored-mask-share: "),
        (("--rtd-weight-warmup-iters", "4"), r"^--rtd-weight-warmup-iters: 4 >= --train-iters 4"),
    ],
)
def test_departures_that_would_train_something_else_are_refused_in_one_line(
    botchan_dataset, tmp_path, flags, message
):
    """Before any process group: a masked cold start or --stored-mask-share with no store
    to read (every epoch masked / nothing masked), a lambda warm-up as long as the run."""
    from megatron_taco.cli.pretrain_sas import SPEC

    def configs(*extra):
        argv = ["--model-size", "tiny", "--seq-length", "64",
                "--data-path", botchan_dataset["prefix"],
                "--tokenizer-model", botchan_dataset["tokenizer"], "--micro-batch-size", "2",
                "--global-batch-size", "2", "--train-iters", "4", "--cold-start", "uniform",
                "--save", str(tmp_path / "s"), *extra]  # fmt: skip
        return configs_from_args(
            SPEC, build_parser(SPEC).parse_args(argv), world_size=1, device_type="cpu"
        )

    with pytest.raises(ConfigError, match=message):
        configs(*flags)
    assert not torch.distributed.is_initialized()
    configs("--rtd-weight-warmup-iters", "3")  # a shorter warm-up is fine
    configs("--cold-start", "mlm", "--stored-mask-share", "0.5")  # both read the store

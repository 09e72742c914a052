"""With the same weights, SAS equals transformers' ELECTRA and SAS^DA its DeBERTa-v2.

Everything runs in float64 with every parameter randomised (LayerNorm weights and all biases
included, so a swapped weight/bias or a missing bias shows), on a batch with padding;
real tokens are compared. Encoder and RTD head: relative tolerance 1e-10 of the largest
value. MLM logits: our head returns float32 logits by design, so 1e-6.
"""

import os

import pytest
import torch

from megatron_taco.models.sas import model as sas_model
from megatron_taco.models.sas.hf import deberta_v2_config_and_state, electra_config_and_state
from tests.helpers import VOCAB, build_sas, make_sas_batch, tiny_sas_config

transformers = pytest.importorskip("transformers")

ENCODER_RTOL = 1e-10
MLM_RTOL = 1e-6


def _randomised(config, seed: int = 0):
    model = build_sas(config, seed).double().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _batch():
    batch = make_sas_batch(b=3, seed=3)
    assert not batch["attention_mask"].all()  # padding is part of the comparison
    return batch


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, rtol: float, what: str) -> None:
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= rtol * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def _ours(model, batch):
    with torch.no_grad():
        out = model(batch)
        hidden = model.sas(batch["input_ids"], batch["attention_mask"])
        rtd = model.heads.rtd_logits(hidden)
    return hidden, rtd, out


def _mlm_rows(hf_logits: torch.Tensor, out: dict) -> torch.Tensor:
    # The reference's logits [b, s, V] at our rows (mlm_positions index b*s).
    return hf_logits.reshape(-1, VOCAB)[out["mlm_positions"]]


def _electra(kwargs, state, cls):
    config = transformers.ElectraConfig(**kwargs, attn_implementation="eager")
    model = cls(config).double().eval()
    result = model.load_state_dict(state, strict=False)
    assert not result.missing_keys, result.missing_keys
    return model, set(result.unexpected_keys)


def _deberta(kwargs, state, cls):
    model = cls(transformers.DebertaV2Config(**kwargs)).double().eval()
    result = model.load_state_dict(state, strict=False)
    assert not result.missing_keys, result.missing_keys
    return model, set(result.unexpected_keys)


# ---------------------------------------------------------------------------------------
# SAS == ELECTRA


ELECTRA_CASES = {
    "embedding_32_hidden_48": {},
    "embedding_equals_hidden": {"embedding_size": 48},
    # GDES: the input reads E + E_delta, the decoder E: exported untied.
    "gradient_disentangled_embedding": {"gradient_disentangled_embedding": True},
}


@pytest.mark.parametrize("overrides", ELECTRA_CASES.values(), ids=ELECTRA_CASES)
def test_sas_equals_electra(overrides):
    config = tiny_sas_config(**overrides)
    model, batch = _randomised(config), _batch()
    hidden, rtd, out = _ours(model, batch)
    kwargs, state = electra_config_and_state(config, model.state_dict())
    real = batch["attention_mask"]
    inputs = dict(input_ids=batch["input_ids"], attention_mask=real.long())

    disc, unexpected = _electra(kwargs, state, transformers.ElectraForPreTraining)
    assert unexpected == {k for k in state if k.startswith("generator_")}
    with torch.no_grad():
        ref = disc(**inputs, output_hidden_states=True)
    _assert_close(hidden[real], ref.hidden_states[-1][real], ENCODER_RTOL, "hidden states")
    _assert_close(rtd[real], ref.logits[real], ENCODER_RTOL, "RTD logits")

    gen, unexpected = _electra(kwargs, state, transformers.ElectraForMaskedLM)
    assert unexpected == {k for k in state if k.startswith("discriminator_")}
    with torch.no_grad():
        ref_mlm = _mlm_rows(gen(**inputs).logits, out)
    _assert_close(out["mlm_logits"][:, :VOCAB].double(), ref_mlm, MLM_RTOL, "MLM logits")


def test_electra_mapping_mutation_is_caught():
    """Exchanging the query and key projections in the export must not match."""
    config = tiny_sas_config()
    model, batch = _randomised(config), _batch()
    hidden, _, _ = _ours(model, batch)
    kwargs, state = electra_config_and_state(config, model.state_dict())
    p = "electra.encoder.layer.1.attention.self."
    for t in ("weight", "bias"):
        state[p + "query." + t], state[p + "key." + t] = (
            state[p + "key." + t],
            state[p + "query." + t],
        )
    disc, _ = _electra(kwargs, state, transformers.ElectraForPreTraining)
    real = batch["attention_mask"]
    with torch.no_grad():
        ref = disc(batch["input_ids"], attention_mask=real.long(), output_hidden_states=True)
    with pytest.raises(AssertionError, match="hidden states"):
        _assert_close(
            hidden[real], ref.hidden_states[-1][real], 1e3 * ENCODER_RTOL, "hidden states"
        )


# ---------------------------------------------------------------------------------------
# SAS^DA == DeBERTa-v2


DEBERTA_CASES = {
    "buckets16_no_abs_pos_embedding32": {},
    "abs_positions_biased_input": {"position_biased_input": True},
    "clipped_at_10_embedding_equals_hidden": {
        "position_buckets": 0,
        "max_relative_positions": 10,
        "embedding_size": 48,
    },
    "gradient_disentangled_embedding": {"gradient_disentangled_embedding": True},
}


def _deberta_models(config, model):
    """DebertaV2Model, DebertaV2ForMaskedLM and (ELECTRA's head class, as DeBERTa has no RTD
    head) the RTD head, loaded from the export of ``model``."""
    kwargs, state, rtd_state = deberta_v2_config_and_state(config, model.state_dict())
    # DebertaV2Model's own keys have no "deberta." prefix (from_pretrained strips it).
    encoder = {k.removeprefix("deberta."): v for k, v in state.items() if k.startswith("deberta.")}
    base, unexpected = _deberta(kwargs, encoder, transformers.DebertaV2Model)
    assert not unexpected
    mlm, unexpected = _deberta(kwargs, state, transformers.DebertaV2ForMaskedLM)
    assert not unexpected
    head_config = transformers.ElectraConfig(hidden_size=config.hidden_size, hidden_act="gelu")
    head = transformers.models.electra.modeling_electra.ElectraDiscriminatorPredictions(
        head_config
    ).double()
    head.load_state_dict(rtd_state, strict=True)
    return base, mlm, head


def _deberta_reference(config, model, batch):
    base, mlm, head = _deberta_models(config, model)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long())
    with torch.no_grad():
        hidden = base(**inputs).last_hidden_state
        return hidden, mlm(**inputs).logits, head(hidden)


@pytest.mark.parametrize("overrides", DEBERTA_CASES.values(), ids=DEBERTA_CASES)
def test_sas_da_equals_deberta_v2(overrides):
    config = tiny_sas_config(disentangled_attention=True, **overrides)
    model, batch = _randomised(config), _batch()
    hidden, rtd, out = _ours(model, batch)
    ref_hidden, ref_logits, ref_rtd = _deberta_reference(config, model, batch)
    real = batch["attention_mask"]
    _assert_close(hidden[real], ref_hidden[real], ENCODER_RTOL, "hidden states")
    # DeBERTa masks padded queries too (they attend uniformly): those rows agree as well.
    _assert_close(hidden, ref_hidden, ENCODER_RTOL, "hidden states incl. padding")
    _assert_close(rtd[real], ref_rtd[real], ENCODER_RTOL, "RTD logits")
    ref_mlm = _mlm_rows(ref_logits, out)
    _assert_close(out["mlm_logits"][:, :VOCAB].double(), ref_mlm, MLM_RTOL, "MLM logits")


def _swap_projections(q, k, q_r, k_r, index, index_t, scale, mask):
    # c2p against the query-projected rows and p2c against the key-projected ones.
    return _ORIGINAL_BIAS(q, k, k_r, q_r, index, index_t, scale, mask)


def _flip_direction(q, k, q_r, k_r, index, index_t, scale, mask):
    # Row of (i, j) taken from j - i instead of i - j.
    return _ORIGINAL_BIAS(q, k, q_r, k_r, index_t, index, scale, mask)


def _no_relative_bias(q, k, q_r, k_r, index, index_t, scale, mask):
    # SDPA gets only the padding mask: c2c alone, the c2p + p2c bias dropped.
    return _ORIGINAL_BIAS(q, k, 0 * q_r, 0 * k_r, index, index_t, scale, mask)


_ORIGINAL_BIAS = sas_model.relative_bias


@pytest.mark.parametrize("mutant", [_swap_projections, _flip_direction, _no_relative_bias])
def test_deberta_mutations_are_caught(monkeypatch, mutant):
    config = tiny_sas_config(disentangled_attention=True)
    model, batch = _randomised(config), _batch()
    ref_hidden, _, _ = _deberta_reference(config, model, batch)
    monkeypatch.setattr(sas_model, "relative_bias", mutant)
    hidden, _, _ = _ours(model, batch)
    real = batch["attention_mask"]
    with pytest.raises(AssertionError, match="hidden states"):
        _assert_close(hidden[real], ref_hidden[real], 1e3 * ENCODER_RTOL, "hidden states")


# ---------------------------------------------------------------------------------------
# Gradients (our hand-written disentangled backward included)


def _probe_loss(hidden, rtd, real, seed: int = 9):
    # A fixed random linear function of every real token's hidden state and RTD logit.
    g = torch.Generator().manual_seed(seed)
    w_hidden = torch.randn(hidden.shape, generator=g, dtype=hidden.dtype)
    w_rtd = torch.randn(rtd.shape, generator=g, dtype=rtd.dtype)
    return (w_hidden * hidden)[real].sum() + (w_rtd * rtd)[real].sum()


@pytest.mark.parametrize("disentangled", [False, True], ids=["electra", "deberta_v2"])
def test_gradients_equal_transformers(disentangled):
    config = tiny_sas_config(disentangled_attention=disentangled)
    model, batch = _randomised(config), _batch()
    ids, real = batch["input_ids"], batch["attention_mask"]
    hidden = model.sas(ids, real)
    _probe_loss(hidden, model.heads.rtd_logits(hidden), real).backward()
    # The export is a pure re-layout, so it maps our gradients to the reference's names.
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()
    }
    if disentangled:
        base, _, head = _deberta_models(config, model)
        ref_hidden = base(ids, attention_mask=real.long()).last_hidden_state
        _probe_loss(ref_hidden, head(ref_hidden), real).backward()
        _, want, want_rtd = deberta_v2_config_and_state(config, grads)
        got = {f"deberta.{n}": p.grad for n, p in base.named_parameters()}
        got |= {n: p.grad for n, p in head.named_parameters()}
        want |= want_rtd
    else:
        kwargs, state = electra_config_and_state(config, model.state_dict())
        disc, _ = _electra(kwargs, state, transformers.ElectraForPreTraining)
        ref = disc(ids, attention_mask=real.long(), output_hidden_states=True)
        _probe_loss(ref.hidden_states[-1], ref.logits, real).backward()
        _, want = electra_config_and_state(config, grads)
        # SAS has no token types (exported as zeros); ELECTRA's type-0 row gets a gradient.
        got = {n: p.grad for n, p in disc.named_parameters() if "token_type" not in n}
    assert len(got) > 10
    for name, g in got.items():
        # Relative to each tensor's own scale; the floor covers gradients that vanish in
        # exact arithmetic (the key bias under softmax) and are round-off on both sides.
        tol = ENCODER_RTOL * g.abs().max().item() + 1e-12
        assert (want[name] - g).abs().max().item() <= tol, name


# ---------------------------------------------------------------------------------------
# Loading through from_pretrained


def _save(tmp_path, config_cls, kwargs, state) -> str:
    from safetensors.torch import save_file

    config_cls(**kwargs).save_pretrained(tmp_path)
    save_file({k: v.float().contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    return os.fspath(tmp_path)


@pytest.mark.parametrize("disentangled", [False, True], ids=["electra", "deberta_v2"])
def test_from_pretrained_loads_every_weight(tmp_path, disentangled):
    """Extra head keys only warn: one directory serves both the encoder+RTD class and the
    masked-LM class, and every weight arrives unchanged."""
    config = tiny_sas_config(disentangled_attention=disentangled)
    model = _randomised(config).float()
    if disentangled:
        kwargs, state, _ = deberta_v2_config_and_state(config, model.state_dict())
        classes = (transformers.DebertaV2Model, transformers.DebertaV2ForMaskedLM)
        path = _save(tmp_path, transformers.DebertaV2Config, kwargs, state)
    else:
        kwargs, state = electra_config_and_state(config, model.state_dict())
        classes = (transformers.ElectraForPreTraining, transformers.ElectraForMaskedLM)
        path = _save(tmp_path, transformers.ElectraConfig, kwargs, state)
    for cls in classes:
        loaded, info = cls.from_pretrained(path, output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"], (cls, info)
        theirs = loaded.state_dict()
        if cls is transformers.DebertaV2Model:
            state_here = {k.removeprefix("deberta."): v for k, v in state.items()}
        else:
            state_here = state
        assert set(theirs) <= set(state_here), (cls, set(theirs) - set(state_here))
        for key in theirs:
            assert torch.equal(theirs[key], state_here[key].float()), (cls, key)

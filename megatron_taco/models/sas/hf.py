"""Export a SAS model to transformers: SAS / SAS^c as ELECTRA, SAS^DA as DeBERTa-v2.

Input: the FULL state dict of a SasForPretraining (tensor-parallel partitions merged, as a
tp=1 model has it; vocabulary rows beyond ``config.vocab_size`` are padding and dropped
here if present). Output: the config kwargs and state dicts for transformers' classes.
transformers is a dev dependency only, so it is imported nowhere in this module: the
kwargs dict is handed to ``ElectraConfig(**kwargs)`` / ``DebertaV2Config(**kwargs)`` by the
caller.

ELECTRA (``electra_config_and_state``): one state dict that both ElectraForPreTraining
(discriminator = encoder + RTD head) and ElectraForMaskedLM (generator = the same encoder +
our MLM head under ``generator_predictions.*`` / ``generator_lm_head.*``) load; each class
reports the other's head keys as unexpected and ignores them. token_type_embeddings (SAS
has none) are exported as zeros with type_vocab_size 2, so they add nothing; so are the
absolute positions of a SAS built with --no-position-biased-input.

DeBERTa-v2 (``deberta_v2_config_and_state``): the encoder under ``deberta.`` and our MLM
head as the legacy ``cls.predictions`` head (dense H -> E, GELU, LayerNorm(E), decoder tied
to the word embedding, bias), which DebertaV2ForMaskedLM(legacy=True) loads and
DebertaV2Model ignores; DeBERTa has no RTD head, so ours comes back as a separate dict with
ELECTRA's ``discriminator_predictions`` names (dense, dense_prediction).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_taco.models.sas.config import SasConfig

Tensors = dict[str, torch.Tensor]

_ENC = "sas.embeddings."
_HEADS = "heads."


def _common_kwargs(config: SasConfig) -> dict[str, Any]:
    return dict(
        vocab_size=config.vocab_size,
        embedding_size=config.embedding_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.ffn_hidden_size,
        hidden_act="gelu",  # transformers' "gelu" is the exact erf GELU, as ours
        hidden_dropout_prob=config.hidden_dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.init_method_std,
        layer_norm_eps=config.norm_epsilon,
    )


def _take(state: Tensors, key: str, rows: int | None = None) -> torch.Tensor:
    if key not in state:
        raise KeyError(f"the SAS state dict has no {key!r}; is it a SasForPretraining state dict?")
    return state[key][:rows].detach().clone()


def _vocab_rows(state: Tensors, key: str, config: SasConfig) -> torch.Tensor:
    # Rows beyond the real vocabulary are tensor-parallel padding.
    return _take(state, key, config.vocab_size)


def _words(state: Tensors, config: SasConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(input word embedding, MLM decoder weight): the same tied matrix E, except under GDES,
    where the encoder reads E + E_delta and the decoder E (the export is then untied)."""
    word = _vocab_rows(state, _ENC + "word_embeddings.weight", config)
    if not config.gradient_disentangled_embedding:
        return word, word.clone()
    return word + _vocab_rows(state, _ENC + "word_embeddings_delta.weight", config), word


def _tying(config: SasConfig) -> dict[str, Any]:
    return {"tie_word_embeddings": False} if config.gradient_disentangled_embedding else {}


def _positions(state: Tensors, config: SasConfig, dtype: torch.dtype) -> torch.Tensor:
    # ELECTRA always adds absolute positions: a SAS built without them exports zero rows.
    if config.uses_position_embeddings:
        return _take(state, _ENC + "position_embeddings")
    return torch.zeros(config.max_position_embeddings, config.embedding_size, dtype=dtype)


def _split_qkv(
    state: Tensors, prefix: str, config: SasConfig
) -> dict[str, tuple[torch.Tensor, ...]]:
    """Our fused per-head [q_h; k_h; v_h] rows -> {"q"|"k"|"v": (weight [H, H], bias [H])}."""
    heads, d, hidden = config.num_attention_heads, config.head_size, config.hidden_size
    w = _take(state, prefix + "qkv.weight").view(heads, 3, d, hidden)
    b = _take(state, prefix + "qkv.bias").view(heads, 3, d)
    return {
        name: (w[:, i].reshape(hidden, hidden).clone(), b[:, i].reshape(hidden).clone())
        for i, name in enumerate("qkv")
    }


def _layer(state: Tensors, i: int, config: SasConfig, names: dict[str, str]) -> Tensors:
    """One encoder layer under the transformers names (``names`` maps q/k/v and the layer
    prefix, the rest is BERT's layout shared by ELECTRA and DeBERTa-v2)."""
    src, dst = f"sas.layers.{i}.", names["prefix"] + f"encoder.layer.{i}."
    out: Tensors = {}
    for part, (w, b) in _split_qkv(state, src + "attention.", config).items():
        out[f"{dst}attention.self.{names[part]}.weight"] = w
        out[f"{dst}attention.self.{names[part]}.bias"] = b
    pairs = {
        "attention.dense": "attention.output.dense",
        "attention_layernorm": "attention.output.LayerNorm",
        "mlp.fc1": "intermediate.dense",
        "mlp.fc2": "output.dense",
        "output_layernorm": "output.LayerNorm",
    }
    for ours, theirs in pairs.items():
        for p in ("weight", "bias"):
            out[f"{dst}{theirs}.{p}"] = _take(state, f"{src}{ours}.{p}")
    return out


def _norm(state: Tensors, ours: str, theirs: str) -> Tensors:
    return {f"{theirs}.{p}": _take(state, f"{ours}.{p}") for p in ("weight", "bias")}


def _mlm_transform(state: Tensors, theirs_dense: str, theirs_norm: str) -> Tensors:
    out = {
        f"{theirs_dense}.{p}": _take(state, f"{_HEADS}mlm_transform.dense.{p}")
        for p in ("weight", "bias")
    }
    out.update(_norm(state, f"{_HEADS}mlm_transform.layernorm", theirs_norm))
    return out


def _rtd_head(state: Tensors, prefix: str) -> Tensors:
    out = {}
    for ours, theirs in (("rtd_dense", "dense"), ("rtd_prediction", "dense_prediction")):
        for p in ("weight", "bias"):
            out[f"{prefix}{theirs}.{p}"] = _take(state, f"{_HEADS}{ours}.{p}")
    return out


def electra_config_and_state(
    config: SasConfig, state_dict: Tensors
) -> tuple[dict[str, Any], Tensors]:
    """SAS / SAS^c -> (ElectraConfig kwargs, state dict for ElectraForPreTraining that also
    carries the generator (MLM) head for ElectraForMaskedLM)."""
    if config.disentangled_attention:
        raise ValueError("SAS^DA exports to DeBERTa-v2: use deberta_v2_config_and_state")
    kwargs = _common_kwargs(config) | {"type_vocab_size": 2} | _tying(config)
    word, decoder = _words(state_dict, config)
    e = "electra.embeddings."
    out: Tensors = {
        e + "word_embeddings.weight": word,
        e + "position_embeddings.weight": _positions(state_dict, config, word.dtype),
        e + "token_type_embeddings.weight": torch.zeros(2, config.embedding_size, dtype=word.dtype),
        **_norm(state_dict, _ENC + "layernorm", e + "LayerNorm"),
    }
    if config.embedding_size != config.hidden_size:
        for p in ("weight", "bias"):
            out[f"electra.embeddings_project.{p}"] = _take(state_dict, f"{_ENC}projection.{p}")
    names = {"prefix": "electra.", "q": "query", "k": "key", "v": "value"}
    for i in range(config.num_layers):
        out.update(_layer(state_dict, i, config, names))
    out.update(_rtd_head(state_dict, "discriminator_predictions."))
    out.update(
        _mlm_transform(state_dict, "generator_predictions.dense", "generator_predictions.LayerNorm")
    )
    out["generator_lm_head.weight"] = decoder  # tied to the word embedding (but under GDES)
    out["generator_lm_head.bias"] = _vocab_rows(state_dict, _HEADS + "mlm_bias", config)
    return kwargs, out


def deberta_v2_config_and_state(
    config: SasConfig, state_dict: Tensors
) -> tuple[dict[str, Any], Tensors, Tensors]:
    """SAS^DA -> (DebertaV2Config kwargs, state dict for DebertaV2ForMaskedLM (legacy head;
    DebertaV2Model loads it too, ignoring ``cls.*``), RTD head dict {dense,
    dense_prediction}.{weight, bias})."""
    if not config.disentangled_attention:
        raise ValueError("SAS without disentangled attention exports to ELECTRA")
    kwargs = _common_kwargs(config) | dict(
        type_vocab_size=0,
        relative_attention=True,
        max_relative_positions=config.relative_positions,
        position_buckets=config.position_buckets,
        pos_att_type=["p2c", "c2p"],
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=config.uses_position_embeddings,
        conv_kernel_size=0,
        legacy=True,
        **_tying(config),
    )
    word, decoder = _words(state_dict, config)
    e = "deberta.embeddings."
    out: Tensors = {
        e + "word_embeddings.weight": word,
        **_norm(state_dict, _ENC + "layernorm", e + "LayerNorm"),
        "deberta.encoder.rel_embeddings.weight": _take(state_dict, _ENC + "relative_embeddings"),
        **_norm(state_dict, _ENC + "relative_layernorm", "deberta.encoder.LayerNorm"),
    }
    if config.uses_position_embeddings:
        out[e + "position_embeddings.weight"] = _take(state_dict, _ENC + "position_embeddings")
    if config.embedding_size != config.hidden_size:
        out[e + "embed_proj.weight"] = _take(state_dict, _ENC + "projection.weight")
    names = {"prefix": "deberta.", "q": "query_proj", "k": "key_proj", "v": "value_proj"}
    for i in range(config.num_layers):
        out.update(_layer(state_dict, i, config, names))
    p = "cls.predictions."
    out.update(_mlm_transform(state_dict, p + "transform.dense", p + "transform.LayerNorm"))
    bias = _vocab_rows(state_dict, _HEADS + "mlm_bias", config)
    out[p + "bias"] = bias
    out[p + "decoder.weight"] = decoder  # tied to the word embedding (but under GDES)
    out[p + "decoder.bias"] = bias.clone()  # tied to cls.predictions.bias
    return kwargs, out, _rtd_head(state_dict, "")

"""Export a TACO model to transformers with its own modeling code (hf_remote/).

Input: the FULL state dict of a TacoForPretraining (tensor-parallel partitions merged, as a
tp=1 model has it; vocabulary rows beyond ``config.vocab_size`` are padding and dropped here
if present). Output: the kwargs of hf_remote's TacoConfig and the state dict of its
TacoForMaskedLM (encoder under ``taco.``, heads under ``mlm_head.`` / ``mpm_head.``), which
every Auto class of the export loads (the task models report their new head missing and the
pre-training heads unused).

What changes on the way (the computation does not):
* each stream's fused per-head Q/K/V rows [q_1; k_1; v_1; q_2; ...] become three linears
  (we_query, we_key, we_value; the same for PE) with heads contiguous, as BERT lays them out;
* [W_R^K; W_R^Q] (relative_kq) become relative_key and relative_query;
* the attention convolution's per-group weights become one nn.Conv2d weight
  [C_out, C_in, 1, 1] (input channels in the canonical order content, c2p, p2c, position,
  previous WE logits, previous PE logits), its WE/PE biases one bias and the two PReLU slope
  vectors one nn.PReLU weight (output channels: WE heads, then PE heads);
* the absolute and relative tables become nn.Embedding weights.
transformers is not imported here: the caller builds the config from the kwargs.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_taco.models.taco.config import TacoConfig

Tensors = dict[str, torch.Tensor]

# Input channel groups of the conv in canonical order (models/taco/model.py CONV_INPUT_GROUPS).
_CONV_GROUPS = ("content", "c2p", "p2c", "position", "prev_we", "prev_pe")

_RENAMES = {
    # ours (after "taco.embeddings." / "taco.layers.N." / "heads.") -> hf_remote
    "we_layernorm": "word_layer_norm",
    "pe_layernorm": "position_layer_norm",
    "relative_layernorm": "relative_layer_norm",
    "we_attention_layernorm": "we_attention_layer_norm",
    "pe_attention_layernorm": "pe_attention_layer_norm",
    "we_output_layernorm": "we_output_layer_norm",
    "pe_output_layernorm": "pe_output_layer_norm",
    "we_mlp": "we_ffn",
    "pe_mlp": "pe_ffn",
    "attention.out_we": "attention.we_output",
    "attention.out_pe": "attention.pe_output",
    "mlm_transform.layernorm": "mlm_head.layer_norm",
    "mlm_transform.dense": "mlm_head.dense",
    "mpm_transform.layernorm": "mpm_head.layer_norm",
    "mpm_transform.dense": "mpm_head.dense",
}


def hf_config_kwargs(config: TacoConfig) -> dict[str, Any]:
    return dict(
        vocab_size=config.vocab_size,
        num_hidden_layers=config.num_layers,
        we_hidden_size=config.we_hidden_size,
        pe_hidden_size=config.pe_hidden_size,
        we_attention_heads=config.we_attention_heads,
        pe_attention_heads=config.pe_attention_heads,
        attention_head_size=config.kv_channels,
        we_value_head_size=config.we_value_size,
        pe_value_head_size=config.pe_value_size,
        we_intermediate_size=config.we_ffn_hidden_size,
        pe_intermediate_size=config.pe_ffn_hidden_size,
        max_relative_positions=config.max_relative_distance,
        relative_embedding_size=config.relative_embedding_size,
        max_position_embeddings=config.max_position_embeddings,
        hidden_dropout_prob=config.hidden_dropout,
        attention_probs_dropout_prob=config.attention_dropout,
        initializer_range=config.init_method_std,
        layer_norm_eps=config.layernorm_epsilon,
    )


class _Reader:
    """Takes tensors out of our state dict and remembers which were used, so that a
    parameter added to TacoForPretraining without an export rule fails the export."""

    def __init__(self, state: Tensors) -> None:
        self.state, self.used = state, set()

    def __call__(self, key: str, rows: int | None = None) -> torch.Tensor:
        if key not in self.state:
            raise KeyError(
                f"the TACO state dict has no {key!r}; is it a TacoForPretraining state dict?"
            )
        self.used.add(key)
        return self.state[key][:rows].detach().clone()

    def left_over(self) -> list[str]:
        return sorted(set(self.state) - self.used)


def _split_qkv(take: _Reader, prefix: str, heads: int, d: int, dv: int, out: str) -> Tensors:
    """Fused per-head [q_h; k_h; v_h] rows -> {query, key, value} with heads contiguous."""
    w = take(prefix + ".weight")
    w = w.view(heads, 2 * d + dv, w.shape[-1])
    b = take(prefix + ".bias").view(heads, 2 * d + dv)
    parts = {"query": slice(0, d), "key": slice(d, 2 * d), "value": slice(2 * d, 2 * d + dv)}
    result: Tensors = {}
    for name, rows in parts.items():
        result[f"{out}_{name}.weight"] = w[:, rows].reshape(-1, w.shape[-1]).contiguous()
        result[f"{out}_{name}.bias"] = b[:, rows].reshape(-1).contiguous()
    return result


def _attention(take: _Reader, src: str, dst: str, config: TacoConfig, first: bool) -> Tensors:
    hw, hp, d = config.we_attention_heads, config.pe_attention_heads, config.kv_channels
    out: Tensors = {}
    for key, value in _split_qkv(take, src + "qkv_we", hw, d, config.we_value_size, "we").items():
        out[dst + key] = value
    for key, value in _split_qkv(take, src + "qkv_pe", hp, d, config.pe_value_size, "pe").items():
        out[dst + key] = value
    # relative_kq's rows are [W_R^K (hw*d); W_R^Q (hw*d)] at tp=1.
    for suffix in ("weight", "bias"):
        kq = take(f"{src}relative_kq.{suffix}")
        out[f"{dst}relative_key.{suffix}"] = kq[: hw * d].contiguous()
        out[f"{dst}relative_query.{suffix}"] = kq[hw * d :].contiguous()
    groups = _CONV_GROUPS[:4] if first else _CONV_GROUPS
    conv = torch.cat([take(f"{src}conv_{g}") for g in groups], dim=1)  # [C_out, C_in]
    out[dst + "conv.weight"] = conv[:, :, None, None].contiguous()
    out[dst + "conv.bias"] = torch.cat([take(src + "conv_bias_we"), take(src + "conv_bias_pe")])
    out[dst + "prelu.weight"] = torch.cat([take(src + "prelu_we"), take(src + "prelu_pe")])
    return out


def _renamed(name: str) -> str:
    for ours, theirs in _RENAMES.items():
        if name.startswith(ours + "."):
            return theirs + name[len(ours) :]
    return name


def hf_state_dict(config: TacoConfig, state: Tensors, heads: bool = True) -> Tensors:
    """Our TacoForPretraining full state dict -> hf_remote TacoForMaskedLM's state dict.
    ``heads=False``: a state dict of the encoder alone (``taco.*``, a fine-tuned model's)
    -> the encoder's ``taco.*`` tensors."""
    take = _Reader(state)
    vocab, positions = config.vocab_size, config.max_position_embeddings
    emb = "taco.embeddings."
    out: Tensors = {
        emb + "word_embeddings.weight": take(emb + "word_embeddings.weight", vocab),
        emb + "position_embeddings.weight": take(emb + "position_embeddings"),
        emb + "relative_embeddings.weight": take(emb + "relative_embeddings"),
    }
    if heads:
        out["mlm_head.bias"] = take("heads.mlm_bias", vocab)
        out["mpm_head.bias"] = take("heads.mpm_bias", positions)
    for i in range(config.num_layers):
        src = f"taco.layers.{i}.attention."
        out.update(_attention(take, src, src, config, first=i == 0))
    # Everything left is a linear or a LayerNorm whose name alone changes.
    for name in take.left_over():
        root, _, rest = name.partition(".")
        parts = rest.split(".")
        # taco.embeddings.<X>..., taco.layers.<N>.<X>..., heads.<X>...
        keep = {"taco": 2 if parts[0] == "layers" else 1, "heads": 0}.get(root)
        tail = ".".join(parts[keep:]) if keep is not None else ""
        if keep is None or _renamed(tail) == tail:
            raise KeyError(f"{name}: no rule exports this TACO parameter")
        prefix = ".".join(["taco", *parts[:keep]]) + "." if root == "taco" else ""
        out[prefix + _renamed(tail)] = take(name)
    return out

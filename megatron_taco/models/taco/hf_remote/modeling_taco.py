"""TACO for transformers (remote code: ``trust_remote_code=True``).

Self-contained: imports only torch and transformers (>= 5), so an exported directory loads
without megatron_taco. It computes what megatron_taco's TacoModel computes at
tensor-parallel size 1 (the exporter's tests check hidden states and MLM/MPM logits equal),
written plainly: one [b, C_in, s, s] stack of attention maps, an nn.Conv2d for the 1x1
attention convolution, and the full relative table.

Shapes: b rows, s tokens, hw/hp WE/PE heads, d = attention_head_size, dv value head size,
n = 2k+2 relative buckets, H = we_hidden_size + pe_hidden_size.

Inputs: ``input_ids`` and ``attention_mask`` as for BERT. ``position_ids`` default to
0, 1, ... over each row's real tokens (0 on padding, whichever side it is on), as in
pre-training; -1 marks a masked position (the MPM input). ``token_type_ids`` are accepted
and ignored: TACO has no segment embeddings, segments are told apart by [SEP].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import (
    BaseModelOutput,
    ModelOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
)

from .configuration_taco import TacoConfig


def default_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, ... over each row's real tokens, 0 on padding: [b, s] -> [b, s] int64."""
    mask = attention_mask.long()
    return ((mask.cumsum(-1) - 1) * mask).clamp(min=0)


def relative_buckets(position_ids: torch.Tensor, k: int) -> torch.Tensor:
    """[b, s, s]: bucket r_ij = clip(p_j - p_i, -k, k) + k of query i and key j, from the
    position ids (not the column index); 2k+1 where p_i or p_j is masked (-1)."""
    p = position_ids.long()
    r = (p[:, None, :] - p[:, :, None]).clamp(-k, k) + k  # [b, i, j]
    masked = p < 0
    return r.masked_fill(masked[:, None, :] | masked[:, :, None], 2 * k + 1)


class TacoEmbeddings(nn.Module):
    """Word and absolute-position embeddings (each its own LayerNorm + dropout; they start
    the two streams and are never added) and the relative table shared by all layers."""

    def __init__(self, config: TacoConfig) -> None:
        super().__init__()
        self.config = config
        # padding_idx as ELECTRA's and DeBERTa's: the tokenizer's [PAD] row (config.json's
        # pad_token_id, from the export's tokenizer) is not updated by a further fine-tuning.
        self.word_embeddings = nn.Embedding(
            config.vocab_size, config.we_hidden_size, padding_idx=config.pad_token_id
        )
        # Row max_position_embeddings: the masked position (id -1).
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings + 1, config.pe_hidden_size
        )
        self.word_layer_norm = nn.LayerNorm(config.we_hidden_size, eps=config.layer_norm_eps)
        self.position_layer_norm = nn.LayerNorm(config.pe_hidden_size, eps=config.layer_norm_eps)
        self.relative_embeddings = nn.Embedding(
            config.num_relative_buckets, config.relative_embedding_size
        )
        self.relative_layer_norm = nn.LayerNorm(
            config.relative_embedding_size, eps=config.layer_norm_eps
        )
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        we = self.dropout(self.word_layer_norm(self.word_embeddings(input_ids)))  # [b, s, d_WE]
        idx = position_ids.masked_fill(position_ids < 0, self.config.max_position_embeddings)
        pe = self.dropout(self.position_layer_norm(self.position_embeddings(idx)))  # [b, s, d_PE]
        relative = self.relative_layer_norm(self.relative_embeddings.weight)  # [n, rel]
        return we, pe, relative


class TacoAttention(nn.Module):
    """Joint attention of both streams. Maps, each divided by sqrt(d):
    content q_i.k_j, c2p q_i.K_R[r_ij], p2c k_j.Q_R[r_ji] (per WE head), position
    q^PE_i.k^PE_j (per PE head), and from layer 2 on the previous layer's fused logits; a 1x1
    convolution + PReLU fuses them into one logit map per WE and PE head; padding keys are
    masked after PReLU; WE heads weight WE values, PE heads PE values."""

    def __init__(self, config: TacoConfig, first_layer: bool) -> None:
        super().__init__()
        hw, hp, d = config.we_attention_heads, config.pe_attention_heads, config.attention_head_size
        self.hw, self.hp, self.d = hw, hp, d
        self.dv_we, self.dv_pe = config.we_value_size, config.pe_value_size
        self.we_query = nn.Linear(config.we_hidden_size, hw * d)
        self.we_key = nn.Linear(config.we_hidden_size, hw * d)
        self.we_value = nn.Linear(config.we_hidden_size, hw * self.dv_we)
        self.pe_query = nn.Linear(config.pe_hidden_size, hp * d)
        self.pe_key = nn.Linear(config.pe_hidden_size, hp * d)
        self.pe_value = nn.Linear(config.pe_hidden_size, hp * self.dv_pe)
        self.relative_key = nn.Linear(config.relative_embedding_size, hw * d)  # W_R^K
        self.relative_query = nn.Linear(config.relative_embedding_size, hw * d)  # W_R^Q
        # Input channels: content, c2p, p2c (hw each), position (hp), then the previous
        # layer's logits (hw + hp) after layer 1; output channels: WE heads, then PE heads.
        c_in = 3 * hw + hp + (0 if first_layer else hw + hp)
        self.conv = nn.Conv2d(c_in, hw + hp, kernel_size=1)
        self.prelu = nn.PReLU(hw + hp)
        self.we_output = nn.Linear(hw * self.dv_we, config.we_hidden_size)
        self.pe_output = nn.Linear(hp * self.dv_pe, config.pe_hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    @staticmethod
    def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, heads, -1).transpose(1, 2)  # [b, heads, s, width]

    def forward(self, we, pe, relative, buckets, prev_logits, key_padding):
        b, s, _ = we.shape
        hw, hp, d = self.hw, self.hp, self.d
        scale = 1.0 / math.sqrt(d)
        q_we, k_we = self._heads(self.we_query(we), hw), self._heads(self.we_key(we), hw)
        v_we = self._heads(self.we_value(we), hw)  # [b, hw, s, dv_we]
        q_pe, k_pe = self._heads(self.pe_query(pe), hp), self._heads(self.pe_key(pe), hp)
        v_pe = self._heads(self.pe_value(pe), hp)  # [b, hp, s, dv_pe]
        n = relative.shape[0]
        k_r = self.relative_key(relative).view(n, hw, d).transpose(0, 1)  # [hw, n, d]
        q_r = self.relative_query(relative).view(n, hw, d).transpose(0, 1)

        content = torch.matmul(q_we, k_we.transpose(-1, -2)) * scale  # [b, hw, s, s]
        position = torch.matmul(q_pe, k_pe.transpose(-1, -2)) * scale  # [b, hp, s, s]
        idx = buckets[:, None].expand(b, hw, s, s)  # idx[b, h, i, j] = r_ij
        # c2p[i, j] = q_i . K_R[r_ij]: score every query against every row, pick r_ij.
        c2p = torch.gather(torch.matmul(q_we, k_r.transpose(-1, -2)), -1, idx) * scale
        # p2c[i, j] = k_j . Q_R[r_ji]: key j's row r_ji sits at idx[j, i], then transpose.
        p2c_t = torch.gather(torch.matmul(k_we, q_r.transpose(-1, -2)), -1, idx)  # [b, hw, j, i]
        p2c = p2c_t.transpose(-1, -2) * scale
        maps = [content, c2p, p2c, position]
        if prev_logits is not None:
            maps.append(prev_logits)
        logits = self.prelu(self.conv(torch.cat(maps, dim=1)))  # [b, hw+hp, s, s]

        scores = logits
        if key_padding is not None:
            scores = logits.masked_fill(
                key_padding[:, None, None, :], torch.finfo(logits.dtype).min
            )
        probs = self.dropout(torch.softmax(scores, dim=-1))
        ctx_we = torch.matmul(probs[:, :hw], v_we).transpose(1, 2).reshape(b, s, -1)
        ctx_pe = torch.matmul(probs[:, hw:], v_pe).transpose(1, 2).reshape(b, s, -1)
        # The next layer's conv reads the logits before masking.
        return self.we_output(ctx_we), self.pe_output(ctx_pe), logits, probs


class TacoFeedForward(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # exact (erf) GELU


class TacoLayer(nn.Module):
    """Joint attention, then per stream (pseudo-Siamese, post-LN):
    h = LN(h + drop(attn)); h = LN(h + drop(FFN(h)))."""

    def __init__(self, config: TacoConfig, first_layer: bool) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.attention = TacoAttention(config, first_layer)
        self.we_attention_layer_norm = nn.LayerNorm(config.we_hidden_size, eps=eps)
        self.pe_attention_layer_norm = nn.LayerNorm(config.pe_hidden_size, eps=eps)
        self.we_ffn = TacoFeedForward(config.we_hidden_size, config.we_intermediate_size)
        self.pe_ffn = TacoFeedForward(config.pe_hidden_size, config.pe_intermediate_size)
        self.we_output_layer_norm = nn.LayerNorm(config.we_hidden_size, eps=eps)
        self.pe_output_layer_norm = nn.LayerNorm(config.pe_hidden_size, eps=eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, we, pe, relative, buckets, prev_logits, key_padding):
        a_we, a_pe, logits, probs = self.attention(
            we, pe, relative, buckets, prev_logits, key_padding
        )
        we = self.we_attention_layer_norm(we + self.dropout(a_we))
        pe = self.pe_attention_layer_norm(pe + self.dropout(a_pe))
        we = self.we_output_layer_norm(we + self.dropout(self.we_ffn(we)))
        pe = self.pe_output_layer_norm(pe + self.dropout(self.pe_ffn(pe)))
        return we, pe, logits, probs


class TacoPreTrainedModel(PreTrainedModel):
    config_class = TacoConfig
    config: TacoConfig
    base_model_prefix = "taco"
    supports_gradient_checkpointing = False
    # An export holds TacoForMaskedLM; the encoder and the task models load it and leave
    # the pre-training heads unused, as expected.
    _keys_to_ignore_on_load_unexpected = [r"^mlm_head\.", r"^mpm_head\."]

    @torch.no_grad()
    def _init_weights(self, module):
        """As megatron_taco initialises: N(0, initializer_range) for linear and embedding
        weights (super; its [PAD] row zero, transformers' rule), zero biases, PyTorch's Conv2d default U(+-1/sqrt(C_in)) for the
        attention convolution with a zero bias, PReLU slopes 0.25."""
        super()._init_weights(module)
        if isinstance(module, TacoAttention):
            bound = 1.0 / math.sqrt(module.conv.in_channels)
            init.uniform_(module.conv.weight, -bound, bound)
            init.zeros_(module.conv.bias)
            init.constant_(module.prelu.weight, 0.25)
        elif isinstance(module, TacoPredictionHead):
            init.zeros_(module.bias)


class TacoModel(TacoPreTrainedModel):
    """The encoder: ``last_hidden_state`` is [h_WE; h_PE] per token [b, s, H];
    ``hidden_states`` (output_hidden_states=True) the embeddings and every layer's output,
    concatenated the same way; ``attentions`` every layer's probabilities [b, hw+hp, s, s]
    (WE heads first)."""

    def __init__(self, config: TacoConfig) -> None:
        super().__init__(config)
        self.embeddings = TacoEmbeddings(config)
        self.layers = nn.ModuleList(
            TacoLayer(config, first_layer=i == 0) for i in range(config.num_hidden_layers)
        )
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,  # unused: TACO has no segment embeddings
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        if input_ids is None:
            raise ValueError("TacoModel needs input_ids")
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if unknown:
            raise TypeError(f"TacoModel.forward() does not take {', '.join(unknown)}")
        output_attentions = _flag(output_attentions, self.config, "output_attentions")
        output_hidden_states = _flag(output_hidden_states, self.config, "output_hidden_states")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = default_position_ids(attention_mask)
        we, pe, relative = self.embeddings(input_ids, position_ids)
        buckets = relative_buckets(position_ids, self.config.max_relative_positions)
        key_padding = ~attention_mask.bool()  # [b, s], True = padding key
        key_padding = key_padding if key_padding.any() else None
        states = [torch.cat([we, pe], dim=-1)] if output_hidden_states else None
        attentions = [] if output_attentions else None
        logits = None
        for layer in self.layers:
            we, pe, logits, probs = layer(we, pe, relative, buckets, logits, key_padding)
            if states is not None:
                states.append(torch.cat([we, pe], dim=-1))
            if attentions is not None:
                attentions.append(probs)
        out = BaseModelOutput(
            last_hidden_state=torch.cat([we, pe], dim=-1),
            hidden_states=tuple(states) if states is not None else None,
            attentions=tuple(attentions) if attentions is not None else None,
        )
        return out if return_dict is not False else out.to_tuple()


def _flag(value, config, name: str) -> bool:
    return bool(value if value is not None else getattr(config, name, False))


def _encode(model: TacoPreTrainedModel, input_ids, attention_mask, position_ids, kwargs):
    kwargs.pop("return_dict", None)
    kwargs.pop("token_type_ids", None)
    return model.taco(input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


# ---------------------------------------------------------------------------------------
# Pre-training heads (MLM and MPM) and the task heads


class TacoPredictionHead(nn.Module):
    """BERT's LM-head shape on [h_WE; h_PE]: dense(H -> width) + GELU + LayerNorm, then the
    decoder tied to an embedding table (passed in), plus a bias."""

    def __init__(self, config: TacoConfig, width: int, classes: int) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, width)
        self.layer_norm = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(classes))

    def forward(self, hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.linear(self.layer_norm(F.gelu(self.dense(hidden))), table, self.bias)


@dataclass
class TacoMaskedLMOutput(ModelOutput):
    """``logits``: MLM scores over the vocabulary [b, s, V]; ``position_logits``: MPM scores
    over the absolute positions [b, s, max_position_embeddings]; ``loss``: the mean MLM
    cross entropy over ``labels`` != -100 plus the mean MPM one over ``position_labels``
    != -100 (each term only when its labels are given), as in pre-training."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    position_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class TacoForMaskedLM(TacoPreTrainedModel):
    """The pre-training heads: MLM (decoder = the word embedding) and MPM (decoder = the
    absolute position rows [0, max_position_embeddings), target = the true position)."""

    def __init__(self, config: TacoConfig) -> None:
        super().__init__(config)
        self.taco = TacoModel(config)
        self.mlm_head = TacoPredictionHead(config, config.we_hidden_size, config.vocab_size)
        self.mpm_head = TacoPredictionHead(
            config, config.pe_hidden_size, config.max_position_embeddings
        )
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        out = _encode(self, input_ids, attention_mask, position_ids, kwargs)
        hidden = out.last_hidden_state
        emb = self.taco.embeddings
        logits = self.mlm_head(hidden, emb.word_embeddings.weight)
        table = emb.position_embeddings.weight[: self.config.max_position_embeddings]
        position_logits = self.mpm_head(hidden, table)
        loss = None
        for scores, target in ((logits, labels), (position_logits, position_labels)):
            if target is not None:
                # Mean over the labelled tokens, 0 (not NaN) when there are none, as ours.
                target = target.flatten()
                total = F.cross_entropy(scores.flatten(0, 1).float(), target, reduction="sum")
                term = total / (target != -100).sum().clamp(min=1)
                loss = term if loss is None else loss + term
        result = TacoMaskedLMOutput(
            loss=loss,
            logits=logits,
            position_logits=position_logits,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )
        return result if return_dict is not False else result.to_tuple()


def _classifier_dropout(config: TacoConfig) -> nn.Dropout:
    p = config.classifier_dropout
    return nn.Dropout(config.hidden_dropout_prob if p is None else p)


class TacoForSequenceClassification(TacoPreTrainedModel):
    """Dropout + linear on the [CLS] token's complete representation [h_WE; h_PE]."""

    def __init__(self, config: TacoConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.taco = TacoModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        out = _encode(self, input_ids, attention_mask, position_ids, kwargs)
        logits = self.classifier(self.dropout(out.last_hidden_state[:, 0]))  # [b, labels]
        loss = None if labels is None else self._loss(logits, labels)
        result = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return result if return_dict is not False else result.to_tuple()

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # transformers' convention: problem_type from num_labels and the labels' dtype.
        config = self.config
        if config.problem_type is None:
            if self.num_labels == 1:
                config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                config.problem_type = "single_label_classification"
            else:
                config.problem_type = "multi_label_classification"
        if config.problem_type == "regression":
            if self.num_labels == 1:
                return F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype).view(-1))
            return F.mse_loss(logits, labels.to(logits.dtype))
        if config.problem_type == "single_label_classification":
            return F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


class TacoForQuestionAnswering(TacoPreTrainedModel):
    """Span extraction: linear(H -> 2) per token gives start and end logits."""

    def __init__(self, config: TacoConfig) -> None:
        super().__init__(config)
        self.taco = TacoModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        out = _encode(self, input_ids, attention_mask, position_ids, kwargs)
        start, end = self.qa_outputs(out.last_hidden_state).unbind(-1)  # [b, s] each
        loss = None
        if start_positions is not None and end_positions is not None:
            # As BERT: targets outside the sequence are clamped to s and ignored.
            s = start.shape[1]
            starts = start_positions.view(-1).clamp(0, s)
            ends = end_positions.view(-1).clamp(0, s)
            loss = (
                F.cross_entropy(start, starts, ignore_index=s)
                + F.cross_entropy(end, ends, ignore_index=s)
            ) / 2
        result = QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start.contiguous(),
            end_logits=end.contiguous(),
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )
        return result if return_dict is not False else result.to_tuple()


class TacoForMultipleChoice(TacoPreTrainedModel):
    """Inputs [b, choices, s]; dropout + linear(H -> 1) on each option's [CLS] token."""

    def __init__(self, config: TacoConfig) -> None:
        super().__init__(config)
        self.taco = TacoModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        choices = input_ids.shape[1]

        def flat(x):
            return None if x is None else x.reshape(-1, x.shape[-1])  # [b*choices, s]

        out = _encode(self, flat(input_ids), flat(attention_mask), flat(position_ids), kwargs)
        cls = self.dropout(out.last_hidden_state[:, 0])  # [b*choices, H]
        logits = self.classifier(cls).view(-1, choices)  # [b, choices]
        loss = None if labels is None else F.cross_entropy(logits, labels)
        result = MultipleChoiceModelOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return result if return_dict is not False else result.to_tuple()


__all__ = [
    "TacoForMaskedLM",
    "TacoForMultipleChoice",
    "TacoForQuestionAnswering",
    "TacoForSequenceClassification",
    "TacoModel",
    "TacoPreTrainedModel",
]

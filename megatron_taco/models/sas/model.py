"""SAS encoder (one post-LN transformer, BERT/ELECTRA-style or DeBERTa-v2-style) and its
pre-training model with the MLM and RTD heads.

Reference implementations it equals with the same weights (tests/unit/test_sas_hf_equivalence.py):
transformers' ElectraForPreTraining (SAS, SAS^c) and DebertaV2Model / DebertaV2ForMaskedLM
with relative_attention, share_att_key, pos_att_type ["p2c", "c2p"], norm_rel_ebd
"layer_norm" (SAS^DA).

Notation used in the shape comments: b rows, s tokens, h heads local to this tp rank
(heads/tp), d head size, n rows of the relative table in use, E embedding size, H hidden.
Tensor parallelism as in TACO: the fused per-head [q_h; k_h; v_h] projection is split
contiguously over tp (whole heads per rank), the output projection and FFN are
row/column-parallel, the word embedding is vocabulary-parallel; everything else (norms,
embeddings, the relative table, the heads' transforms) is replicated.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taco.models.common.config import require_tracker_for_tp_dropout
from megatron_taco.models.common.host import host_numbers
from megatron_taco.models.common.layers import (
    LayerNorm,
    compile_layers,
    gelu,
    init_from_master_,
)
from megatron_taco.models.common.lm_head import (
    PredictionTransform,
    gather_labelled,
    labelled_count,
    lm_loss_and_correct,
    masked_mean,
    replicated_linear,
    tied_lm_logits,
    vocab_parallel_bias,
)
from megatron_taco.models.common.mlp import ParallelMLP
from megatron_taco.models.common.monitoring import monitoring_outputs
from megatron_taco.models.common.relative import (
    c2p_backward,
    c2p_scores,
    deberta_relative_index,
    p2c_backward,
    p2c_scores,
)
from megatron_taco.models.sas.config import SasConfig
from megatron_taco.parallel.cross_entropy import at_least_float32
from megatron_taco.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
)
from megatron_taco.parallel.mappings import copy_to_tp_region
from megatron_taco.parallel.random import MODEL_PARALLEL_RNG, checkpoint
from megatron_taco.parallel.state import ParallelState

IGNORE_INDEX = -100
DEFAULT_RTD_WEIGHT = 50.0  # the SAS paper's lambda at epoch 1 (constant for SAS^c)


def _replicated_projection(fan_in: int, fan_out: int, std: float, bias: bool) -> nn.Linear:
    if bias:
        return replicated_linear(fan_in, fan_out, std)
    linear = nn.Linear(fan_in, fan_out, bias=False)
    init_from_master_(linear.weight, init_method_normal(std))
    return linear


# ---------------------------------------------------------------------------------------
# Embeddings


class SasEmbeddings(nn.Module):
    """Word (+ absolute position) embeddings, normalised and projected to the hidden size in
    ELECTRA's order (SAS) or DeBERTa-v2's (SAS^DA); for SAS^DA also the relative table
    shared by all layers and its LayerNorm."""

    def __init__(self, config: SasConfig, parallel: ParallelState) -> None:
        super().__init__()
        config.require_vocab()
        self.config = config
        std, eps = config.init_method_std, config.norm_epsilon
        emb, hidden = config.embedding_size, config.hidden_size
        da = config.disentangled_attention
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, emb, parallel, init_method=init_method_normal(std)
        )
        # GDES (DeBERTaV3): the input reads sg(E) + E_delta; E_delta starts at 0.
        self.word_embeddings_delta = None
        if config.gradient_disentangled_embedding:
            self.word_embeddings_delta = VocabParallelEmbedding(
                config.vocab_size, emb, parallel, init_method=nn.init.zeros_
            )
        self.position_embeddings = None
        if config.uses_position_embeddings:
            self.position_embeddings = nn.Parameter(
                torch.empty(config.max_position_embeddings, emb)
            )
            init_from_master_(self.position_embeddings, init_method_normal(std))
        # ELECTRA normalises the E-wide sum and projects after (with bias); DeBERTa-v2 projects
        # first (no bias) and normalises the H-wide result.
        self.layernorm = LayerNorm(hidden if da else emb, eps)
        self.projection = (
            _replicated_projection(emb, hidden, std, bias=not da) if emb != hidden else None
        )
        self.dropout = nn.Dropout(config.hidden_dropout)
        if da:
            self.relative_embeddings = nn.Parameter(torch.empty(config.relative_table_size, hidden))
            init_from_master_(self.relative_embeddings, init_method_normal(std))
            self.relative_layernorm = LayerNorm(hidden, eps)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        x = self.word_embeddings(input_ids)  # [b, s, E]
        if self.word_embeddings_delta is not None:
            # sg(E)[ids] is E[ids] detached: the lookup is linear in E.
            x = x.detach() + self.word_embeddings_delta(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings[:s]
        # Replicated activations: dropout under the default RNG (same mask on every tp rank).
        if not self.config.disentangled_attention:
            x = self.dropout(self.layernorm(x))
            return self.projection(x) if self.projection is not None else x  # [b, s, H]
        if self.projection is not None:
            x = self.projection(x)
        # DeBERTa zeroes the padding positions after the LayerNorm.
        x = self.layernorm(x) * attention_mask.unsqueeze(-1).to(x.dtype)
        return self.dropout(x)  # [b, s, H]

    def relative_rows(self, lo: int, hi: int) -> torch.Tensor:
        # LayerNorm is row-wise, so normalising only the rows in use is exact.
        return self.relative_layernorm(self.relative_embeddings[lo : hi + 1])  # [n, H]


# ---------------------------------------------------------------------------------------
# Disentangled attention: the relative terms as SDPA's additive bias


class _RelativeBias(torch.autograd.Function):
    """c2p + p2c of this rank's heads, each scaled by ``scale`` (1/sqrt(3 d)), summed into one
    [h, b, s, s] buffer with the masked pairs set to the dtype's minimum: the additive
    attention bias of scaled_dot_product_attention, which adds the scaled c2c term itself.
    The backward is hand-written around relative.py's helpers, so no per-term [h, b, s, s]
    tensor is kept for it (only q, k, the projected rows, the index and the mask)."""

    @staticmethod
    def forward(ctx, q, k, q_r, k_r, index, index_t, scale, mask):
        # Summed in place into one buffer of q's dtype: no autocast here (the inputs come
        # from one dtype already).
        with torch.autocast(q.device.type, enabled=False):
            bias = c2p_scores(q, k_r, index, scale)  # [h, b, s, s]: q_i . K_r[idx(i, j)]
            bias += p2c_scores(k, q_r, index_t, scale)  # k_j . Q_r[idx(i, j)]
            if mask is not None:
                # DeBERTa's masking: the minimum, not -inf, so a padding query whose every
                # pair is masked attends uniformly (as the reference does) instead of NaN.
                bias.masked_fill_(mask, torch.finfo(bias.dtype).min)
        ctx.save_for_backward(q, k, q_r, k_r, index, index_t, mask)
        ctx.scale = scale
        return bias

    @staticmethod
    def backward(ctx, grad):
        q, k, q_r, k_r, index, index_t, mask = ctx.saved_tensors
        h, b, s, d = q.shape
        with torch.autocast(grad.device.type, enabled=False):
            # A masked pair's bias is a constant: no gradient flows through it.
            grad = grad.masked_fill(mask, 0) if mask is not None else grad.contiguous()
            grad_q = q.new_zeros(h, b * s, d)
            grad_k = k.new_zeros(h, b * s, d)
            grad_k_r = c2p_backward(grad, q, k_r, index, grad_q)  # adds d c2p / dq into grad_q
            grad_q_r = p2c_backward(grad, k, q_r, index_t, grad_k)  # adds d p2c / dk into grad_k
        scale = ctx.scale
        return (
            grad_q.mul_(scale).view(h, b, s, d),
            grad_k.mul_(scale).view(h, b, s, d),
            grad_q_r.mul_(scale),
            grad_k_r.mul_(scale),
            None,
            None,
            None,
            None,
        )


def relative_bias(q, k, q_r, k_r, index, index_t, scale: float, mask=None) -> torch.Tensor:
    """q, k [h, b, s, d]; q_r, k_r [h, n, d] (relative rows through the query / key
    projections); index [1, s, s] row of every (i, j) pair, index_t its transpose; mask
    [1, b, s, s] bool (True = masked) or None -> [h, b, s, s] = scale * (q_i.K_r[idx(i, j)] +
    k_j.Q_r[idx(i, j)]), the dtype's minimum at masked pairs."""
    return _RelativeBias.apply(q, k, q_r, k_r, index, index_t, scale, mask)


# ---------------------------------------------------------------------------------------
# Encoder layers


class SasAttention(nn.Module):
    """Self-attention through torch's scaled_dot_product_attention (flash / memory-efficient
    kernels on GPU, the fused CPU kernel when nothing needs a gradient through the mask and
    dropout is off, its math path otherwise, which is exact in float64), with the attention
    dropout inside it. SAS^DA passes its c2p + p2c terms as the additive bias."""

    def __init__(self, config: SasConfig, parallel: ParallelState, rng_tracker=None) -> None:
        super().__init__()
        config.validate_parallel(parallel.tp_size)
        self.tp_group = parallel.tp_group
        self.rng_tracker = rng_tracker
        self.heads = config.num_attention_heads // parallel.tp_size
        self.d = config.head_size
        self.disentangled = config.disentangled_attention
        # DeBERTa divides each of its three terms by sqrt(3 d); BERT by sqrt(d).
        self.scale = 1.0 / math.sqrt(self.d * (3 if self.disentangled else 1))
        self.dropout_p = config.attention_dropout
        std, hidden = config.init_method_std, config.hidden_size
        # Fused per head [q_h; k_h; v_h]: a contiguous split over tp gives whole heads.
        self.qkv = ColumnParallelLinear(
            hidden, 3 * hidden, parallel, init_method=init_method_normal(std)
        )
        self.dense = RowParallelLinear(
            hidden,
            hidden,
            parallel,
            init_method=init_method_normal(config.output_layer_std),
        )
        # DeBERTa drops the relative rows again in every layer (its pos_dropout).
        self.relative_dropout = nn.Dropout(config.hidden_dropout) if self.disentangled else None

    def relative_qk(self, rel_rows: torch.Tensor):
        """The relative rows [n, H] through this layer's own query and key projections (with
        their biases, DeBERTa's share_att_key) -> (q_r, k_r), each [h, n, d]."""
        h, d, hidden = self.heads, self.d, rel_rows.shape[-1]
        weight = self.qkv.weight.view(h, 3, d, hidden)[:, :2].reshape(h * 2 * d, hidden)
        bias = self.qkv.bias.view(h, 3, d)[:, :2].reshape(h * 2 * d)
        # Replicated rows entering a column-parallel product: backward all-reduces over tp.
        rows = copy_to_tp_region(self.relative_dropout(rel_rows), self.tp_group)
        n = rows.shape[0]
        qk_r = F.linear(rows, weight, bias).view(n, h, 2, d).permute(2, 1, 0, 3)  # [2, h, n, d]
        return qk_r[0].contiguous(), qk_r[1].contiguous()

    def forward(self, x, mask, rel_rows=None, rel_index=None, rel_index_t=None):
        # x [b, s, H]; mask: True = masked out, [b, 1, 1, s] (padding keys, SAS) or
        # [1, b, s, s] (pairs, SAS^DA); None = no padding in the batch.
        b, s, _ = x.shape
        h, d = self.heads, self.d
        qkv = self.qkv(x).view(b, s, h, 3 * d)
        if self.disentangled:
            # Head-major [h, b, s, d], the layout of relative.py's c2p/p2c products.
            q, k, v = (t.contiguous() for t in qkv.permute(2, 0, 1, 3).split(d, dim=-1))
            q_r, k_r = self.relative_qk(rel_rows)
            bias = relative_bias(q, k, q_r, k_r, rel_index, rel_index_t, self.scale, mask)
        else:
            q, k, v = qkv.transpose(1, 2).split(d, dim=-1)  # [b, h, s, d] views
            # ELECTRA's additive mask (the minimum, not -inf: a row of padding stays finite).
            bias = None
            if mask is not None:
                bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
                bias.masked_fill_(mask, torch.finfo(q.dtype).min)  # [b, 1, 1, s]
        # Local heads only: each rank must drop different elements -> the tracker's stream,
        # which SDPA's dropout draws from as the default generator inside the fork.
        dropout_p = self.dropout_p if self.training else 0.0
        tracker = self.rng_tracker
        fork = (
            tracker.fork(MODEL_PARALLEL_RNG)
            if tracker is not None and dropout_p > 0
            else nullcontext()
        )
        with fork:
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=self.scale
            )
        # SAS^DA [h, b, s, d], SAS [b, h, s, d] -> [b, s, h * d]
        context = context.permute(1, 2, 0, 3) if self.disentangled else context.transpose(1, 2)
        return self.dense(context.reshape(b, s, h * d))  # [b, s, H]


class SasLayer(nn.Module):
    """Post-LN like BERT: x = LN(x + drop(attn(x))); x = LN(x + drop(FFN(x)))."""

    def __init__(self, config: SasConfig, parallel: ParallelState, rng_tracker=None) -> None:
        super().__init__()
        eps = config.norm_epsilon
        self.attention = SasAttention(config, parallel, rng_tracker)
        self.attention_layernorm = LayerNorm(config.hidden_size, eps)
        self.mlp = ParallelMLP(
            config.hidden_size,
            config.ffn_hidden_size,
            parallel,
            init_std=config.init_method_std,
            num_layers=config.num_layers,
            output_std=config.output_layer_std,
        )
        self.output_layernorm = LayerNorm(config.hidden_size, eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x, mask, rel_rows=None, rel_index=None, rel_index_t=None):
        # Row-parallel outputs are all-reduced (replicated): default-RNG dropout.
        a = self.attention(x, mask, rel_rows, rel_index, rel_index_t)
        x = self.attention_layernorm(x + self.dropout(a))
        return self.output_layernorm(x + self.dropout(self.mlp(x)))


# ---------------------------------------------------------------------------------------
# Encoder


class SasModel(nn.Module):
    """Encoder only: (input_ids [b, s], attention_mask [b, s] bool) -> hidden [b, s, H]."""

    def __init__(self, config: SasConfig, parallel: ParallelState, rng_tracker=None) -> None:
        super().__init__()
        config.validate_parallel(parallel.tp_size)
        require_tracker_for_tp_dropout(config, parallel.tp_size, rng_tracker)
        self.config = config
        self.rng_tracker = rng_tracker
        self.embeddings = SasEmbeddings(config, parallel)
        self.layers = nn.ModuleList(
            SasLayer(config, parallel, rng_tracker) for _ in range(config.num_layers)
        )
        if config.compile:
            compile_layers(self.layers, "SAS layers")
        self._index_cache: dict[tuple[int, str], tuple[int, int, torch.Tensor, torch.Tensor]] = {}

    def relative_rows_used(self, s: int) -> int:
        """How many relative-table rows a length-s batch projects (0 without SAS^DA)."""
        if not self.config.disentangled_attention:
            return 0
        lo, hi, _, _ = self.relative_index(s, "cpu")
        return hi - lo + 1

    def relative_index(self, s: int, device) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """(lo, hi, index, index_t): the table rows lo..hi that a length-s batch uses and the
        row of every pair relative to lo ([1, s, s] and its transpose). Depends on s only:
        built on CPU once per length (no device sync) and cached."""
        key = (s, str(device))
        if key not in self._index_cache:
            c = self.config
            index = deberta_relative_index(
                s, c.relative_span, c.position_buckets, c.relative_positions
            )
            lo, hi = int(index.min()), int(index.max())
            index = index - lo
            self._index_cache[key] = (
                lo,
                hi,
                index.to(device),
                index.transpose(1, 2).contiguous().to(device),
            )
        return self._index_cache[key]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        has_padding: bool | None = None,
    ) -> torch.Tensor:
        """``has_padding``: whether any token is padding, known on the host
        (SasForPretraining.host_layout); None reads it from the device (one sync)."""
        config = self.config
        attention_mask = attention_mask.bool()
        x = self.embeddings(input_ids, attention_mask)
        rel = ()
        if config.disentangled_attention:
            lo, hi, index, index_t = self.relative_index(input_ids.shape[1], input_ids.device)
            rel = (self.embeddings.relative_rows(lo, hi), index, index_t)
        mask = self._score_mask(attention_mask, has_padding)
        for layer in self.layers:
            if config.recompute_activations and torch.is_grad_enabled():
                x = checkpoint(layer, x, mask, *rel, tracker=self.rng_tracker)
            else:
                x = layer(x, mask, *rel)
        return x

    def _score_mask(
        self, attention_mask: torch.Tensor, has_padding: bool | None
    ) -> torch.Tensor | None:
        # Batches without padding skip the masking pass (and SDPA can take flash attention).
        if has_padding is None:
            has_padding = not bool(attention_mask.all())  # a host sync
        if not has_padding:
            return None
        pad = ~attention_mask
        if not self.config.disentangled_attention:
            return pad[:, None, None, :]  # [b, 1, 1, s]: padding keys, as BERT/ELECTRA
        # DeBERTa masks pair (i, j) unless both are real: padding queries attend uniformly.
        return (pad[:, :, None] | pad[:, None, :]).unsqueeze(0)  # [1, b, s, s]


# ---------------------------------------------------------------------------------------
# Pre-training model


class SasPretrainingHeads(nn.Module):
    """MLM: dense(H -> E) + GELU + LayerNorm, decoder tied to the word embedding, with a
    vocabulary-parallel bias (ELECTRA's generator head), run only at the replaced positions.
    RTD: dense(H -> H) + GELU + dense(H -> 1) at every token (ELECTRA's discriminator head;
    positive logit = replaced). Both transforms are replicated."""

    def __init__(self, config: SasConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.config = config
        self.tp_group = parallel.tp_group
        hidden, std = config.hidden_size, config.init_method_std
        self.mlm_transform = PredictionTransform(
            hidden, config.embedding_size, init_std=std, eps=config.norm_epsilon
        )
        self.mlm_bias = vocab_parallel_bias(config.vocab_size, parallel)
        self.rtd_dense = replicated_linear(hidden, hidden, std)
        self.rtd_prediction = replicated_linear(hidden, 1, std)

    def mlm_logits(self, x: torch.Tensor, word_weight: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> float32 [N, V_padded/tp], this rank's vocabulary slice."""
        return tied_lm_logits(self.mlm_transform(x), word_weight, self.mlm_bias, self.tp_group)

    def rtd_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [...]."""
        return self.rtd_prediction(gelu(self.rtd_dense(hidden))).squeeze(-1)


def rtd_labels(
    input_ids: torch.Tensor, mlm_labels: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The RTD targets a SAS batch carries: 1 where the input differs from the original (a
    replacement that happens to equal the original is 0, SAS paper eq. 5), 0 elsewhere on
    real tokens, IGNORE_INDEX on padding. All [b, s]."""
    replaced = (mlm_labels != IGNORE_INDEX) & (input_ids != mlm_labels)
    return replaced.long().masked_fill(~attention_mask.bool(), IGNORE_INDEX)


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    # 0 for an empty denominator, no host sync.
    return num.float() / den.clamp(min=1).float()


class SasForPretraining(nn.Module):
    """forward(batch) -> dict. Batch: input_ids [b, s] (replacements at the set S, never
    [MASK]), attention_mask [b, s] bool, mlm_labels [b, s] (original token at S, -100
    elsewhere), rtd_labels [b, s] (1 replaced, 0 original, -100 ignored, e.g. padding).

    loss = L_MLM + rtd_weight * L_RTD; L_MLM is the mean vocabulary-parallel cross entropy
    over S, L_RTD the mean BCE-with-logits over the tokens with an RTD label. Also returned:
    the detached accuracies, replaced_share (fraction of S whose replacement equals the
    original, "hits"), int64 counts (*_tokens), and for the self-augmentation sampler
    mlm_logits (detached float32 [N, V_padded/tp], this rank's vocabulary slice) with
    mlm_positions ([N] flat indices into b*s of those rows)."""

    def __init__(self, config: SasConfig, parallel: ParallelState, rng_tracker=None) -> None:
        super().__init__()
        self.config = config
        self.tp_group = parallel.tp_group
        self.sas = SasModel(config, parallel, rng_tracker)
        self.heads = SasPretrainingHeads(config, parallel)
        self.rtd_weight = DEFAULT_RTD_WEIGHT

    def set_rtd_weight(self, value: float) -> None:
        value = float(value)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"the RTD loss weight must be finite and >= 0, got {value}")
        self.rtd_weight = value

    @staticmethod
    def host_layout(batch: dict[str, torch.Tensor]) -> dict[str, int | bool]:
        """What the forward needs on the host (models/common/host.py), from the batch."""
        return {
            "has_padding": not bool(batch["attention_mask"].bool().all()),
            "mlm_labels": labelled_count(batch["mlm_labels"]),
        }

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        host = host_numbers(batch, self.host_layout)
        hidden = self.sas(
            batch["input_ids"], batch["attention_mask"], host["has_padding"]
        )  # [b, s, H]
        # MLM only at S (gathered first, counted on the host): ~15% of the vocabulary products.
        x, target, positions = gather_labelled(
            hidden.flatten(0, 1), batch["mlm_labels"], host["mlm_labels"]
        )
        word_weight = self.sas.embeddings.word_embeddings.weight
        logits = self.heads.mlm_logits(x, word_weight)  # [N, V_padded/tp] float32
        mlm_tok, mlm_correct = lm_loss_and_correct(
            logits, target, self.tp_group, self.config.vocab_size
        )
        mlm_loss = masked_mean(mlm_tok)
        rtd = self._rtd(at_least_float32(self.heads.rtd_logits(hidden)), batch)
        device = mlm_loss.device
        monitoring = {}
        if not self.training:  # the learning monitor's inputs
            monitoring = monitoring_outputs(
                hidden,
                batch["attention_mask"],
                mlm=(batch["mlm_labels"], self.config.vocab_size),
            )
        return {
            **monitoring,
            "loss": mlm_loss + self.rtd_weight * rtd["rtd_loss"],
            "mlm_loss": mlm_loss,
            **rtd,
            # torch.full, not torch.tensor: no blocking host->device copy.
            "rtd_weight": torch.full((), self.rtd_weight, device=device),
            "mlm_acc": masked_mean(mlm_correct.float()).detach(),
            "mlm_tokens": torch.full((), mlm_correct.numel(), device=device),
            "mlm_logits": logits.detach(),
            "mlm_positions": positions,
        }

    @staticmethod
    def _rtd(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels = batch["rtd_labels"]  # [b, s]; logits [b, s] float32
        valid = labels != IGNORE_INDEX
        bce = F.binary_cross_entropy_with_logits(
            logits, labels.clamp(min=0).to(logits.dtype), reduction="none"
        )
        count = valid.sum()
        loss = bce.masked_fill(~valid, 0.0).sum() / count.clamp(min=1)
        with torch.no_grad():
            replaced, original = labels == 1, labels == 0
            correct = (logits > 0) == replaced
            in_s = batch["mlm_labels"] != IGNORE_INDEX
            metrics = {
                "rtd_acc": _ratio((correct & valid).sum(), count),
                "rtd_acc_replaced": _ratio((correct & replaced).sum(), replaced.sum()),
                "rtd_acc_original": _ratio((correct & original).sum(), original.sum()),
                "replaced_share": _ratio((in_s & original).sum(), in_s.sum()),
            }
        return {"rtd_loss": loss, **metrics, "rtd_tokens": count}

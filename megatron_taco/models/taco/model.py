"""TACO encoder: disentangled word/position streams with attention convolution.

Notation used in the shape comments: b rows, s tokens, hw/hp WE/PE heads (local to this
tensor-parallel rank: hw/tp, hp/tp), d head size, n relative buckets in use (see
``relative_bucket_range``), C_in/C_out channels of the 1x1 attention convolution.

Tensor parallelism of the attention convolution (docs/tensor_parallel_taco.md has the
costing and the alternatives): every rank computes the maps of its own heads, multiplies
them with its columns of the conv weight into partial sums for ALL output heads, and a
reduce-scatter over the tp group sums the partials and leaves each rank exactly the fused
logits of its own output heads (its WE heads, then its PE heads). Everything after that
(bias, PReLU, softmax, dropout, values) is local again.
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
    DropoutMask,
    LayerNorm,
    compile_layers,
    init_from_master_,
    init_partitioned_,
    uniform_fan_in_init,
)
from megatron_taco.models.common.lm_head import gather_labelled, labelled_count, masked_mean
from megatron_taco.models.common.mlp import ParallelMLP
from megatron_taco.models.common.monitoring import monitoring_outputs
from megatron_taco.models.common.relative import (
    batch_layout,
    bucket_range,
    c2p_backward,
    c2p_scores,
    p2c_backward,
    p2c_scores,
    position_stats,
    relative_position_index,
    relative_table_rows,
)
from megatron_taco.models.taco.config import TacoConfig
from megatron_taco.models.taco.heads import TacoPretrainingHeads
from megatron_taco.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    scaled_init_method_normal,
    set_tensor_model_parallel_attributes,
)
from megatron_taco.parallel.mappings import reduce_scatter_to_tp_region
from megatron_taco.parallel.random import MODEL_PARALLEL_RNG, checkpoint
from megatron_taco.parallel.state import ParallelState

# Input channel groups of the attention convolution, in the canonical (tp=1) order. Each
# group is split over tp like the heads it comes from, so rank r's input channels are the
# rank-r slice of every group, in this order.
CONV_INPUT_GROUPS = ("content", "c2p", "p2c", "position", "prev_we", "prev_pe")


def _group_heads(config: TacoConfig, group: str) -> int:
    return (
        config.pe_attention_heads if group in ("position", "prev_pe") else config.we_attention_heads
    )


# ---------------------------------------------------------------------------------------
# Embeddings


class TacoEmbeddings(nn.Module):
    """Word and absolute-position embeddings (never added: they start the two streams), each
    with its own LayerNorm + dropout as BERT normalises its embeddings, and the relative
    position table shared by all layers."""

    def __init__(self, config: TacoConfig, parallel: ParallelState) -> None:
        super().__init__()
        config.require_vocab()
        self.config = config
        init = init_method_normal(config.init_method_std)
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.we_hidden_size, parallel, init_method=init
        )
        # Row max_position_embeddings is the learned "masked position" vector (position id -1).
        # Rows [0, max_position_embeddings) double as the MPM decoder (heads.py).
        self.position_embeddings = nn.Parameter(
            torch.empty(config.max_position_embeddings + 1, config.pe_hidden_size)
        )
        init_from_master_(self.position_embeddings, init)
        self.we_layernorm = LayerNorm(config.we_hidden_size, config.layernorm_epsilon)
        self.pe_layernorm = LayerNorm(config.pe_hidden_size, config.layernorm_epsilon)
        # R: 2k+1 clipped distances + the bucket of pairs involving a masked position.
        # Normalised before the per-layer projections, as DeBERTa does (its rel_embeddings
        # go through LayerNorm when norm_rel_ebd="layer_norm"): the table is shared by all
        # layers, and LN keeps its scale independent of how many layers pull on it.
        self.relative_embeddings = nn.Parameter(
            torch.empty(config.num_relative_buckets, config.relative_embedding_size)
        )
        init_from_master_(self.relative_embeddings, init)
        self.relative_layernorm = LayerNorm(
            config.relative_embedding_size, config.layernorm_epsilon
        )
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        # Replicated activations: dropout runs under the default RNG, which is the same on
        # every tp rank, so all ranks drop the same elements.
        we = self.dropout(self.we_layernorm(self.word_embeddings(input_ids)))  # [b, s, d_WE]
        idx = position_ids.masked_fill(position_ids < 0, self.config.max_position_embeddings)
        pe = self.dropout(
            self.pe_layernorm(F.embedding(idx, self.position_embeddings))
        )  # [b, s, d_PE]
        return we, pe

    def relative_rows(self, rows: torch.Tensor) -> torch.Tensor:
        # LayerNorm is row-wise, so normalising only the rows in use is exact.
        return self.relative_layernorm(self.relative_embeddings.index_select(0, rows))  # [n, rel]


# ---------------------------------------------------------------------------------------
# Attention


def _dot_maps(out, q_we, k_we, q_pe, k_pe, scale) -> None:
    """The content (per WE head) and position (per PE head) maps, scale * Q K^T, into
    ``out`` [hw + hp, b, s, s]. q_we/k_we [hw, b, s, d]; q_pe/k_pe [hp, b, s, d]."""
    hw, b, s, d = q_we.shape
    for maps, q, k in ((out[:hw], q_we, k_we), (out[hw:], q_pe, k_pe)):
        h = q.shape[0]
        flat = maps.view(h * b, s, s)  # (heads, b) flattened into one bmm batch
        torch.baddbmm(
            flat,
            q.view(h * b, s, d),
            k.view(h * b, s, d).transpose(1, 2),
            beta=0.0,
            alpha=scale,
            out=flat,
        )


def _relative_maps(out, q_we, k_we, k_r, q_r, index, scale) -> None:
    """c2p then p2c (per WE head) into ``out`` [2 hw, b, s, s]: c2p[i, j] = q_i . K_R[r_ij],
    p2c[i, j] = Q_R[r_ji] . k_j (models/common/relative.py); index [b, s, s] holds r_ij,
    which is also p2c's key-major index."""
    hw = q_we.shape[0]
    c2p_scores(q_we, k_r, index, scale, out=out[:hw])
    p2c_scores(k_we, q_r, index, scale, out=out[hw:])


def _dot_maps_backward(grad, q_we, k_we, q_pe, k_pe, scale):
    """(d q_we, d k_we, d q_pe, d k_pe) of _dot_maps, unscaled, the WE ones [hw, b*s, d]."""
    hw, b, s, d = q_we.shape
    grads = []
    for g, q, k in ((grad[:hw], q_we, k_we), (grad[hw:], q_pe, k_pe)):
        h = q.shape[0]
        g = g.view(h * b, s, s)
        grads.append(torch.bmm(g, k.view(h * b, s, d)).view(h, b * s, d))
        grads.append(torch.bmm(g.transpose(1, 2), q.view(h * b, s, d)).view(h, b * s, d))
    return grads


# The 1x1 conv is a GEMM with a tiny dimension ([C_out, C_in] ~ [18, 60] against b*s*s
# columns). On CPU such a product runs ~1.7x faster in column blocks that stay in cache
# than as one call (measured [42, 18] x [18, 2*512*512] on one core: 105 -> 63 ms);
# accelerators get one call.
_CPU_COLUMN_BLOCK = 8192


def _conv_gemm(out, weight, x, bias=None, accumulate: bool = False) -> None:
    """out [M, N] = bias [M, 1] + weight [M, K] @ x [K, N], or out += weight @ x."""
    step = _CPU_COLUMN_BLOCK if out.device.type == "cpu" else out.shape[1]
    for i in range(0, out.shape[1], step):
        o, xi = out[:, i : i + step], x[:, i : i + step]
        if bias is not None:
            torch.addmm(bias, weight, xi, out=o)
        else:
            o.addmm_(weight, xi, beta=1.0 if accumulate else 0.0)


def _weight_parts(w_maps, hw: int):
    """Columns of the canonical [C_out, content | c2p | p2c | position] conv weight for the
    dot-product maps (content, position) and for the relative maps (c2p, p2c)."""
    return torch.cat([w_maps[:, :hw], w_maps[:, 3 * hw :]], 1), w_maps[:, hw : 3 * hw]


class _AttentionLogits(torch.autograd.Function):
    """The 1x1 attention convolution of this rank's maps and previous logits: partial sums
    [C_out, b*s*s] for ALL output heads (summed over tp by a reduce-scatter after this).

    Its weight gradient is what needs the [b, s, s] maps in backward. The c2p/p2c maps
    (gathers, ~5x the cost of the others) are saved; the content and position maps are two
    batched GEMMs of the saved q/k and are recomputed instead (1 of 4.6 saved [b, s, s]
    planes per head pair, for ~1% of the step). The previous layer's logits enter through
    their own weight columns: never copied next to the maps, and saved anyway as that
    layer's output. The backward is hand-written."""

    @staticmethod
    def forward(ctx, q_we, k_we, q_pe, k_pe, k_r, q_r, index, prev, w_maps, w_prev, bias, scale):
        # The maps are written with out= into buffers of q_we's dtype, so autocast must not
        # pick per-op dtypes here (the inputs come from one dtype already).
        with torch.autocast(q_we.device.type, enabled=False):
            hw, b, s, _ = q_we.shape
            w_dot, w_rel = _weight_parts(w_maps, hw)
            rel = q_we.new_empty(2 * hw, b, s, s)
            _relative_maps(rel, q_we, k_we, k_r, q_r, index, scale)
            partial = rel.new_empty(w_maps.shape[0], b * s * s)
            _conv_gemm(partial, w_rel, rel.view(2 * hw, -1), bias=bias.unsqueeze(1))
            dot = rel.new_empty(hw + q_pe.shape[0], b, s, s)
            _dot_maps(dot, q_we, k_we, q_pe, k_pe, scale)
            _conv_gemm(partial, w_dot, dot.view(dot.shape[0], -1), accumulate=True)
            del dot
            if prev is not None:
                _conv_gemm(partial, w_prev, prev.reshape(prev.shape[0], -1), accumulate=True)
        ctx.save_for_backward(q_we, k_we, q_pe, k_pe, k_r, q_r, index, rel, prev, w_maps, w_prev)
        ctx.scale = scale
        return partial

    @staticmethod
    def backward(ctx, grad):
        q_we, k_we, q_pe, k_pe, k_r, q_r, index, rel, prev, w_maps, w_prev = ctx.saved_tensors
        scale = ctx.scale
        hw = q_we.shape[0]
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad.contiguous()  # [C_out, b*s*s]
            w_dot, w_rel = _weight_parts(w_maps, hw)
            dot = rel.new_empty(hw + q_pe.shape[0], *rel.shape[1:])
            _dot_maps(dot, q_we, k_we, q_pe, k_pe, scale)
            dot, rel = dot.view(dot.shape[0], -1), rel.view(2 * hw, -1)
            grad_dot_w, grad_rel_w = grad @ dot.t(), grad @ rel.t()
            grad_w_maps = torch.cat(
                [grad_dot_w[:, :hw], grad_rel_w, grad_dot_w[:, hw:]], dim=1
            )  # canonical column order
            _conv_gemm(dot, w_dot.t(), grad)  # the recomputed maps' buffer takes their grad
            grad_rel = torch.empty_like(rel)
            _conv_gemm(grad_rel, w_rel.t(), grad)
            maps_shape = (-1, q_we.shape[1], q_we.shape[2], q_we.shape[2])  # [., b, s, s]
            grad_q, grad_k, grad_q_pe, grad_k_pe = _dot_maps_backward(
                dot.view(maps_shape), q_we, k_we, q_pe, k_pe, scale
            )
            del dot
            grad_rel = grad_rel.view(maps_shape)
            grad_k_r = c2p_backward(grad_rel[:hw], q_we, k_r, index, grad_q)  # adds into grad_q
            grad_q_r = p2c_backward(grad_rel[hw:], k_we, q_r, index, grad_k)  # adds into grad_k
            del grad_rel
            grad_prev = grad_w_prev = None
            if prev is not None:
                flat_prev = prev.reshape(prev.shape[0], -1)
                grad_w_prev = grad @ flat_prev.t()
                grad_prev = torch.empty_like(flat_prev)
                _conv_gemm(grad_prev, w_prev.t(), grad)
                grad_prev = grad_prev.view(prev.shape)
        shape_we, shape_pe = q_we.shape, q_pe.shape
        return (
            grad_q.mul_(scale).view(shape_we),
            grad_k.mul_(scale).view(shape_we),
            grad_q_pe.mul_(scale).view(shape_pe),
            grad_k_pe.mul_(scale).view(shape_pe),
            grad_k_r.mul_(scale),
            grad_q_r.mul_(scale),
            None,
            grad_prev,
            grad_w_maps,
            grad_w_prev,
            grad.sum(1),
            None,
        )


def attention_logits(
    q_we, k_we, q_pe, k_pe, k_r, q_r, index, prev, w_maps, w_prev, bias, scale: float
) -> torch.Tensor:
    """[C_out, b*s*s]: bias + w_maps @ maps + w_prev @ prev, where maps are the content,
    c2p, p2c (per WE head) and position (per PE head) maps [3 hw + hp, b, s, s], in that
    (canonical) order, every map divided by sqrt(d); index [b, s, s] is the bucket r_ij of
    every pair; prev [hw + hp, b, s, s] is the previous layer's fused logits (None in layer
    1, then w_prev is None too)."""
    if torch.compiler.is_compiling():
        # Plain differentiable ops under torch.compile: the hand-written op writes into
        # views (out=), which the compiler would split the graph at.
        content = torch.matmul(q_we, k_we.transpose(-1, -2)) * scale
        position = torch.matmul(q_pe, k_pe.transpose(-1, -2)) * scale
        c2p = c2p_scores(q_we, k_r, index, scale)
        p2c = p2c_scores(k_we, q_r, index, scale)
        maps = torch.cat([content, c2p, p2c, position]).flatten(1)  # canonical order
        partial = torch.addmm(bias.unsqueeze(1), w_maps, maps)
        return partial if prev is None else partial + w_prev @ prev.flatten(1)
    return _AttentionLogits.apply(
        q_we, k_we, q_pe, k_pe, k_r, q_r, index, prev, w_maps, w_prev, bias, scale
    )


class _AttentionProbs(torch.autograd.Function):
    """Softmax over the keys (padding keys masked), inverted dropout with a given keep mask,
    then each head's values: WE heads weight WE values, PE heads PE values.

    Saved: the probabilities (softmax needs them), the keep mask as bool and the values.
    The dropped probabilities are rebuilt in backward instead of kept, the 1/(1-p) scale
    is applied to the small [heads, b, s, d_v] products, and both heads' gradients are
    written into one buffer (no split/cat)."""

    @staticmethod
    def forward(ctx, logits, key_padding, keep, v_we, v_pe, keep_scale):
        # logits [hw+hp, b, s, s]; key_padding [1, b, 1, s] bool or None; keep like logits,
        # bool or None (no dropout); v_we [hw, b, s, dv_we], v_pe [hp, b, s, dv_pe].
        with torch.autocast(logits.device.type, enabled=False):
            scores = logits
            if key_padding is not None:
                scores = logits.masked_fill(key_padding, torch.finfo(logits.dtype).min)
            # Half-precision softmax accumulates in float32 internally; asking for a float32
            # result would instead keep a float32 copy of [hw+hp, b, s, s] alive for backward.
            probs = torch.softmax(scores, dim=-1)
            del scores
            dropped = probs if keep is None else probs * keep
            ctx_we, ctx_pe = _values(dropped, v_we, v_pe)
            del dropped
            if keep is not None:
                ctx_we.mul_(keep_scale)
                ctx_pe.mul_(keep_scale)
        ctx.save_for_backward(probs, keep, key_padding, v_we, v_pe)
        ctx.keep_scale = keep_scale
        return ctx_we, ctx_pe

    @staticmethod
    def backward(ctx, grad_we, grad_pe):
        probs, keep, key_padding, v_we, v_pe = ctx.saved_tensors
        hw, b, s, _ = v_we.shape
        hp = v_pe.shape[0]
        with torch.autocast(probs.device.type, enabled=False):
            if keep is not None:
                grad_we, grad_pe = grad_we * ctx.keep_scale, grad_pe * ctx.keep_scale
            grad_we, grad_pe = grad_we.contiguous(), grad_pe.contiguous()
            dropped = probs if keep is None else probs * keep
            grad_v_we = torch.matmul(dropped[:hw].transpose(-1, -2), grad_we)
            grad_v_pe = torch.matmul(dropped[hw:].transpose(-1, -2), grad_pe)
            del dropped
            grad = torch.empty_like(probs)  # d loss / d dropped probs, both head kinds
            for out, g, v, h in ((grad[:hw], grad_we, v_we, hw), (grad[hw:], grad_pe, v_pe, hp)):
                dv = v.shape[-1]
                torch.bmm(
                    g.view(h * b, s, dv),
                    v.reshape(h * b, s, dv).transpose(1, 2),
                    out=out.view(h * b, s, s),
                )
            if keep is not None:
                grad.mul_(keep)
            grad = torch._softmax_backward_data(grad, probs, -1, probs.dtype)
            if key_padding is not None:
                grad.masked_fill_(key_padding, 0.0)  # the filled scores are constants
        return grad, None, None, grad_v_we, grad_v_pe, None


def _values(probs, v_we, v_pe):
    hw = v_we.shape[0]
    return torch.matmul(probs[:hw], v_we), torch.matmul(probs[hw:], v_pe)


def attention_probs(logits, key_padding, keep, v_we, v_pe, keep_scale: float):
    """-> (context of the WE heads [hw, b, s, dv_we], of the PE heads [hp, b, s, dv_pe]):
    softmax(logits masked at padding keys) * keep * keep_scale, times the values."""
    if torch.compiler.is_compiling():
        # Plain ops under torch.compile: the compiler fuses them with the PReLU before and
        # picks what to save itself, which a hand-written autograd function would prevent.
        scores = logits
        if key_padding is not None:
            scores = logits.masked_fill(key_padding, torch.finfo(logits.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        if keep is not None:
            probs = probs * keep * keep_scale
        return _values(probs, v_we, v_pe)
    return _AttentionProbs.apply(logits, key_padding, keep, v_we, v_pe, keep_scale)


class TacoAttention(nn.Module):
    def __init__(
        self,
        config: TacoConfig,
        parallel: ParallelState,
        layer_number: int,
        rng_tracker=None,
    ) -> None:
        super().__init__()
        tp, rank = parallel.tp_size, parallel.tp_rank
        config.validate_parallel(tp)
        self.config = config
        self.tp_group = parallel.tp_group
        self.tp_size, self.tp_rank = tp, rank
        self.rng_tracker = rng_tracker
        self.first_layer = layer_number == 1
        d, dv_we, dv_pe = config.kv_channels, config.we_value_size, config.pe_value_size
        hw, hp = config.we_attention_heads, config.pe_attention_heads
        self.hw, self.hp, self.d = hw // tp, hp // tp, d
        self.dv_we, self.dv_pe = dv_we, dv_pe
        init = init_method_normal(config.init_method_std)
        # Megatron's init for projections that feed a residual: std / sqrt(2 * num_layers).
        out_init = scaled_init_method_normal(config.init_method_std, config.num_layers)

        # Fused per head [q_h; k_h; v_h] (queries/keys d_k wide, values d_v wide, Eq. 2): a
        # contiguous split over tp gives each rank whole heads whatever d_v is.
        self.qkv_we = ColumnParallelLinear(
            config.we_hidden_size, hw * (2 * d + dv_we), parallel, init_method=init
        )
        self.qkv_pe = ColumnParallelLinear(
            config.pe_hidden_size, hp * (2 * d + dv_pe), parallel, init_method=init
        )
        # [W_R^K; W_R^Q]: relative_embedding_size -> hw*d each, split over WE heads.
        self.relative_kq = ColumnParallelLinear(
            config.relative_embedding_size, 2 * hw * d, parallel, init_method=init, stride=2
        )
        self.out_we = RowParallelLinear(
            hw * dv_we, config.we_hidden_size, parallel, init_method=out_init
        )
        self.out_pe = RowParallelLinear(
            hp * dv_pe, config.pe_hidden_size, parallel, init_method=out_init
        )

        # 1x1 convolution [C_out, C_in] stored as one parameter per input group, each split
        # over tp along its input channels (dim 1) like the heads it reads, rows (output
        # channels) in canonical order [WE heads; PE heads]. Every piece is a plain
        # contiguous partition, so merge_partitions(dim=1) rebuilds the canonical tp=1
        # tensor: checkpoints do not depend on tp. Init: PyTorch's Conv2d default weight
        # (U(+-1/sqrt(C_in))) on the FULL tensor, then sliced. The bias starts at zero (as
        # every Megatron bias): a random positive bias larger than the tiny initial maps
        # would keep PReLU's inputs positive and leave its slope without a gradient.
        groups = CONV_INPUT_GROUPS[:4] if self.first_layer else CONV_INPUT_GROUPS
        c_out = config.conv_out_channels
        c_in = config.conv_in_channels(self.first_layer)
        conv_init = uniform_fan_in_init(c_in)
        full = torch.empty(c_out, c_in)
        conv_init(full)
        self.conv_groups = groups
        offset = 0
        for g in groups:
            width = _group_heads(config, g)
            p = nn.Parameter(torch.empty(c_out, width // tp))
            init_partitioned_(p, full[:, offset : offset + width], 1, rank, tp)
            self.register_parameter(f"conv_{g}", p)
            offset += width
        bias = torch.zeros(c_out)
        self.conv_bias_we = nn.Parameter(torch.empty(self.hw))
        self.conv_bias_pe = nn.Parameter(torch.empty(self.hp))
        init_partitioned_(self.conv_bias_we, bias[:hw], 0, rank, tp)
        init_partitioned_(self.conv_bias_pe, bias[hw:], 0, rank, tp)
        # PReLU: one slope per output channel (PyTorch's default 0.25).
        self.prelu_we = nn.Parameter(torch.full((self.hw,), 0.25))
        self.prelu_pe = nn.Parameter(torch.full((self.hp,), 0.25))
        for p in (self.prelu_we, self.prelu_pe):
            set_tensor_model_parallel_attributes(p, True, 0, 1)

        # Row order the reduce-scatter needs: chunk r = rank r's WE heads then its PE heads.
        perm = []
        for r in range(tp):
            perm += range(r * self.hw, (r + 1) * self.hw)
            perm += range(hw + r * self.hp, hw + (r + 1) * self.hp)
        self.register_buffer(
            "conv_out_perm", torch.tensor(perm, dtype=torch.long), persistent=False
        )
        self.attention_dropout = DropoutMask(config.attention_dropout)

    def conv_bias_vector(self) -> torch.Tensor:
        """[C_out] in the rank-major row order: this rank's bias in its own chunk, zeros in
        the other ranks' chunks."""
        local = torch.cat([self.conv_bias_we, self.conv_bias_pe])
        chunk = local.shape[0]
        return F.pad(local, (self.tp_rank * chunk, (self.tp_size - 1 - self.tp_rank) * chunk))

    def conv_weight(self) -> torch.Tensor:
        """This rank's conv weight [C_out (rank-major), C_in local], columns in the canonical
        input order: the maps', then the previous logits'."""
        w = torch.cat([getattr(self, f"conv_{g}") for g in self.conv_groups], dim=1)
        return w.index_select(0, self.conv_out_perm)

    def forward(
        self,
        h_we: torch.Tensor,  # [b, s, d_WE]
        h_pe: torch.Tensor,  # [b, s, d_PE]
        prev_logits: torch.Tensor | None,  # [hw+hp, b, s, s] (local heads), None in layer 1
        rel_index: torch.Tensor,  # [b, s, s] int64: compact bucket of (i, j)
        rel_rows: torch.Tensor,  # [n, rel] normalised relative embeddings in use
        key_padding: torch.Tensor | None,  # [1, b, 1, s] bool, True = padding key; None = none
    ):
        # Head-major layout [heads, b, s, ...] throughout: every map is then a contiguous
        # slice of one [C_in, b, s, s] buffer, the 1x1 conv is ONE [C_out, C_in] x
        # [C_in, b*s*s] GEMM, and the tp reduce-scatter splits dim 0 in contiguous chunks.
        b, s, _ = h_we.shape
        hw, hp, d = self.hw, self.hp, self.d
        dv_we, dv_pe = self.dv_we, self.dv_pe
        qkv_we = self.qkv_we(h_we).view(b, s, hw, 2 * d + dv_we).permute(2, 0, 1, 3)
        q_we, k_we, v_we = qkv_we.split([d, d, dv_we], dim=-1)  # [hw, b, s, d | d | dv_we]
        q_we, k_we = q_we.contiguous(), k_we.contiguous()
        qkv_pe = self.qkv_pe(h_pe).view(b, s, hp, 2 * d + dv_pe).permute(2, 0, 1, 3)
        q_pe, k_pe, v_pe = qkv_pe.split([d, d, dv_pe], dim=-1)  # [hp, b, s, d | d | dv_pe]
        q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()
        n = rel_rows.shape[0]
        kq_r = self.relative_kq(rel_rows).view(n, 2, hw, d).permute(1, 2, 0, 3)  # [2, hw, n, d]
        k_r, q_r = (t.contiguous() for t in kq_r.unbind(0))

        c_maps = 3 * hw + hp
        weight = self.conv_weight()  # [C_out, C_in local]
        w_prev = weight[:, c_maps:] if prev_logits is not None else None
        # 1x1 conv with this rank's input channels: partial sums for ALL output heads, with
        # this rank's bias added to its own chunk only, so the sum over ranks adds it once.
        partial = attention_logits(
            q_we,
            k_we,
            q_pe,
            k_pe,
            k_r,
            q_r,
            rel_index,
            prev_logits,
            weight[:, :c_maps],
            w_prev,
            self.conv_bias_vector(),
            1.0 / math.sqrt(d),
        )  # [C_out, b*s*s]
        fused = reduce_scatter_to_tp_region(partial, self.tp_group, dim=0)  # [hw+hp, b*s*s]
        slope = torch.cat([self.prelu_we, self.prelu_pe]).to(fused.dtype)
        # [1, C, N] puts the channels on dim 1, where F.prelu expects them, without a copy.
        logits = F.prelu(fused.unsqueeze(0), slope).view(hw + hp, b, s, s)

        # Local heads only: each rank must drop different elements -> tracker RNG.
        fork = (
            self.rng_tracker.fork(MODEL_PARALLEL_RNG)
            if self.rng_tracker is not None
            else nullcontext()
        )
        with fork:
            keep = self.attention_dropout(logits)  # [hw+hp, b, s, s] bool, None = no dropout
        ctx_we, ctx_pe = attention_probs(
            logits,
            key_padding,
            keep,
            v_we.contiguous(),
            v_pe.contiguous(),
            1.0 / (1.0 - self.attention_dropout.p),
        )  # [hw, b, s, dv_we], [hp, b, s, dv_pe]
        out_we = self.out_we(ctx_we.permute(1, 2, 0, 3).reshape(b, s, hw * dv_we))  # [b, s, d_WE]
        out_pe = self.out_pe(ctx_pe.permute(1, 2, 0, 3).reshape(b, s, hp * dv_pe))  # [b, s, d_PE]
        return out_we, out_pe, logits


class TacoLayer(nn.Module):
    """Joint attention, then for each stream separately (pseudo-Siamese, post-LN):
    h = LN(h + drop(attn)); h = LN(h + drop(FFN(h)))."""

    def __init__(
        self, config: TacoConfig, parallel: ParallelState, layer_number: int, rng_tracker=None
    ):
        super().__init__()
        eps = config.layernorm_epsilon
        self.attention = TacoAttention(config, parallel, layer_number, rng_tracker)
        self.we_attention_layernorm = LayerNorm(config.we_hidden_size, eps)
        self.pe_attention_layernorm = LayerNorm(config.pe_hidden_size, eps)
        mlp = {"init_std": config.init_method_std, "num_layers": config.num_layers}
        self.we_mlp = ParallelMLP(config.we_hidden_size, config.we_ffn_hidden_size, parallel, **mlp)
        self.pe_mlp = ParallelMLP(config.pe_hidden_size, config.pe_ffn_hidden_size, parallel, **mlp)
        self.we_output_layernorm = LayerNorm(config.we_hidden_size, eps)
        self.pe_output_layernorm = LayerNorm(config.pe_hidden_size, eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, h_we, h_pe, prev_logits, rel_index, rel_rows, key_padding):
        a_we, a_pe, logits = self.attention(
            h_we, h_pe, prev_logits, rel_index, rel_rows, key_padding
        )
        # Row-parallel outputs are all-reduced (replicated): default-RNG dropout.
        h_we = self.we_attention_layernorm(h_we + self.dropout(a_we))
        h_pe = self.pe_attention_layernorm(h_pe + self.dropout(a_pe))
        h_we = self.we_output_layernorm(h_we + self.dropout(self.we_mlp(h_we)))
        h_pe = self.pe_output_layernorm(h_pe + self.dropout(self.pe_mlp(h_pe)))
        return h_we, h_pe, logits


# ---------------------------------------------------------------------------------------
# Encoder


class TacoModel(nn.Module):
    """Encoder only: (input_ids, position_ids, attention_mask) -> (h_we [b, s, d_WE], h_pe [b, s, d_PE])."""

    def __init__(self, config: TacoConfig, parallel: ParallelState, rng_tracker=None) -> None:
        super().__init__()
        config.validate_parallel(parallel.tp_size)
        require_tracker_for_tp_dropout(config, parallel.tp_size, rng_tracker)
        self.config = config
        self.parallel = parallel
        self.rng_tracker = rng_tracker
        self.embeddings = TacoEmbeddings(config, parallel)
        self.layers = nn.ModuleList(
            TacoLayer(config, parallel, i + 1, rng_tracker) for i in range(config.num_layers)
        )
        if config.compile:
            compile_layers(self.layers, "TACO layers")

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        layout: tuple[int, int, bool] | None = None,
    ):
        """``layout``: (lo, hi, has_padding) of the batch as ``batch_layout`` gives it,
        computed on the host (TacoForPretraining.host_layout); None reads it from the
        device (one sync)."""
        config = self.config
        k = config.max_relative_distance
        h_we, h_pe = self.embeddings(input_ids, position_ids)
        # Computed once per forward, shared by all layers.
        lo, hi, has_padding = layout or batch_layout(position_ids, attention_mask, k)
        rel_index = relative_position_index(position_ids, k, lo, hi)  # [b, s, s]
        rows = relative_table_rows(lo, hi, config.mask_bucket, input_ids.device)
        rel_rows = self.embeddings.relative_rows(rows)  # [n, rel]
        # Batches without padding (full-length rows are common) skip the masking pass.
        key_padding = (
            ~attention_mask.bool()[None, :, None, :] if has_padding else None
        )  # [1, b, 1, s]

        logits = None
        for layer in self.layers:
            args = (rel_index, rel_rows, key_padding)
            if config.recompute_activations and torch.is_grad_enabled():
                if logits is None:
                    fn, inputs = _first_layer_fn(layer), (h_we, h_pe, *args)
                else:
                    fn, inputs = layer, (h_we, h_pe, logits, *args)
                h_we, h_pe, logits = checkpoint(fn, *inputs, tracker=self.rng_tracker)
            else:
                h_we, h_pe, logits = layer(h_we, h_pe, logits, *args)
        return h_we, h_pe


def _first_layer_fn(layer: TacoLayer):
    # Layer 1 has no previous logits; keep None out of the checkpointed argument list.
    def run(h_we, h_pe, rel_index, rel_rows, key_padding):
        return layer(h_we, h_pe, None, rel_index, rel_rows, key_padding)

    return run


# ---------------------------------------------------------------------------------------
# Pre-training model


class TacoForPretraining(nn.Module):
    """forward(batch) with the TACO batch dict (architecture.md: rows [0, b) carry MLM labels,
    rows [b, 2b) MPM labels) -> dict(loss = mlm_loss + mpm_loss, mlm_loss, mpm_loss, mlm_acc,
    mpm_acc, mlm_tokens, mpm_tokens). Each loss is the mean over its labelled tokens;
    accuracies are detached; token counts are int64 0-d tensors (ready for a dp all-reduce)."""

    def __init__(self, config: TacoConfig, parallel: ParallelState, rng_tracker=None) -> None:
        super().__init__()
        self.config = config
        self.taco = TacoModel(config, parallel, rng_tracker)
        self.heads = TacoPretrainingHeads(config, parallel)

    @staticmethod
    def host_layout(batch: dict[str, torch.Tensor]) -> dict[str, int | bool]:
        """What the forward needs on the host (models/common/host.py), from the batch."""
        hi_pos, lo_pos, has_padding = position_stats(batch["position_ids"], batch["attention_mask"])
        return {
            "position_max": hi_pos,
            "position_min": lo_pos,
            "has_padding": has_padding,
            "mlm_labels": labelled_count(batch["mlm_labels"]),
            "mpm_labels": labelled_count(batch["mpm_labels"]),
        }

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        host = host_numbers(batch, self.host_layout)
        k = self.config.max_relative_distance
        layout = (*bucket_range(host["position_max"], host["position_min"], k), host["has_padding"])
        h_we, h_pe = self.taco(
            batch["input_ids"], batch["position_ids"], batch["attention_mask"], layout
        )
        we = h_we.flatten(0, 1)  # [b*s, d_WE]
        pe = h_pe.flatten(0, 1)  # [b*s, d_PE]
        emb = self.taco.embeddings

        def labelled(key: str):
            # Gather the labelled positions before the heads (their count from the host).
            h_we, target, idx = gather_labelled(we, batch[key], host[key])
            return torch.cat([h_we, pe.index_select(0, idx)], dim=-1), target  # [N, d_WE+d_PE]

        x, target = labelled("mlm_labels")
        mlm_loss_tok, mlm_correct = self.heads.mlm(x, target, emb.word_embeddings.weight)
        x, target = labelled("mpm_labels")
        mpm_loss_tok, mpm_correct = self.heads.mpm(x, target, emb.position_embeddings)

        mean = masked_mean
        mlm_loss, mpm_loss = mean(mlm_loss_tok), mean(mpm_loss_tok)
        monitoring = {}
        if not self.training:  # the learning monitor's inputs: the MLM rows' [h_WE; h_PE]
            rows = h_we.shape[0] // 2
            monitoring = monitoring_outputs(
                torch.cat([h_we[:rows], h_pe[:rows]], dim=-1),
                batch["attention_mask"][:rows],
                mlm=(batch["mlm_labels"], self.config.vocab_size),
                mpm=(batch["mpm_labels"], self.config.max_position_embeddings),
            )
        return {
            **monitoring,
            "loss": mlm_loss + mpm_loss,
            "mlm_loss": mlm_loss,
            "mpm_loss": mpm_loss,
            "mlm_acc": mean(mlm_correct.float()).detach(),
            "mpm_acc": mean(mpm_correct.float()).detach(),
            # torch.full, not torch.tensor: no blocking host->device copy.
            "mlm_tokens": torch.full((), mlm_correct.numel(), device=mlm_loss.device),
            "mpm_tokens": torch.full((), mpm_correct.numel(), device=mpm_loss.device),
        }

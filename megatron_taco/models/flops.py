"""Model FLOPs of a TACO training step, counted the ELECTRA way.

ELECTRA (Clark et al. 2020, flops_computation.py) counts 2 FLOPs per multiply-add of every
matmul with parameters, per token, plus the attention products, and takes the backward pass
as twice the forward: a training step is 3x the forward. Element-wise work (LayerNorm,
GELU, softmax, PReLU, dropout, gathers) is ignored, as ELECTRA ignores it.
"""

from __future__ import annotations

from megatron_taco.models.config import TacoConfig


def relative_buckets_used(config: TacoConfig, seq_length: int) -> int:
    # What taco.relative_bucket_range keeps for positions 0..s-1: the 2*min(s-1, k)+1
    # distances that can occur, plus the masked-position bucket.
    return 2 * min(seq_length - 1, config.max_relative_distance) + 2


def taco_forward_flops(
    config: TacoConfig,
    seq_length: int,
    rows: int,
    labelled_fraction: float = 0.15,
    vocab_size: int | None = None,
) -> float:
    s, d = seq_length, config.kv_channels
    dw, dp = config.we_hidden_size, config.pe_hidden_size
    hw, hp = config.we_attention_heads, config.pe_attention_heads
    vocab = vocab_size if vocab_size is not None else config.vocab_size
    n = relative_buckets_used(config, s)

    # Per token per layer: parameter matmuls.
    per_token_layer = 2 * (
        dw * 3 * hw * d  # Q, K, V of the WE stream
        + dp * 3 * hp * d  # Q, K, V of the PE stream
        + hw * d * dw  # W_WE^O
        + hp * d * dp  # W_PE^O
        + 2 * dw * config.we_ffn_hidden_size  # WE FFN in + out
        + 2 * dp * config.pe_ffn_hidden_size  # PE FFN in + out
    )
    # Per sequence per layer: products over (query, key) pairs.
    c_in = config.conv_in_channels(first_layer=False)
    c_in_first = config.conv_in_channels(first_layer=True)
    c_out = config.conv_out_channels
    per_seq_layer = 2 * (
        hw * s * s * d  # content Q_WE K_WE^T
        + hp * s * s * d  # position Q_PE K_PE^T
        + 2 * hw * s * n * d  # c2p Q_WE K_R^T and p2c K_WE Q_R^T against the n buckets in use
        + (hw + hp) * s * s * d  # softmax-weighted values
    )
    conv = 2 * c_out * s * s * (c_in * (config.num_layers - 1) + c_in_first)  # 1x1 conv, all layers
    # Per step per layer, independent of the batch: projecting the n relative rows.
    rel_proj = 2 * n * config.relative_embedding_size * 2 * hw * d

    # Heads on labelled tokens only: rows are half MLM rows, half MPM rows, each with
    # ``labelled_fraction`` of its tokens labelled; decoders are the tied embeddings.
    hidden = config.hidden_size
    mlm_head = 2 * (hidden * dw + dw * vocab)
    mpm_head = 2 * (hidden * dp + dp * config.max_position_embeddings)
    labelled = labelled_fraction * s * rows / 2

    tokens = rows * s
    return float(
        tokens * per_token_layer * config.num_layers
        + rows * (per_seq_layer * config.num_layers + conv)
        + rel_proj * config.num_layers
        + labelled * (mlm_head + mpm_head)
    )


def taco_train_flops(
    config: TacoConfig,
    seq_length: int,
    rows: int,
    labelled_fraction: float = 0.15,
    vocab_size: int | None = None,
) -> float:
    # Backward = 2x forward (gradients w.r.t. inputs and w.r.t. weights); recompute, when
    # on, is overhead and not counted (model FLOPs, not hardware FLOPs).
    return 3.0 * taco_forward_flops(config, seq_length, rows, labelled_fraction, vocab_size)

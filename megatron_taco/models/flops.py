"""FLOPs counters: the model FLOPs that run (throughput, MFU), and the ELECTRA convention
for the papers' tables.

Two conventions live here, for two different questions.

**Model FLOPs** (``taco_forward_flops`` / ``taco_train_flops``, ``sas_forward_flops`` /
``sas_train_flops_executed``, ``encoder_forward_flops`` for fine-tuning) feed the trainer's
TFLOP/s and MFU and the benchmarks: 2 FLOPs per multiply-add of the matmuls that run, as
torch.utils.flop_counter.FlopCounterMode counts them (tests/unit/test_flops.py holds each
model to it), backward = 2x forward, so a step is 3x the forward. Element-wise work is
ignored, recompute is not counted, and an embedding lookup is a gather, not a matmul. Heads
run where the model runs them (MLM on the labelled tokens, RTD on every token); per-forward
work (projecting the relative rows) once per micro-batch. Q, K and the relative projections
are kv_channels wide per head; V, the weighted values and W^O use the value head sizes
(``value_channels``).

**ELECTRA convention** (``bert_train_flops``, ``electra_train_flops``, ``sas_train_flops``,
``taco_electra_train_flops``) reproduces how the SAS paper (Tables 1-2) and ELECTRA (Clark
et al. 2020, google-research/electra ``flops_computation.py``) report pre-training compute,
so our runs compare with their tables:

* a matmul [m, n] x [n] costs 2mn; embedding lookups are dense one-hot matmuls (2ev);
* backward = forward, a step is 2x the forward;
* element-wise constants per element: dropout 4, LayerNorm 5, GELU 8, softmax 5, bias add
  and residual add 1, attention-score scale 1;
* the MLM output (dense h->e, GELU, LayerNorm, decoder 2ev, softmax 5v, target 2v) runs on
  ``output_frac`` = 15.625% of the tokens; the binary head (RTD) costs 2h^2 + h + 8h + 2h per
  token on every token;
* ELECTRA's generator shares the discriminator's embedding size when embeddings are tied.

Departures from ELECTRA's script (its only version, commit 62e478a):

* the post-attention LayerNorm costs 5 per element (5h). The script counts a bare 5 there;
  with 5h we reproduce every number the SAS paper prints to its 4 digits (BERT-Small
  1.274e18, BERT-Small-1.5x 1.911e18, ELECTRA-Small 1.294e18, ELECTRA-Small++ 2.403e19,
  SAS-Small 1.279e18, BERT-Base 6.430e19, ELECTRA-Base 6.426e19), while the bare 5 gives
  SAS-Small 1.278e18, BERT-Base 6.428e19 and ELECTRA-Base 6.425e19;
* the softmax-weighted values and W^O are sized by heads x head_size instead of hidden (the
  same number whenever heads x head_size = hidden, as in all of ELECTRA's models).

**SAS^DA** (DeBERTa's disentangled attention with DeBERTa-v2's ``share_att_key=True``) adds,
per layer, with ``2k`` relative rows (``relative_span`` = k, default the sequence length:
DeBERTa's att_span = min(max_relative_positions, s) with max_relative_positions >= s; with
DeBERTa-v2's ``position_buckets`` > 0 pass k = position_buckets):

* dropout on the 2k rows and their projection by the shared W_Q and W_K (with bias):
  4 * 2k * h + 2 * (2 * 2k * h * a + 2k * a), a = heads x head_size. Counted once per step
  (per layer), not per sequence: the rows are the same for every sequence of the batch,
  so a step projects them once;
* c2p and p2c: each query (key) is scored against all 2k rows and the pair's row is
  gathered, as DeBERTa computes them: 2 * s * 2k * head_size per head per sequence for
  each of the two. Gathers are lookups and cost nothing, as in ELECTRA;
* the two gathered s x s maps are each scaled and added to the content scores: 4 per
  (head, query, key). The content map's scale and the softmax/dropout are already in the
  block count (the softmax runs once, over the summed scores);
* LayerNorm of the 2k relative rows (``norm_rel_ebd="layer_norm"``), once per step: 5 * 2k * h.

Absolute position embeddings stay in the input count (ELECTRA's 2e(s+2)), so SAS^DA minus
SAS is exactly the list above. The paper does not publish its formula for these terms; its
SAS^DA-Small 1.385e18 and SAS^DA-Base (833K steps) 6.226e19 are 0.15% above this count
(1.383e18, 6.217e19), and DeBERTa-Small/Base (BERT + these terms: 1.379e18, 7.433e19) sit
0.15% below its 1.381e18 and 7.443e19, so it counts a little more per pair than we do.

**TACO in the ELECTRA convention** counts what ``models/taco/model.py`` computes: per stream
Q/K (kv_channels) and V (value channels) projections, W^O, FFN, residuals and LayerNorms;
the content, position, c2p and p2c maps (c2p/p2c against the n relative rows in use, see
``relative_buckets_used``) with one scale per map element; the 1x1 conv, 2 * C_in * C_out +
C_out per (i, j) pair; PReLU (3: test, multiply, select), softmax and dropout on the C_out
fused maps; the relative rows' LayerNorm once per step and their per-layer projection once
per step. Each TACO sample is two rows (MLM row, MPM row) through the encoder; the MLM head
runs on ``output_frac`` of the MLM row's tokens, the MPM head (decoder over the
max_position_embeddings positions) on ``output_frac`` of the MPM row's tokens. The input
position lookup is dense over the s + 1 rows that can occur (positions and the mask row),
as ELECTRA counts positions over s rows.

Configs are duck-typed (see ``TacoSizes``); no config class is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

DROPOUT_FLOPS = 4  # random number, compare, mask multiply, rescale
LAYER_NORM_FLOPS = 5  # mean, variance (square + sum), shift, scale
ACTIVATION_FLOPS = 8  # GELU (tanh form)
SOFTMAX_FLOPS = 5  # max-subtract, exp, sum, divide
PRELU_FLOPS = 3  # sign test, multiply by the slope, select
ELECTRA_OUTPUT_FRAC = 0.15625


class TacoSizes(Protocol):
    """The TACO config attributes these counters read. Value head sizes are optional: the
    ``we/pe_value_size`` properties if present, else ``we/pe_value_channels`` (None =
    hidden / heads), else ``kv_channels`` (see ``value_channels``)."""

    num_layers: int
    we_hidden_size: int
    pe_hidden_size: int
    we_attention_heads: int
    pe_attention_heads: int
    kv_channels: int
    we_ffn_hidden_size: int
    pe_ffn_hidden_size: int
    relative_embedding_size: int
    max_relative_distance: int
    max_position_embeddings: int
    vocab_size: int

    @property
    def conv_out_channels(self) -> int: ...

    def conv_in_channels(self, first_layer: bool) -> int: ...


# ---------------------------------------------------------------------------------------
# TACO throughput model FLOPs (MFU)


def relative_buckets_used(config: TacoSizes, seq_length: int) -> int:
    # What taco.relative_bucket_range keeps for positions 0..s-1: the 2*min(s-1, k)+1
    # distances that can occur, plus the masked-position bucket.
    return 2 * min(seq_length - 1, config.max_relative_distance) + 2


def value_channels(config: TacoSizes) -> tuple[int, int]:
    """(WE, PE) value/output head sizes."""
    return _value_size(config, "we"), _value_size(config, "pe")


def _value_size(config: TacoSizes, stream: str) -> int:
    # The config's own resolution first; a ``*_value_channels`` of None means hidden / heads
    # (TacoConfig's default); configs without the field have values as wide as keys.
    resolved = getattr(config, f"{stream}_value_size", None)
    if resolved is not None:
        return resolved
    name = f"{stream}_value_channels"
    if not hasattr(config, name):
        return config.kv_channels
    explicit = getattr(config, name)
    if explicit is not None:
        return explicit
    return getattr(config, f"{stream}_hidden_size") // getattr(config, f"{stream}_attention_heads")


def taco_forward_flops(
    config: TacoSizes,
    seq_length: int,
    rows: int,
    labelled_fraction: float = 0.15,
    vocab_size: int | None = None,
    forwards: int = 1,
) -> float:
    """``rows`` encoder rows (a TACO sample is two) in ``forwards`` micro-batches."""
    s, d = seq_length, config.kv_channels
    vw, vp = value_channels(config)
    dw, dp = config.we_hidden_size, config.pe_hidden_size
    hw, hp = config.we_attention_heads, config.pe_attention_heads
    vocab = vocab_size if vocab_size is not None else config.vocab_size
    n = relative_buckets_used(config, s)

    # Per token per layer: parameter matmuls.
    per_token_layer = 2 * (
        dw * hw * (2 * d + vw)  # Q, K, V of the WE stream
        + dp * hp * (2 * d + vp)  # Q, K, V of the PE stream
        + hw * vw * dw  # W_WE^O
        + hp * vp * dp  # W_PE^O
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
        + s * s * (hw * vw + hp * vp)  # softmax-weighted values
    )
    conv = 2 * c_out * s * s * (c_in * (config.num_layers - 1) + c_in_first)  # 1x1 conv, all layers
    # Per step per layer, independent of the batch: projecting the n relative rows.
    rel_proj = 2 * n * config.relative_embedding_size * 2 * hw * d

    # Heads on labelled tokens only: rows are half MLM rows, half MPM rows, each with
    # ``labelled_fraction`` of its tokens labelled; decoders are the tied embeddings.
    hidden = dw + dp
    mlm_head = 2 * (hidden * dw + dw * vocab)
    mpm_head = 2 * (hidden * dp + dp * config.max_position_embeddings)
    labelled = labelled_fraction * s * rows / 2

    tokens = rows * s
    return float(
        tokens * per_token_layer * config.num_layers
        + rows * (per_seq_layer * config.num_layers + conv)
        + rel_proj * config.num_layers * forwards
        + labelled * (mlm_head + mpm_head)
    )


def taco_train_flops(*args, **kwargs) -> float:
    """A training step's model FLOPs, for taco_forward_flops' arguments."""
    # Backward = 2x forward (gradients w.r.t. inputs and w.r.t. weights); recompute, when
    # on, is overhead and not counted (model FLOPs, not hardware FLOPs).
    return 3.0 * taco_forward_flops(*args, **kwargs)


def sas_forward_flops(
    shape: EncoderShape,
    rows: int,
    mlm_tokens: float,
    *,
    relative_rows: int = 0,
    rtd: bool = True,
    forwards: int = 1,
) -> float:
    """SAS / SAS^DA forward matmul FLOPs of ``rows`` sequences of ``shape.seq_length`` in
    ``forwards`` micro-batches: the encoder, the MLM head (transform and tied decoder over
    ``shape.vocab_size``, the padded vocabulary the decoder multiplies) on ``mlm_tokens``
    labelled tokens in all, the RTD head on every token if ``rtd``. SAS^DA
    (``relative_rows`` = n > 0, the table rows a length-s batch uses): c2p and p2c, each
    2 s n d per head and sequence, and the n rows through each layer's Q and K once per
    forward."""
    s, h, e, a = shape.seq_length, shape.hidden, shape.embedding_size, shape.attention_width
    per_token = 2 * e * h if e != h else 0  # embedding projection; the lookup is a gather
    per_token += shape.layers * 2 * (3 * h * a + a * h + 2 * h * shape.ffn)
    per_token += (2 * h * h + 2 * h) if rtd else 0  # RTD dense + prediction
    per_row = shape.layers * 2 * (2 * s * s * a + 2 * s * relative_rows * a)
    per_forward = shape.layers * 2 * relative_rows * h * 2 * a
    mlm = 2 * (h * e + e * shape.vocab_size)
    return float(rows * (s * per_token + per_row) + forwards * per_forward + mlm_tokens * mlm)


def sas_train_flops_executed(*args, **kwargs) -> float:
    """A training step's model FLOPs, for sas_forward_flops' arguments: 3x the forward (see
    taco_train_flops)."""
    return 3.0 * sas_forward_flops(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# ELECTRA convention: shared pieces (forward FLOPs per token unless said)


@dataclass(frozen=True)
class EncoderShape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    head_size: int
    embedding_size: int
    vocab_size: int = 30522
    seq_length: int = 128

    @classmethod
    def electra(
        cls,
        hidden: int,
        layers: int,
        seq_length: int = 512,
        embedding_size: int | None = None,
        vocab_size: int = 30522,
    ) -> EncoderShape:
        """ELECTRA's defaults: FFN 4h, heads of 64 (at least one), embedding = hidden,
        sequence 512."""
        heads = max(hidden // 64, 1)
        return cls(
            layers=layers,
            hidden=hidden,
            ffn=4 * hidden,
            heads=heads,
            head_size=hidden // heads,
            embedding_size=hidden if embedding_size is None else embedding_size,
            vocab_size=vocab_size,
            seq_length=seq_length,
        )

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_size


def sas_encoder_shape(config, seq_length: int) -> EncoderShape:
    """A SasConfig's encoder (duck-typed)."""
    return EncoderShape(
        layers=config.num_layers,
        hidden=config.hidden_size,
        ffn=config.ffn_hidden_size,
        heads=config.num_attention_heads,
        head_size=config.hidden_size // config.num_attention_heads,
        embedding_size=config.embedding_size,
        vocab_size=config.vocab_size,
        seq_length=seq_length,
    )


def generator_shape(discriminator: EncoderShape, divisor: int = 4) -> EncoderShape:
    """ELECTRA's generator: hidden / divisor, same depth, ELECTRA defaults otherwise."""
    d = discriminator
    return EncoderShape.electra(
        d.hidden // divisor, d.layers, d.seq_length, d.embedding_size, d.vocab_size
    )


def _projections(hidden: int, qk_width: int, v_width: int) -> float:
    # Q, K (qk_width each) and V (v_width) with their biases.
    width = 2 * qk_width + v_width
    return 2 * hidden * width + width


def _attention_output(v_width: int, hidden: int) -> float:
    # W^O + bias, dropout, residual, LayerNorm.
    return (
        2 * v_width * hidden + hidden + DROPOUT_FLOPS * hidden + hidden + LAYER_NORM_FLOPS * hidden
    )


def _feed_forward(hidden: int, ffn: int) -> float:
    inner = 2 * hidden * ffn + ffn + ACTIVATION_FLOPS * ffn
    return (
        inner
        + 2 * ffn * hidden
        + hidden
        + DROPOUT_FLOPS * hidden
        + hidden
        + LAYER_NORM_FLOPS * hidden
    )


def _lm_output(hidden: int, width: int, classes: int) -> float:
    # Prediction head on one labelled token: dense hidden -> width, GELU, LayerNorm, decoder
    # over ``classes`` (tied), softmax and picking the target.
    transform = 2 * hidden * width + width + ACTIVATION_FLOPS * width + LAYER_NORM_FLOPS * width
    return transform + 2 * width * classes + SOFTMAX_FLOPS * classes + 2 * classes


def block_flops(shape: EncoderShape) -> float:
    """One transformer layer's forward FLOPs per token."""
    h, s, a, heads = shape.hidden, shape.seq_length, shape.attention_width, shape.heads
    scores = 2 * a * s  # Q K^T over all s keys
    score_elementwise = (SOFTMAX_FLOPS + DROPOUT_FLOPS + 1) * s * heads  # + 1: the scale
    values = 2 * a * s
    return (
        _projections(h, a, a)
        + scores
        + score_elementwise
        + values
        + _attention_output(a, h)
        + _feed_forward(h, shape.ffn)
    )


def input_embedding_flops(shape: EncoderShape) -> float:
    """Forward FLOPs per token of the input embeddings (dense lookups)."""
    e, h, s = shape.embedding_size, shape.hidden, shape.seq_length
    flops = 2 * e * shape.vocab_size  # word lookup as a one-hot matmul
    flops += 2 * e * (s + 2) + 2 * e  # position (s rows) and token-type (2 rows) lookups, adds
    flops += LAYER_NORM_FLOPS * e + DROPOUT_FLOPS * e
    if e != h:
        flops += 2 * e * h + h  # projection to the hidden size
    return flops


def output_softmax_flops(shape: EncoderShape, output_frac: float = ELECTRA_OUTPUT_FRAC) -> float:
    """Forward FLOPs per token of the MLM output, averaged over all tokens."""
    return output_frac * _lm_output(shape.hidden, shape.embedding_size, shape.vocab_size)


def binary_head_flops(shape: EncoderShape) -> float:
    """Forward FLOPs per token of the RTD head: dense h -> h, GELU, dense h -> 1."""
    h = shape.hidden
    return 2 * h * h + h + ACTIVATION_FLOPS * h + 2 * h


def _encoder_per_token(shape: EncoderShape) -> float:
    return shape.layers * block_flops(shape) + input_embedding_flops(shape)


def _train(per_token: float, per_step: float, shape: EncoderShape, batch: int, steps: int) -> float:
    # 2x: backward = forward in the ELECTRA convention.
    return 2.0 * steps * (batch * shape.seq_length * per_token + per_step)


# ---------------------------------------------------------------------------------------
# ELECTRA convention: models


def bert_train_flops(
    shape: EncoderShape,
    batch_size: int,
    train_steps: int,
    output_frac: float = ELECTRA_OUTPUT_FRAC,
) -> float:
    per_token = _encoder_per_token(shape) + output_softmax_flops(shape, output_frac)
    return _train(per_token, 0.0, shape, batch_size, train_steps)


def electra_train_flops(
    discriminator: EncoderShape,
    generator: EncoderShape,
    batch_size: int,
    train_steps: int,
    tied_embeddings: bool = True,
    output_frac: float = ELECTRA_OUTPUT_FRAC,
) -> float:
    """Discriminator (encoder + binary head) + generator (encoder + MLM output); tied
    embeddings give the generator the discriminator's embedding size."""
    if tied_embeddings:
        generator = replace(generator, embedding_size=discriminator.embedding_size)
    disc = _encoder_per_token(discriminator) + binary_head_flops(discriminator)
    return _train(disc, 0.0, discriminator, batch_size, train_steps) + bert_train_flops(
        generator, batch_size, train_steps, output_frac
    )


def disentangled_attention_flops(
    shape: EncoderShape, batch_size: int, relative_span: int | None = None
) -> float:
    """Forward FLOPs per step that DeBERTa's disentangled attention (shared Q/K projections)
    adds to ``batch_size`` sequences, all layers; the terms are listed in the module doc."""
    s, h, a, heads = shape.seq_length, shape.hidden, shape.attention_width, shape.heads
    rows = 2 * (s if relative_span is None else relative_span)
    per_token = 2 * (2 * rows * a)  # c2p and p2c against every relative row
    per_token += 4 * s * heads  # scale and add of the two gathered maps
    per_step = DROPOUT_FLOPS * rows * h + 2 * (2 * rows * h * a + rows * a)
    per_layer = batch_size * s * per_token + per_step
    return shape.layers * per_layer + LAYER_NORM_FLOPS * rows * h


def sas_train_flops(
    shape: EncoderShape,
    batch_size: int,
    train_steps: int,
    disentangled_attention: bool = False,
    relative_span: int | None = None,
    output_frac: float = ELECTRA_OUTPUT_FRAC,
) -> float:
    """One encoder forward per step with the MLM output on ``output_frac`` of the tokens and
    the RTD head on all of them (SAS samples replacements from the MLM head itself)."""
    per_token = _encoder_per_token(shape) + output_softmax_flops(shape, output_frac)
    per_token += binary_head_flops(shape)
    per_step = (
        disentangled_attention_flops(shape, batch_size, relative_span)
        if disentangled_attention
        else 0.0
    )
    return _train(per_token, per_step, shape, batch_size, train_steps)


# ---------------------------------------------------------------------------------------
# TACO in the ELECTRA convention


def _taco_layer_per_token(config: TacoSizes, s: int, n: int, first_layer: bool) -> float:
    d, (vw, vp) = config.kv_channels, value_channels(config)
    dw, dp = config.we_hidden_size, config.pe_hidden_size
    hw, hp = config.we_attention_heads, config.pe_attention_heads
    c_in, c_out = config.conv_in_channels(first_layer=first_layer), config.conv_out_channels
    streams = (
        _projections(dw, hw * d, hw * vw)
        + _projections(dp, hp * d, hp * vp)
        + _attention_output(hw * vw, dw)
        + _attention_output(hp * vp, dp)
        + _feed_forward(dw, config.we_ffn_hidden_size)
        + _feed_forward(dp, config.pe_ffn_hidden_size)
    )
    maps = 2 * d * s * (hw + hp)  # content and position maps
    maps += 2 * 2 * hw * d * n  # c2p and p2c against the n relative rows in use
    maps += (3 * hw + hp) * s  # one scale per element of the fresh maps
    conv = (2 * c_in * c_out + c_out) * s
    fused = (PRELU_FLOPS + SOFTMAX_FLOPS + DROPOUT_FLOPS) * c_out * s
    values = 2 * s * (hw * vw + hp * vp)
    return streams + maps + conv + fused + values


def _taco_heads_per_row_pair(config: TacoSizes, s: int, output_frac: float) -> float:
    # One MLM row and one MPM row; each head runs on output_frac of its row's tokens.
    hidden = config.we_hidden_size + config.pe_hidden_size
    mlm = _lm_output(hidden, config.we_hidden_size, config.vocab_size)
    mpm = _lm_output(hidden, config.pe_hidden_size, config.max_position_embeddings)
    return output_frac * s * (mlm + mpm)


def taco_electra_train_flops(
    config: TacoSizes,
    seq_length: int,
    batch_size: int,
    train_steps: int,
    output_frac: float = ELECTRA_OUTPUT_FRAC,
) -> float:
    """TACO pre-training FLOPs in the ELECTRA convention; ``batch_size`` counts TACO
    samples, each an MLM row and an MPM row through the encoder."""
    if config.vocab_size < 1:
        raise ValueError("vocab_size is not set on the config (0 = taken from the tokenizer)")
    s, n = seq_length, relative_buckets_used(config, seq_length)
    dw, dp = config.we_hidden_size, config.pe_hidden_size
    embed = 2 * dw * config.vocab_size + 2 * dp * (s + 1)  # dense lookups
    embed += (LAYER_NORM_FLOPS + DROPOUT_FLOPS) * (dw + dp)
    layers = _taco_layer_per_token(config, s, n, True)
    layers += (config.num_layers - 1) * _taco_layer_per_token(config, s, n, False)
    per_row = s * (embed + layers)
    # Per step, the same for every row: the relative rows' LayerNorm once, and their
    # projection to K_R, Q_R (with bias) in every layer.
    rel, qk = config.relative_embedding_size, 2 * config.we_attention_heads * config.kv_channels
    per_step = LAYER_NORM_FLOPS * n * rel + config.num_layers * (2 * n * rel * qk + n * qk)
    per_sample = 2 * per_row + _taco_heads_per_row_pair(config, s, output_frac)
    return 2.0 * train_steps * (batch_size * per_sample + per_step)

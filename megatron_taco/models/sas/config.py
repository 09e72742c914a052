"""SAS model configuration (Table 5 of the SAS paper for the small and base presets).

One post-LN encoder in two flavours: SAS / SAS^c (BERT/ELECTRA attention, absolute
position embeddings added to the input) and SAS^DA (``--disentangled-attention``:
DeBERTa-v2's attention with relative positions shared by all layers, Q/K projections
shared with the content, optional log buckets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_taco.arguments import flag_of, require
from megatron_taco.models.common.config import EncoderConfig, opt

BERT_LAYERNORM_EPSILON = 1e-12  # BERT, ELECTRA
DEBERTA_LAYERNORM_EPSILON = 1e-7  # DeBERTa-v2/v3 (transformers' DebertaV2Config default)
OUTPUT_LAYER_INITS = ("megatron", "electra")

# Presets override only architecture sizes; dropout/init/eps keep the defaults.
# "small"/"base" are Table 5's "All Other Small Models" / "All Base Models" columns.
# "tiny" exists for tests: embedding_size != hidden_size exercises the projection, and the
# head size 12 makes sqrt(3 d) exact in float32 (DeBERTa computes that scale in float32).
PRESETS: dict[str, dict[str, Any]] = {
    "base": dict(
        num_layers=12,
        hidden_size=768,
        ffn_hidden_size=3072,
        num_attention_heads=12,
        embedding_size=768,
        max_position_embeddings=512,
    ),
    "small": dict(
        num_layers=12,
        hidden_size=256,
        ffn_hidden_size=1024,
        num_attention_heads=4,
        embedding_size=256,
        max_position_embeddings=512,
    ),
    "tiny": dict(
        num_layers=2,
        hidden_size=48,
        ffn_hidden_size=96,
        num_attention_heads=4,
        embedding_size=32,
        max_position_embeddings=64,
        position_buckets=16,
        max_relative_positions=64,
    ),
}


@dataclass(frozen=True)
class SasConfig(EncoderConfig):
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = PRESETS
    ARGS_TITLE: ClassVar[str] = "SAS model"
    # The SAS paper's Table 5 (small: batch 512, base: 256); tiny as small.
    DEFAULT_LR: ClassVar[dict[str, float]] = {"tiny": 1e-3, "small": 1e-3, "base": 2e-4}

    num_layers: int = opt(12, "Number of encoder layers.", "--num-layers")
    hidden_size: int = opt(768, "Hidden size of the encoder.", "--hidden-size")
    ffn_hidden_size: int = opt(3072, "FFN inner hidden size.", "--ffn-hidden-size")
    num_attention_heads: int = opt(
        12, "Attention heads (head size = hidden size / heads).", "--num-attention-heads"
    )
    embedding_size: int = opt(
        768,
        "Width of the token (and absolute position) embeddings; a projection to the hidden "
        "size is added when they differ (ELECTRA's factorised embedding).",
        "--embedding-size",
    )
    max_position_embeddings: int = opt(
        512, "Longest sequence (rows of the absolute position table).", "--max-position-embeddings"
    )
    disentangled_attention: bool = opt(
        False,
        "SAS^DA: DeBERTa-v2's disentangled attention (c2c + c2p + p2c, relative positions "
        "projected by each layer's shared query/key projections).",
        "--disentangled-attention",
    )
    position_buckets: int = opt(
        256,
        "SAS^DA: DeBERTa's log-bucketed relative positions (table of 2 x this rows); 0 = plain "
        "clipping at --max-relative-positions.",
        "--position-buckets",
    )
    max_relative_positions: int | None = opt(
        None,
        "SAS^DA: largest relative distance of the log buckets, or the clipping distance when "
        "--position-buckets is 0 (default: --max-position-embeddings).",
        "--max-relative-positions",
    )
    position_biased_input: bool | None = opt(
        None,
        "Add absolute position embeddings to the input (default: on for SAS, off for SAS^DA, "
        "as in DeBERTa-v2/v3).",
        "--position-biased-input",
    )
    layernorm_epsilon: float | None = opt(
        None,
        "LayerNorm epsilon (default: 1e-12 as BERT/ELECTRA for SAS and SAS^c, 1e-7 as "
        "DeBERTa for SAS^DA).",
        "--layernorm-epsilon",
    )
    output_layer_init: str = opt(
        "megatron",
        "Init of the attention-output and FFN-output projections: 'megatron' draws them from "
        "normal(--init-method-std / sqrt(2 * layers)) (Megatron-LM's scaled init); 'electra' "
        "from normal(--init-method-std), as ELECTRA and DeBERTa initialise every linear layer.",
        "--output-layer-init",
        choices=OUTPUT_LAYER_INITS,
    )
    gradient_disentangled_embedding: bool = opt(
        False,
        "A departure from the paper, off by default: DeBERTaV3's gradient-disentangled "
        "embedding sharing for one network. The encoder reads stop_gradient(E) + E_delta "
        "(E_delta initialised to 0), so the word embedding E is trained only through the "
        "tied MLM decoder and the RTD loss never reaches it (nor does the MLM loss through "
        "the input: it trains E_delta).",
        "--gradient-disentangled-embedding",
    )
    model_size: str | None = opt(
        None,
        "Start from a preset (Table 5); explicitly given flags override it.",
        "--model-size",
        choices=tuple(PRESETS),
    )

    def __post_init__(self) -> None:
        cls = type(self)
        self.require_positive_ints(
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "embedding_size",
            "max_position_embeddings",
        )
        require(
            self.hidden_size % self.num_attention_heads == 0,
            cls,
            "num_attention_heads",
            f"{flag_of(cls, 'hidden_size')} {self.hidden_size} is not divisible by "
            f"{self.num_attention_heads} heads",
        )
        if self.max_relative_positions is not None:
            self.require_positive_ints("max_relative_positions")
        self._check_buckets()
        # Without absolute positions only the disentangled attention sees token order; a
        # plain BERT encoder would be a bag of words.
        require(
            self.position_biased_input is not False or self.disentangled_attention,
            cls,
            "position_biased_input",
            "without --disentangled-attention the encoder would have no position information "
            "(order-blind); drop --no-position-biased-input or add --disentangled-attention",
        )
        require(
            self.output_layer_init in OUTPUT_LAYER_INITS,
            cls,
            "output_layer_init",
            f"must be one of {OUTPUT_LAYER_INITS}, got {self.output_layer_init!r}",
        )
        self.validate_common()

    def _check_buckets(self) -> None:
        cls, buckets = type(self), self.position_buckets
        require(
            isinstance(buckets, int) and not isinstance(buckets, bool) and buckets >= 0,
            cls,
            "position_buckets",
            f"must be a non-negative integer (0 = no buckets), got {buckets!r}",
        )
        if buckets == 0:
            return
        # The log buckets divide by log((max_relative_positions - 1) / (buckets / 2)): it must
        # be positive, i.e. the log range must start beyond the exact range.
        require(buckets >= 2, cls, "position_buckets", f"must be 0 or >= 2, got {buckets}")
        require(
            self.relative_positions > buckets // 2 + 1,
            cls,
            "max_relative_positions",
            f"{self.relative_positions} must exceed {flag_of(cls, 'position_buckets')} / 2 + 1 "
            f"= {buckets // 2 + 1} for the log buckets",
        )

    # -- derived sizes -------------------------------------------------------------------

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def uses_position_embeddings(self) -> bool:
        """--position-biased-input resolved: absolute positions feed the input."""
        if self.position_biased_input is None:
            return not self.disentangled_attention
        return self.position_biased_input

    @property
    def norm_epsilon(self) -> float:
        """--layernorm-epsilon resolved: DeBERTa's 1e-7 for SAS^DA, BERT's 1e-12 otherwise."""
        if self.layernorm_epsilon is not None:
            return self.layernorm_epsilon
        if self.disentangled_attention:
            return DEBERTA_LAYERNORM_EPSILON
        return BERT_LAYERNORM_EPSILON

    @property
    def output_layer_std(self) -> float:
        """Std of the attention-output and FFN-output projections (--output-layer-init)."""
        if self.output_layer_init == "electra":
            return self.init_method_std
        return self.init_method_std / math.sqrt(2.0 * self.num_layers)

    @property
    def relative_positions(self) -> int:
        """--max-relative-positions resolved (DeBERTa's max_relative_positions)."""
        return self.max_relative_positions or self.max_position_embeddings

    @property
    def relative_span(self) -> int:
        """Half size of the relative table (DeBERTa's att_span / pos_ebd_size)."""
        return self.position_buckets if self.position_buckets > 0 else self.relative_positions

    @property
    def relative_table_size(self) -> int:
        """Rows of the shared relative embedding table, 0 without disentangled attention."""
        return 2 * self.relative_span if self.disentangled_attention else 0

    def validate_parallel(self, tp_size: int) -> None:
        self.require_divisible(tp_size, "num_attention_heads", "ffn_hidden_size")

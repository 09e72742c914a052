"""TACO model configuration (Table 7 of the paper for the base preset)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_taco.arguments import flag_of, require
from megatron_taco.models.common.config import EncoderConfig, opt

# Presets override only architecture sizes; dropout/init/eps keep the defaults.
# "base" is TACO-base (Table 7 + A.5: relative embeddings enlarged to 768).
# "small" is a CPU demo model with the same proportions (WE:PE hidden ~3:1, FFN 4x).
# "tiny" exists for tests: every dimension is distinct so a transposed shape fails loudly.
PRESETS: dict[str, dict[str, Any]] = {
    "base": {},
    "small": dict(
        num_layers=4,
        we_hidden_size=192,
        pe_hidden_size=64,
        we_attention_heads=6,
        pe_attention_heads=2,
        kv_channels=32,
        we_ffn_hidden_size=768,
        pe_ffn_hidden_size=256,
        relative_embedding_size=256,
    ),
    "tiny": dict(
        num_layers=2,
        we_hidden_size=48,
        pe_hidden_size=16,
        we_attention_heads=4,
        pe_attention_heads=2,
        kv_channels=8,
        we_ffn_hidden_size=96,
        pe_ffn_hidden_size=40,
        relative_embedding_size=24,
        max_position_embeddings=64,
        max_relative_distance=63,
    ),
}


@dataclass(frozen=True)
class TacoConfig(EncoderConfig):
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = PRESETS
    ARGS_TITLE: ClassVar[str] = "TACO model"
    # base: the paper's Table 7 (batch 1200, 10000 warm-up iterations). small and tiny:
    # measured on the bundled corpus at batch 32 (README, "Recipes for short runs"): small
    # learns at 5e-4 where 1e-3 with a short warm-up collapsed it; tiny (tests/learning) at 1e-3.
    DEFAULT_LR: ClassVar[dict[str, float]] = {"tiny": 1e-3, "small": 5e-4, "base": 1e-4}

    num_layers: int = opt(12, "Number of TACO layers.", "--num-layers")
    we_hidden_size: int = opt(
        648, "Hidden size d_WE of the word (content) stream.", "--we-hidden-size"
    )
    pe_hidden_size: int = opt(120, "Hidden size d_PE of the position stream.", "--pe-hidden-size")
    we_attention_heads: int = opt(
        12, "Attention heads h_WE of the word stream.", "--we-attention-heads"
    )
    pe_attention_heads: int = opt(
        6, "Attention heads h_PE of the position stream.", "--pe-attention-heads"
    )
    kv_channels: int = opt(
        64, "Query/key head size d_k (also of the relative projections).", "--kv-channels"
    )
    we_value_channels: int | None = opt(
        None,
        "Value head size d_v of the WE heads (default d_WE / h_WE, as the paper's parameter "
        "counts require).",
        "--we-value-channels",
    )
    pe_value_channels: int | None = opt(
        None,
        "Value head size d_v of the PE heads (default d_PE / h_PE).",
        "--pe-value-channels",
    )
    we_ffn_hidden_size: int = opt(
        2592, "FFN inner size of the word stream.", "--we-ffn-hidden-size"
    )
    pe_ffn_hidden_size: int = opt(
        480, "FFN inner size of the position stream.", "--pe-ffn-hidden-size"
    )
    max_relative_distance: int = opt(
        511,
        "Maximum relative distance k (distances are clipped to [-k, k]).",
        "--max-relative-distance",
    )
    relative_embedding_size: int = opt(
        768, "Width of the shared relative-position embedding table.", "--relative-embedding-size"
    )
    max_position_embeddings: int = opt(
        512,
        "Number of absolute positions (position ids lie in [0, this)).",
        "--max-position-embeddings",
    )
    model_size: str | None = opt(
        None,
        "Start from a preset; explicitly given flags override it.",
        "--model-size",
        choices=tuple(PRESETS),
    )

    def __post_init__(self) -> None:
        cls = type(self)
        self.require_positive_ints(
            "num_layers",
            "we_hidden_size",
            "pe_hidden_size",
            "we_attention_heads",
            "pe_attention_heads",
            "kv_channels",
            "we_ffn_hidden_size",
            "pe_ffn_hidden_size",
            "relative_embedding_size",
            "max_position_embeddings",
            "max_relative_distance",
        )
        for name, hidden, heads in (
            ("we_value_channels", "we_hidden_size", "we_attention_heads"),
            ("pe_value_channels", "pe_hidden_size", "pe_attention_heads"),
        ):
            if getattr(self, name) is not None:
                self.require_positive_ints(name)
            else:
                h, n = getattr(self, hidden), getattr(self, heads)
                require(
                    h % n == 0,
                    cls,
                    name,
                    f"defaults to {flag_of(cls, hidden)} / {flag_of(cls, heads)}, but {h} is not "
                    f"divisible by {n}; give the value head size explicitly",
                )
        require(
            self.max_relative_distance < self.max_position_embeddings,
            cls,
            "max_relative_distance",
            f"k={self.max_relative_distance} must be < --max-position-embeddings "
            f"({self.max_position_embeddings}): larger distances cannot occur",
        )
        self.validate_common()

    # -- derived sizes -------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        """Width of the concatenated representation [WE; PE] that the heads see."""
        return self.we_hidden_size + self.pe_hidden_size

    @property
    def we_value_size(self) -> int:
        """d_v of a WE head: values, the per-head attention output and W_WE^O's input."""
        return self.we_value_channels or self.we_hidden_size // self.we_attention_heads

    @property
    def pe_value_size(self) -> int:
        return self.pe_value_channels or self.pe_hidden_size // self.pe_attention_heads

    @property
    def num_relative_buckets(self) -> int:
        """2k+1 clipped distances plus the bucket for pairs involving a masked position."""
        return 2 * self.max_relative_distance + 2

    @property
    def mask_bucket(self) -> int:
        return 2 * self.max_relative_distance + 1

    @property
    def conv_out_channels(self) -> int:
        return self.we_attention_heads + self.pe_attention_heads

    def conv_in_channels(self, first_layer: bool) -> int:
        # content + c2p + p2c per WE head, position per PE head, and (after layer 1)
        # the previous layer's fused logits for every WE and PE head.
        base = 3 * self.we_attention_heads + self.pe_attention_heads
        return base if first_layer else base + self.conv_out_channels

    def validate_parallel(self, tp_size: int) -> None:
        self.require_divisible(
            tp_size,
            "we_attention_heads",
            "pe_attention_heads",
            "we_ffn_hidden_size",
            "pe_ffn_hidden_size",
        )

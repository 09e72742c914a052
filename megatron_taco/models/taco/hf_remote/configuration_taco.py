"""TACO model configuration for transformers (remote code: ``trust_remote_code=True``).

Self-contained: imports only transformers. Written by megatron_taco's export_hf tool next to
the weights; the field names follow transformers' BERT/DeBERTa conventions where one exists.
"""

from __future__ import annotations

from transformers import PreTrainedConfig


class TacoConfig(PreTrainedConfig):
    r"""TACO: a word (WE) and a position (PE) stream per token, never added, joined in one
    attention whose maps (content, content-to-position, position-to-content, position, and
    the previous layer's logits) are fused by a 1x1 convolution + PReLU before the softmax.

    The complete token representation is [h_WE; h_PE] (``hidden_size`` = we_hidden_size +
    pe_hidden_size wide): ``last_hidden_state[..., :we_hidden_size]`` is the word stream.

    Args:
        vocab_size: word-embedding rows.
        num_hidden_layers: TACO layers.
        we_hidden_size / pe_hidden_size: d_WE and d_PE.
        we_attention_heads / pe_attention_heads: h_WE and h_PE.
        attention_head_size: d_k of queries, keys and the relative projections.
        we_value_head_size / pe_value_head_size: d_v of WE / PE heads (None: hidden / heads).
        we_intermediate_size / pe_intermediate_size: FFN inner sizes of the two streams.
        max_relative_positions: k; relative distances are clipped to [-k, k].
        relative_embedding_size: width of the relative-position table (2k+2 rows: 2k+1
            distances and one for pairs involving a masked position).
        max_position_embeddings: absolute positions [0, this); row ``max_position_embeddings``
            of the table is the learned masked position (position id -1).
    """

    model_type = "taco"

    vocab_size: int = 30522
    num_hidden_layers: int = 12
    we_hidden_size: int = 648
    pe_hidden_size: int = 120
    we_attention_heads: int = 12
    pe_attention_heads: int = 6
    attention_head_size: int = 64
    we_value_head_size: int | None = None
    pe_value_head_size: int | None = None
    we_intermediate_size: int = 2592
    pe_intermediate_size: int = 480
    max_relative_positions: int = 511
    relative_embedding_size: int = 768
    max_position_embeddings: int = 512
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    classifier_dropout: float | None = None
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = False  # the heads read the embeddings directly; nothing to tie

    def __post_init__(self, **kwargs):
        for stream in ("we", "pe"):
            hidden = getattr(self, f"{stream}_hidden_size")
            heads = getattr(self, f"{stream}_attention_heads")
            if getattr(self, f"{stream}_value_head_size") is None and hidden % heads:
                raise ValueError(
                    f"{stream}_hidden_size {hidden} is not divisible by {stream}_attention_heads "
                    f"{heads}; give {stream}_value_head_size"
                )
        if self.max_relative_positions >= self.max_position_embeddings:
            raise ValueError(
                f"max_relative_positions {self.max_relative_positions} must be < "
                f"max_position_embeddings {self.max_position_embeddings}"
            )
        super().__post_init__(**kwargs)

    @property
    def hidden_size(self) -> int:
        """Width of the complete token representation [h_WE; h_PE]."""
        return self.we_hidden_size + self.pe_hidden_size

    @property
    def we_value_size(self) -> int:
        return self.we_value_head_size or self.we_hidden_size // self.we_attention_heads

    @property
    def pe_value_size(self) -> int:
        return self.pe_value_head_size or self.pe_hidden_size // self.pe_attention_heads

    @property
    def num_relative_buckets(self) -> int:
        return 2 * self.max_relative_positions + 2


__all__ = ["TacoConfig"]

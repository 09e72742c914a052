"""DataLoader collate_fn that turns BertSampleDataset samples into TACO batches.

A micro-batch of b samples becomes 2b rows: rows [0, b) carry span-masked tokens
with true positions (MLM), rows [b, 2b) true tokens with masked positions (MPM).
The two corruptions are independent (TACO section 3.5).

Every sample's masking is drawn from ``numpy.random.default_rng([seed, index,
stream])``: ``index`` is the global sample index, so a sample is masked the same
whatever the worker count, batch composition or restart point, and differently
in each epoch (each epoch's samples have their own indices).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from megatron_taco.data.masking import IGNORE_INDEX, TokenMaskingConfig, span_mask_tokens
from megatron_taco.data.position_masking import (
    PositionMaskingConfig,
    span_mask_positions,
    true_position_ids,
)

TOKEN_STREAM = 0
POSITION_STREAM = 1


class TacoMaskingCollator:
    """Plain values only (no Tokenizer object), so it pickles cheaply into workers.

    random_token_ids: ids random replacement may draw; else [NUM_SPECIAL_IDS, vocab_size).
    """

    def __init__(
        self,
        *,
        mask_id: int,
        pad_id: int,
        vocab_size: int,
        seq_length: int,
        seed: int,
        masking: TokenMaskingConfig | None = None,
        position_masking: PositionMaskingConfig | None = None,
        num_positions: int | None = None,
        random_token_ids: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        if seq_length < 2:
            raise ValueError(f"seq_length must be >= 2, got {seq_length}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.mask_id = int(mask_id)
        self.pad_id = int(pad_id)
        self.vocab_size = int(vocab_size)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.masking = masking if masking is not None else TokenMaskingConfig()
        self.position_masking = (
            position_masking if position_masking is not None else PositionMaskingConfig()
        )
        # Size of the model's absolute position table: the range of a one-position shuffle.
        self.num_positions = int(num_positions) if num_positions is not None else self.seq_length
        if self.num_positions < self.seq_length:
            raise ValueError(f"num_positions {self.num_positions} < seq_length {self.seq_length}")
        self.random_token_ids = None
        if random_token_ids is not None:
            ids = self.random_token_ids = np.asarray(random_token_ids, dtype=np.int64)
            if ids.size == 0 or ids.min() < 0 or ids.max() >= self.vocab_size:
                raise ValueError(
                    f"random_token_ids must be a non-empty subset of [0, {self.vocab_size})"
                )

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        *,
        seq_length: int,
        seed: int,
        masking: TokenMaskingConfig | None = None,
        position_masking: PositionMaskingConfig | None = None,
        num_positions: int | None = None,
    ) -> TacoMaskingCollator:
        """Extract the plain values from a data.tokenizer.Tokenizer (duck-typed)."""
        return cls(
            mask_id=tokenizer.mask_id,
            pad_id=tokenizer.pad_id,
            vocab_size=tokenizer.vocab_size,
            seq_length=seq_length,
            seed=seed,
            masking=masking,
            position_masking=position_masking,
            num_positions=num_positions,
            random_token_ids=np.flatnonzero(~np.asarray(tokenizer.is_special_mask())),
        )

    def mask_sample(
        self, sample: Mapping[str, Any]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(masked input_ids, mlm_labels, masked position_ids, mpm_labels) of one sample."""
        tokens = np.asarray(sample["tokens"])
        length = int(sample["length"])
        index = int(sample["index"])
        if tokens.shape != (self.seq_length,):
            raise ValueError(
                f"sample {index}: tokens have shape {tokens.shape}, expected ({self.seq_length},)"
            )
        if not 0 < length <= self.seq_length:
            raise ValueError(f"sample {index}: length {length} outside (0, {self.seq_length}]")
        if (tokens[length:] != self.pad_id).any():
            raise ValueError(f"sample {index}: tokens after length={length} are not padding")
        special = np.asarray(sample["special"], dtype=bool)
        cfg, pos = self.masking, self.position_masking
        input_ids, mlm_labels = span_mask_tokens(
            tokens,
            np.asarray(sample["word_starts"], dtype=bool),
            special,
            length,
            np.random.default_rng([self.seed, index, TOKEN_STREAM]),
            mask_id=self.mask_id,
            vocab_size=self.vocab_size,
            mask_prob=cfg.mask_prob,
            geometric_p=cfg.span_geometric_p,
            max_span=cfg.max_span_length,
            random_token_ids=self.random_token_ids,
            mask_replace_prob=cfg.mask_replace_prob,
            random_replace_prob=cfg.random_replace_prob,
        )
        position_ids, mpm_labels = span_mask_positions(
            length,
            special,
            np.random.default_rng([self.seed, index, POSITION_STREAM]),
            seq_length=self.seq_length,
            num_positions=self.num_positions,
            mask_prob=pos.position_mask_prob,
            geometric_p=pos.position_span_geometric_p,
            max_span=pos.max_position_span_length,
            mask_replace_prob=pos.position_mask_replace_prob,
            shuffle_prob=pos.position_shuffle_prob,
        )
        return input_ids, mlm_labels, position_ids, mpm_labels

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        b, s = len(samples), self.seq_length
        if b == 0:
            raise ValueError("cannot collate an empty batch")
        input_ids = np.empty((2 * b, s), dtype=np.int64)
        position_ids = np.empty((2 * b, s), dtype=np.int64)
        attention_mask = np.empty((2 * b, s), dtype=bool)
        mlm_labels = np.full((2 * b, s), IGNORE_INDEX, dtype=np.int64)
        mpm_labels = np.full((2 * b, s), IGNORE_INDEX, dtype=np.int64)
        columns = np.arange(s)
        for i, sample in enumerate(samples):
            masked_tokens, mlm, masked_positions, mpm = self.mask_sample(sample)
            length = int(sample["length"])
            input_ids[i] = masked_tokens
            input_ids[b + i] = np.asarray(sample["tokens"])
            position_ids[i] = true_position_ids(length, s)
            position_ids[b + i] = masked_positions
            attention_mask[i] = attention_mask[b + i] = columns < length
            mlm_labels[i] = mlm
            mpm_labels[b + i] = mpm
        return {
            "input_ids": torch.from_numpy(input_ids),
            "position_ids": torch.from_numpy(position_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "mlm_labels": torch.from_numpy(mlm_labels),
            "mpm_labels": torch.from_numpy(mpm_labels),
        }

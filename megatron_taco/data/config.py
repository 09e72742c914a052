"""Data flags (Megatron's spelling): what to read and how to cut it into samples."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from megatron_taco.arguments import option, require
from megatron_taco.data.blending import parse_data_path
from megatron_taco.data.indexed_dataset import data_file_path, index_file_path
from megatron_taco.data.samples import parse_split
from megatron_taco.data.tokenizer import (
    check_dataset_tokenizer,
    check_tokenizer_options,
    load_config_tokenizer,
    tokenizer_file,
    tokenizer_flag,
    tokenizer_type_option,
    vocab_file_option,
)
from megatron_taco.errors import ConfigError

MIN_SEQ_LENGTH = 8


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...] = option(
        help="Indexed dataset prefix(es) (PREFIX.bin/.idx), optionally weighted for blending: "
        "'PREFIX' or 'W1 PREFIX1 W2 PREFIX2 ...'.",
        flag="--data-path",
    )
    tokenizer_model: str | None = option(
        None,
        "Sentencepiece model the datasets were tokenized with (--tokenizer-type SentencePiece).",
        flag="--tokenizer-model",
    )
    tokenizer_type: str = tokenizer_type_option()
    vocab_file: str | None = vocab_file_option()
    split: str = option(
        "949,50,1",
        "Train,valid,test proportions of every dataset's documents (normalised).",
        flag="--split",
    )
    seq_length: int = option(
        512, "Tokens per sample including [CLS] and [SEP].", flag="--seq-length"
    )
    short_seq_prob: float = option(
        0.1,
        "Probability that a sample gets a shorter target length, uniform in [2, seq_length - 2].",
        flag="--short-seq-prob",
    )
    min_sentences: int = option(
        2,
        "Documents with fewer sentences are skipped, and a sample is closed early only when it "
        "has this many sentences and this many remain (Megatron's BERT uses 2).",
        flag="--min-sentences",
    )
    data_cache_path: str | None = option(
        None,
        "Directory for the cached sample/blending indices (default: 'cache' beside the first "
        "data prefix). Must be shared by all nodes.",
        flag="--data-cache-path",
    )
    seed: int = option(1234, "Random seed for sample targets and shuffling.", flag="--seed")
    num_workers: int = option(2, "DataLoader worker processes per rank.", flag="--num-workers")

    def __post_init__(self) -> None:
        data_path = self.data_path
        if isinstance(data_path, str):
            data_path = (data_path,)
        require(
            isinstance(data_path, (tuple, list)) and len(data_path) > 0,
            DataConfig,
            "data_path",
            f"expected one or more dataset prefixes, got {self.data_path!r}",
        )
        object.__setattr__(self, "data_path", tuple(str(p) for p in data_path))
        parse_data_path(self.data_path)  # raises ConfigError naming --data-path
        check_tokenizer_options(self)
        split = self.split
        require(isinstance(split, str), DataConfig, "split", f"expected a string, got {split!r}")
        parse_split(split)  # raises ConfigError naming --split
        for name, minimum in (
            ("seq_length", MIN_SEQ_LENGTH),
            ("min_sentences", 1),
            ("num_workers", 0),
            ("seed", 0),
        ):
            value = getattr(self, name)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
            require(ok, DataConfig, name, f"must be an integer >= {minimum}, got {value!r}")
        prob = self.short_seq_prob
        require(
            isinstance(prob, (int, float))
            and not isinstance(prob, bool)
            and math.isfinite(prob)
            and 0 <= prob <= 1,
            DataConfig,
            "short_seq_prob",
            f"must be a probability in [0, 1], got {prob!r}",
        )
        object.__setattr__(self, "short_seq_prob", float(prob))
        if self.data_cache_path is not None:
            require(
                isinstance(self.data_cache_path, (str, os.PathLike))
                and str(self.data_cache_path) != "",
                DataConfig,
                "data_cache_path",
                f"expected a directory, got {self.data_cache_path!r}",
            )
            object.__setattr__(self, "data_cache_path", os.fspath(self.data_cache_path))

    @property
    def prefixes(self) -> list[str]:
        return parse_data_path(self.data_path)[0]

    @property
    def weights(self) -> list[float]:
        return parse_data_path(self.data_path)[1]

    def cache_dir(self) -> str:
        if self.data_cache_path is not None:
            return self.data_cache_path
        return os.path.join(os.path.dirname(os.path.abspath(self.prefixes[0])), "cache")

    def validate_files(self) -> None:
        """Check that every dataset and the tokenizer exist, and that the datasets were made
        with this tokenizer (their summaries say); call before any collective so a typo fails
        fast on every rank instead of hanging the others."""
        for prefix in self.prefixes:
            for path in (index_file_path(prefix), data_file_path(prefix)):
                if not os.path.isfile(path):
                    raise ConfigError(
                        f"--data-path: dataset {prefix!r}: {path} does not exist "
                        "(expected PREFIX.bin and PREFIX.idx from tools/preprocess_data.py)"
                    )
        path, flag = tokenizer_file(self), tokenizer_flag(self)
        if not path or not os.path.isfile(path):
            raise ConfigError(f"{flag}: {path} does not exist")
        # Loaded only where a dataset's summary names the tokenizer it was made with.
        check_dataset_tokenizer(self.prefixes, lambda: load_config_tokenizer(self))

    def load_tokenizer(self):
        return load_config_tokenizer(self)

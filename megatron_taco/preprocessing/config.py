"""What a preprocessing run is asked to do (``PreprocessConfig``, Megatron's
tools/preprocess_data.py flags), the output names it derives, and the checks of the inputs
and the output directory that turn every bad argument into a ConfigError before any work."""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_taco.arguments import option, require
from megatron_taco.data.tokenizer import (
    SUMMARY_SUFFIX,
    check_tokenizer_options,
    tokenizer_type_option,
    vocab_file_option,
)
from megatron_taco.errors import ConfigError
from megatron_taco.preprocessing.inputs import GLOB_CHARS, detect_format, expand_inputs
from megatron_taco.preprocessing.readers import FORMATS
from megatron_taco.preprocessing.records import CorpusError
from megatron_taco.preprocessing.streams import compression_kind
from megatron_taco.preprocessing.text import (
    DEFAULT_SENTENCE_SPLITTER,
    SENTENCE_SPLITTERS,
    SplitterUnavailableError,
    make_sentence_splitter,
)


class PreprocessError(RuntimeError):
    """The run failed (a worker crashed, an input became unreadable); nothing was written."""


@dataclass(frozen=True)
class PreprocessConfig:
    input: tuple[str, ...] = option(
        help="Input files, directories (read recursively) or globs, in this order; each "
        "expanded in sorted order"
    )
    output_prefix: str = option(
        help="Output prefix: writes PREFIX_{key}_{sentence|document}.bin/.idx, their "
        "_unigram.npy counts and PREFIX_summary.json"
    )
    tokenizer_model: str | None = option(
        None, help="SentencePiece model (from taco-train-tokenizer; --tokenizer-type SentencePiece)"
    )
    tokenizer_type: str = tokenizer_type_option()
    vocab_file: str | None = vocab_file_option()
    input_format: str = option(
        "auto", help="Corpus format; auto detects it per file", choices=FORMATS
    )
    json_keys: tuple[str, ...] = option(
        ("text",),
        help="Fields to tokenize, one dataset each (for formats with one natural text, the "
        "first key names that text)",
    )
    split_sentences: bool = option(
        False,
        help="One sequence per sentence (see --sentence-splitter); otherwise one per document",
    )
    sentence_splitter: str = option(
        DEFAULT_SENTENCE_SPLITTER,
        help="Sentence splitter for --split-sentences: blingfire (fast; keeps 99.5%% of punkt's "
        "boundaries on Wikipedia and fixes most of punkt's abbreviation errors) or punkt (nltk "
        "punkt_tab, Megatron-LM's splitter)",
        choices=SENTENCE_SPLITTERS,
    )
    append_eod: bool = option(
        False, help="Append the end-of-document token ([SEP]) to each document's last sequence"
    )
    workers: int = option(1, help="Tokenizing worker processes (the output does not depend on it)")
    chunk_size: int = option(256, help="Records per batch handed to a worker")
    min_chars: int = option(
        0, help="Skip records with a selected field shorter than this (reason too_short)"
    )
    log_interval: int = option(1000, help="Update the progress display every N documents")
    dataset_impl: str = option(
        "mmap", help="Megatron's dataset format; only mmap exists", choices=("mmap",)
    )
    partitions: int = option(
        1,
        help="Accepted for Megatron compatibility and ignored: workers already write shards "
        "in parallel and the merge is part of the run",
    )
    keep_newlines: bool = option(
        False,
        help="Not supported (Megatron compatibility): newlines always end a sentence here and "
        "SentencePiece encodes a newline as a space",
    )

    def __post_init__(self) -> None:
        cls = PreprocessConfig
        require(len(self.input) > 0, cls, "input", "at least one input is required")
        require(bool(self.output_prefix), cls, "output_prefix", "must not be empty")
        require(
            os.path.basename(self.output_prefix) not in ("", ".", ".."),
            cls,
            "output_prefix",
            f"{self.output_prefix!r} names a directory; give a prefix such as "
            f"{os.path.join(self.output_prefix, 'corpus')}",
        )
        check_tokenizer_options(self)
        require(self.input_format in FORMATS, cls, "input_format", f"must be one of {FORMATS}")
        require(
            self.sentence_splitter in SENTENCE_SPLITTERS,
            cls,
            "sentence_splitter",
            f"must be one of {SENTENCE_SPLITTERS}, got {self.sentence_splitter!r}",
        )
        keys = self.json_keys
        require(len(keys) > 0, cls, "json_keys", "at least one key is required")
        require(len(set(keys)) == len(keys), cls, "json_keys", f"duplicate key in {list(keys)}")
        for key in keys:
            # The key becomes part of a file name.
            require(
                bool(key) and "/" not in key and os.sep not in key and key not in (".", ".."),
                cls,
                "json_keys",
                f"{key!r} cannot be part of a file name",
            )
        require(self.workers >= 1, cls, "workers", f"must be >= 1, got {self.workers}")
        require(self.chunk_size >= 1, cls, "chunk_size", f"must be >= 1, got {self.chunk_size}")
        require(self.min_chars >= 0, cls, "min_chars", f"must be >= 0, got {self.min_chars}")
        require(
            self.log_interval >= 1, cls, "log_interval", f"must be >= 1, got {self.log_interval}"
        )
        require(self.dataset_impl == "mmap", cls, "dataset_impl", "only mmap is supported")
        require(self.partitions >= 1, cls, "partitions", f"must be >= 1, got {self.partitions}")
        require(
            not self.keep_newlines,
            cls,
            "keep_newlines",
            "not supported: every newline ends a sentence (text.py's one-paragraph-per-line "
            "convention) and SentencePiece normalizes a newline to a space, so there is no "
            "newline left to keep",
        )

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"


def dataset_prefix(output_prefix: str, key: str, level: str) -> str:
    return f"{output_prefix}_{key}_{level}"


def summary_path(output_prefix: str) -> str:
    return output_prefix + SUMMARY_SUFFIX


@dataclass(frozen=True)
class InputFile:
    path: str
    fmt: str  # never "auto": detected in check_inputs
    size: int
    compressed: bool


def _is_compressed(path: str) -> bool:
    with open(path, "rb") as f:
        return compression_kind(f.read(10)) is not None


def check_inputs(cfg: PreprocessConfig) -> list[InputFile]:
    for item in cfg.input:
        if not os.path.exists(item) and not GLOB_CHARS.search(item):
            raise ConfigError(f"--input: {item} does not exist")
    try:
        files = expand_inputs(list(cfg.input))
    except (FileNotFoundError, OSError, CorpusError) as e:
        raise ConfigError(f"--input: {e}") from None
    if not files:
        raise ConfigError(f"--input: {' '.join(cfg.input)} contains no input files")
    out: list[InputFile] = []
    for path in files:
        if not os.access(path, os.R_OK):
            raise ConfigError(f"--input: {path} is not readable")
        if cfg.input_format == "auto":
            try:
                fmt = detect_format(path)
            except (CorpusError, OSError) as e:
                raise ConfigError(f"--input-format auto: {e}") from None
        else:
            fmt = cfg.input_format
        out.append(InputFile(path, fmt, os.path.getsize(path), _is_compressed(path)))
    return out


def check_output(cfg: PreprocessConfig) -> str:
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    if not os.path.isdir(out_dir):
        raise ConfigError(f"--output-prefix: directory {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"--output-prefix: directory {out_dir} is not writable")
    return out_dir


def make_splitter(name: str):
    try:
        return make_sentence_splitter(name)
    except SplitterUnavailableError as e:
        raise ConfigError(f"--sentence-splitter {name}: {e}") from None

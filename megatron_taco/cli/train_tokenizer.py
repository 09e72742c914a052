"""Train the tokenizer every other tool reads (taco-train-tokenizer): a sentencepiece model,
or with --tokenizer-type BertWordPieceLowerCase / BertWordPieceCase a WordPiece vocab.txt
(the ``tokenizers`` library's trainer, BERT's normaliser and specials).

The corpus is streamed, document by document, through a reservoir sampler that keeps at most
--input-sentence-size sentences, and the sample is handed to sentencepiece through its
sentence iterator: memory is bounded by the sample, never by the corpus.

The sampling is done here rather than by sentencepiece's own --shuffle_input_sentence
because sentencepiece >= 0.2 draws it from an absl generator that is salted per process:
the same corpus and seed gave a different model on every run.
"""

from __future__ import annotations

import collections
import glob
import itertools
import logging
import os
import random
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import sentencepiece as spm

from megatron_taco import io
from megatron_taco.arguments import (
    dataclass_from_args,
    option,
    require,
    run_cli,
)
from megatron_taco.cli import tool_parser
from megatron_taco.data.tokenizer import (
    SENTENCEPIECE,
    SPECIAL_PIECES,
    WORDPIECE_TYPES,
    Tokenizer,
    WordPieceTokenizer,
    canonical_tokenizer_type,
    tokenizer_type_option,
)
from megatron_taco.errors import ConfigError
from megatron_taco.preprocessing.corpora import iter_records
from megatron_taco.preprocessing.inputs import detect_format, expand_inputs
from megatron_taco.preprocessing.readers import FORMATS
from megatron_taco.preprocessing.records import CorpusError, Document
from megatron_taco.preprocessing.text import (
    DEFAULT_SENTENCE_SPLITTER,
    SENTENCE_SPLITTERS,
    make_sentence_splitter,
    split_lines,
)

logger = logging.getLogger(__name__)

# Five specials plus room for a usable alphabet; sentencepiece itself fails later and less
# clearly when the vocabulary cannot hold the characters it must keep.
MIN_VOCAB_SIZE = 16
# --byte-fallback adds one piece per byte value, <0x00> .. <0xFF>.
BYTE_PIECES = 256


@dataclass(frozen=True)
class TrainTokenizerConfig:
    input: tuple[str, ...] = option(
        help="Input files, directories or glob patterns (any format taco-preprocess-data reads)"
    )
    model_prefix: str = option(
        help="Output prefix: writes PREFIX.model and PREFIX.vocab (sentencepiece), or "
        "PREFIX-vocab.txt (WordPiece)"
    )
    tokenizer_type: str = tokenizer_type_option(
        help="What to train: a sentencepiece model (SentencePiece) or a WordPiece vocab.txt "
        "whose text is lower-cased and stripped of accents (BertWordPieceLowerCase) or kept "
        "as written (BertWordPieceCase)"
    )
    input_format: str = option("auto", help="Input format", choices=FORMATS)
    json_keys: tuple[str, ...] = option(("text",), help="Document fields to train on")
    vocab_size: int = option(32000, help="Vocabulary size, specials included")
    model_type: str = option(
        "unigram", help="Sentencepiece algorithm (SentencePiece only)", choices=("unigram", "bpe")
    )
    character_coverage: float = option(
        0.9995,
        help="Fraction of characters covered by the alphabet; the rest are spelled as bytes "
        "(--byte-fallback) or map to [UNK] (SentencePiece only; WordPiece keeps the 1000 most "
        "frequent characters)",
    )
    byte_fallback: bool = option(
        True,
        help="Spell characters outside the vocabulary as UTF-8 byte pieces <0x00>..<0xFF> "
        "(256 of the --vocab-size ids) instead of [UNK]: web text is full of emoji, CJK and "
        "rare symbols the sample never showed the trainer (SentencePiece only)",
    )
    input_sentence_size: int = option(
        10_000_000,
        help="Train on a uniform random sample of at most this many sentences (0 = all, "
        "unbounded memory)",
    )
    shuffle_input_sentence: bool = option(
        True,
        help="Sample the --input-sentence-size sentences uniformly over the whole corpus "
        "(otherwise the first ones are taken and the rest is not read)",
    )
    split_sentences: bool = option(
        False,
        help="Split text into sentences (see --sentence-splitter; otherwise each non-empty line "
        "is one training sentence)",
    )
    sentence_splitter: str = option(
        DEFAULT_SENTENCE_SPLITTER,
        help="Sentence splitter for --split-sentences (as taco-preprocess-data's)",
        choices=SENTENCE_SPLITTERS,
    )
    max_sentence_length: int = option(
        4192, help="Sentences longer than this many bytes are left out (and counted)"
    )
    min_chars: int = option(0, help="Skip documents shorter than this many characters")
    num_threads: int = option(os.cpu_count() or 1, help="Training threads")
    seed: int = option(
        1234,
        help="Seed of the sentence sampling (reproducible sentencepiece models; the tokenizers "
        "library's WordPiece trainer breaks ties between equally frequent pairs in hash order, "
        "so a rerun may differ in a few rare pieces)",
    )
    verbose: bool = option(
        False,
        help="Show the trainer's log (sentencepiece: some hundred lines; WordPiece: a "
        "progress bar); hidden by default",
    )

    def __post_init__(self) -> None:
        cls = TrainTokenizerConfig
        require(len(self.input) > 0, cls, "input", "at least one input is required")
        for item in self.input:
            if glob.has_magic(item):
                require(
                    bool(glob.glob(item, recursive=True)),
                    cls,
                    "input",
                    f"pattern {item!r} matches no file",
                )
            else:
                require(os.path.exists(item), cls, "input", f"{item}: no such file or directory")
        require(bool(self.model_prefix), cls, "model_prefix", "must not be empty")
        require(
            not os.path.isdir(self.model_prefix),
            cls,
            "model_prefix",
            f"{self.model_prefix} is a directory; give a file prefix such as {self.model_prefix}/spm",
        )
        require(self.input_format in FORMATS, cls, "input_format", f"must be one of {FORMATS}")
        require(len(self.json_keys) > 0, cls, "json_keys", "at least one key is required")
        require(
            self.vocab_size >= MIN_VOCAB_SIZE,
            cls,
            "vocab_size",
            f"{self.vocab_size} is too small: {len(SPECIAL_PIECES)} ids are taken by "
            f"{', '.join(SPECIAL_PIECES)}; use at least {MIN_VOCAB_SIZE}",
        )
        require(self.model_type in ("unigram", "bpe"), cls, "model_type", "must be unigram or bpe")
        # "SentencePieceTokenizer" (Megatron's spelling) -> "SentencePiece"
        object.__setattr__(self, "tokenizer_type", canonical_tokenizer_type(self.tokenizer_type))
        require(
            self.sentence_splitter in SENTENCE_SPLITTERS,
            cls,
            "sentence_splitter",
            f"must be one of {SENTENCE_SPLITTERS}, got {self.sentence_splitter!r}",
        )
        if self.byte_fallback and self.tokenizer_type == SENTENCEPIECE:
            least = MIN_VOCAB_SIZE + BYTE_PIECES
            require(
                self.vocab_size >= least,
                cls,
                "vocab_size",
                f"{self.vocab_size} is too small for --byte-fallback, whose byte pieces take "
                f"{BYTE_PIECES} ids; use at least {least}, or --no-byte-fallback",
            )
        require(
            0.0 < self.character_coverage <= 1.0,
            cls,
            "character_coverage",
            f"must be in (0, 1], got {self.character_coverage}",
        )
        require(self.input_sentence_size >= 0, cls, "input_sentence_size", "must be >= 0")
        require(self.max_sentence_length > 0, cls, "max_sentence_length", "must be > 0")
        require(self.min_chars >= 0, cls, "min_chars", "must be >= 0")
        require(self.num_threads >= 1, cls, "num_threads", "must be >= 1")


class _SentenceStream:
    """Iterates the training sentences and counts what it read, for the final report."""

    def __init__(self, config: TrainTokenizerConfig, inputs: list[tuple[str, str]]) -> None:
        self.config = config
        self.inputs = inputs  # (path, format)
        self.documents = 0
        self.sentences = 0  # read from the corpus
        self.sampled = 0  # handed to sentencepiece
        self.skipped: collections.Counter[str] = collections.Counter()
        # Built now so that missing punkt data fails before any reading.
        self.splitter = (
            make_sentence_splitter(config.sentence_splitter) if config.split_sentences else None
        )

    def __iter__(self) -> Iterator[str]:
        size = self.config.input_sentence_size
        if size == 0:
            source = self._read()
        elif not self.config.shuffle_input_sentence:
            # the first sentences only: stops reading the corpus there
            source = itertools.islice(self._read(), size)
        else:
            source = self._reservoir(size)
        for sentence in source:
            self.sampled += 1
            yield sentence

    def _reservoir(self, size: int) -> Iterator[str]:
        # Algorithm R: after n sentences, each one is in the sample with probability size/n.
        rng = random.Random(self.config.seed)
        sample: list[str] = []
        for n, sentence in enumerate(self._read()):
            if n < size:
                sample.append(sentence)
            else:
                j = rng.randrange(n + 1)
                if j < size:
                    sample[j] = sentence
        # Popping hands each string over to sentencepiece's copy and frees ours, so the two
        # copies of the sample never coexist in full.
        sample.reverse()
        while sample:
            yield sample.pop()

    def _read(self) -> Iterator[str]:
        cfg = self.config
        splitter = self.splitter
        for path, fmt in self.inputs:
            for record in iter_records(path, fmt, cfg.json_keys, min_chars=cfg.min_chars):
                if not isinstance(record, Document):
                    self.skipped[record.reason] += 1
                    continue
                self.documents += 1
                for key in cfg.json_keys:
                    text = record.text[key]
                    # Both give stripped, non-empty pieces, never across a line break.
                    pieces = splitter.split(text) if splitter is not None else split_lines(text)
                    for sentence in pieces:
                        # sentencepiece would drop it too, but silently; counted here so
                        # the report shows when --split-sentences is needed.
                        if len(sentence.encode("utf-8")) > cfg.max_sentence_length:
                            self.skipped["sentence_too_long"] += 1
                            continue
                        self.sentences += 1
                        yield sentence


def train_tokenizer(config: TrainTokenizerConfig) -> str:
    """Train and verify the model; returns the path of PREFIX.model."""
    paths = expand_inputs(list(config.input))
    if not paths:
        raise ConfigError(f"--input: {' '.join(config.input)} contains no input file")
    # Every file's format is settled before the (long) reading starts.
    inputs = [
        (p, detect_format(p) if config.input_format == "auto" else config.input_format)
        for p in paths
    ]
    stream = _SentenceStream(config, inputs)
    out_dir = os.path.dirname(os.path.abspath(config.model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    start = time.monotonic()
    if config.tokenizer_type in WORDPIECE_TYPES:
        model_path = _train_wordpiece(config, stream)
        tok = WordPieceTokenizer(model_path, lower_case=WORDPIECE_TYPES[config.tokenizer_type])
        _report(config, model_path, tok, stream, len(paths), start)
        return model_path
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(stream),
            model_prefix=config.model_prefix,
            vocab_size=config.vocab_size,
            model_type=config.model_type,
            character_coverage=config.character_coverage,
            byte_fallback=config.byte_fallback,
            input_sentence_size=0,  # sampled by _SentenceStream
            max_sentence_length=config.max_sentence_length,
            num_threads=config.num_threads,
            pad_id=0,
            pad_piece=SPECIAL_PIECES[0],
            unk_id=1,
            unk_piece=SPECIAL_PIECES[1],
            bos_id=-1,
            eos_id=-1,
            user_defined_symbols=list(SPECIAL_PIECES[2:]),
            # Exactly --vocab-size pieces: the embedding table and every dataset's unigram
            # counts are sized from it. A corpus too small for it is reported below.
            hard_vocab_limit=True,
            minloglevel=0 if config.verbose else 1,
        )
    except RuntimeError as e:
        message = str(e)
        if stream.sampled == 0:
            raise ConfigError(f"--input: no text found in {len(paths)} file(s)") from None
        if "smaller than required_chars" in message:
            need = re.search(r"(\d+) vs (\d+)", message)
            raise ConfigError(
                f"--vocab-size: {config.vocab_size} cannot hold the "
                f"{need.group(2) if need else 'required'} pieces this corpus needs (its "
                f"characters at --character-coverage {config.character_coverage}, the specials"
                + (f" and {BYTE_PIECES} byte pieces" if config.byte_fallback else "")
                + "); raise --vocab-size or lower --character-coverage"
            ) from None
        if "Vocabulary size too high" in message:
            raise ConfigError(
                f"--vocab-size: {config.vocab_size} cannot be reached on this corpus "
                f"({stream.sentences} sentences): {message}"
            ) from None
        raise
    model_path = config.model_prefix + ".model"
    tok = Tokenizer(model_path)  # checks the special-id layout the rest of the package relies on
    _report(config, model_path, tok, stream, len(paths), start)
    return model_path


def _train_wordpiece(config: TrainTokenizerConfig, stream: _SentenceStream) -> str:
    """PREFIX-vocab.txt trained by the tokenizers library on the sampled sentences, with the
    specials first ([PAD]=0 ... [MASK]=4) as BertWordPieceTokenizer's trainer puts them."""
    from tokenizers.implementations import BertWordPieceTokenizer

    lower_case = WORDPIECE_TYPES[config.tokenizer_type]
    trainer = BertWordPieceTokenizer(lowercase=lower_case)
    trainer.train_from_iterator(
        iter(stream),
        vocab_size=config.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_PIECES),
        show_progress=config.verbose,
    )
    if stream.sampled == 0:
        raise ConfigError(f"--input: no text found in {len(config.input)} input(s)")
    model_path = config.model_prefix + "-vocab.txt"
    vocab = trainer.get_vocab()
    pieces = sorted(vocab, key=vocab.__getitem__)
    io.atomic_write(model_path, "".join(p + "\n" for p in pieces))
    return model_path


def _report(config, model_path: str, tok, stream: _SentenceStream, files: int, start) -> None:
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(stream.skipped.items())) or "none"
    logger.info(
        "trained %s: %d pieces on %d of the %d sentences read from %d documents in %d file(s) "
        "in %.1fs (skipped: %s)",
        model_path,
        tok.vocab_size,
        stream.sampled,
        stream.sentences,
        stream.documents,
        files,
        time.monotonic() - start,
        skipped,
    )
    if tok.vocab_size < config.vocab_size:
        logger.warning(
            "%s has %d pieces, fewer than --vocab-size %d: the corpus holds no more pieces seen "
            "at least twice",
            model_path,
            tok.vocab_size,
            config.vocab_size,
        )
    if stream.skipped["sentence_too_long"]:
        logger.warning(
            "%d sentences longer than --max-sentence-length=%d bytes were left out; consider "
            "--split-sentences",
            stream.skipped["sentence_too_long"],
            config.max_sentence_length,
        )


def main(argv: list[str] | None = None) -> int:
    return run_cli(
        tool_parser(
            "train_tokenizer.py",
            "Train a sentencepiece tokenizer with [PAD] [UNK] [CLS] [SEP] [MASK] at ids 0-4, or a "
            "BERT WordPiece vocabulary (--tokenizer-type BertWordPieceLowerCase).",
            (TrainTokenizerConfig, "tokenizer training"),
        ),
        argv,
        lambda args: train_tokenizer(dataclass_from_args(TrainTokenizerConfig, args)),
        user_errors=(CorpusError, LookupError, OSError),  # LookupError: no punkt data
    )


if __name__ == "__main__":
    sys.exit(main())

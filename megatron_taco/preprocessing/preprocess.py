"""Corpus -> Megatron indexed datasets (the engine behind ``taco-preprocess-data``).

Pipeline::

    main process (reader)            N worker processes                 main process (merge)
    iter_raw over the inputs   ->    parse_raw, sentence split,   ->    shards copied in batch
    batches of RawRecords,           one flat encode_batch call,        order into the final
    numbered 0, 1, 2, ...            own shard .bin/.idx + a table      .bin/.idx, verified,
    (bounded queue)                  batch -> (first seq, first doc)    renamed into place

JSON-lines inputs skip the per-record framing: the reader only finds line boundaries
(``corpora.iter_jsonl_blocks``) and a batch is a ``RawLines`` block, which for a plain file
is just (offset, length): the worker reads the lines itself. At document level the tokenizer
is fast enough that building, pickling and piping a RawRecord per line cost the reader about
a tenth of the tokenizer's CPU again.

* Memory stays flat whatever the input size: the task queue holds at most ``2 * workers``
  batches, and each batch is capped in records (``--chunk-size``) and bytes.
* Every worker writes its own shard, so there is no single-writer bottleneck. Batches are
  numbered by the reader and the merge concatenates them in that order (byte ranges of
  the shard files and slices of their index arrays, one Python step per batch, never per
  sequence), so the output is byte-identical whatever ``--workers`` and ``--chunk-size`` are.
* Nothing appears under a final name before the whole run succeeded: all files are built
  in a hidden temporary directory next to the outputs and ``os.replace``-d at the end
  (per dataset: the old .idx removed, .bin, unigram counts, then the new .idx). SIGINT and
  SIGTERM stop the workers and delete the temporary directory; after a SIGKILL it stays
  behind, is ignored by readers (it is hidden and has other names) and is deleted by the
  next run with the same output prefix.

Megatron's ``--partitions`` is not needed: Megatron splits the input into partitions so
that several pools can tokenize in parallel and merges them afterwards (with
``--split-sentences`` even in a second invocation). Here the workers already write shards
in parallel from one stream, and the merge is part of the run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from megatron_taco.arguments import option, require
from megatron_taco.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    data_file_path,
    index_file_path,
    unigram_path,
    write_index_header,
)
from megatron_taco.data.tokenizer import (
    SUMMARY_SUFFIX,
    check_tokenizer_options,
    load_config_tokenizer,
    load_tokenizer,
    tokenizer_file,
    tokenizer_record,
    tokenizer_type_option,
    vocab_file_option,
)
from megatron_taco.errors import ConfigError
from megatron_taco.preprocessing.corpora import (
    FORMATS,
    SKIP_REASONS,
    CorpusError,
    RawLines,
    RawRecord,
    Skipped,
    detect_format,
    expand_inputs,
    iter_jsonl_blocks,
    iter_raw,
    parse_raw,
)
from megatron_taco.preprocessing.text import DEFAULT_SENTENCE_SPLITTER, SENTENCE_SPLITTERS

__all__ = [
    "PARSE_ERROR",
    "BatchEncoder",
    "PreprocessConfig",
    "PreprocessError",
    "PreprocessInterrupted",
    "Preprocessor",
    "dataset_prefix",
    "preprocess",
    "summary_path",
    "unigram_path",
]

# A record whose parsing raised instead of returning Skipped (a bug or a pathological page
# deep in a 20 GB dump): counted and reported with its source, like any other skip, so one
# bad page cannot kill a day-long run.
PARSE_ERROR = "parse_error"
# Besides --chunk-size records, a batch is closed at this many payload bytes, so a corpus of
# whole books (one record = one book) cannot put gigabytes in flight.
MAX_BATCH_BYTES = 4 << 20
_EXAMPLES_PER_REASON = 3
_POLL_S = 0.2
_COMPRESSION_MAGIC = (b"\x1f\x8b", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd", b"BZh")


class PreprocessError(RuntimeError):
    """The run failed (a worker crashed, an input became unreadable); nothing was written."""


class PreprocessInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM stopped the run; temporary files were removed, nothing was written."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


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
        require(len(self.json_keys) > 0, cls, "json_keys", "at least one key is required")
        require(
            len(set(self.json_keys)) == len(self.json_keys),
            cls,
            "json_keys",
            f"duplicate key in {list(self.json_keys)}",
        )
        for key in self.json_keys:
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


# ---------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _InputFile:
    path: str
    fmt: str
    size: int
    compressed: bool


def _is_compressed(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(6)
    return head.startswith(_COMPRESSION_MAGIC)


def _check_inputs(cfg: PreprocessConfig) -> list[_InputFile]:
    for item in cfg.input:
        if not os.path.exists(item) and not re.search(r"[*?\[]", item):
            raise ConfigError(f"--input: {item} does not exist")
    try:
        files = expand_inputs(list(cfg.input))
    except (FileNotFoundError, OSError, CorpusError) as e:
        raise ConfigError(f"--input: {e}") from None
    if not files:
        raise ConfigError(f"--input: {' '.join(cfg.input)} contains no input files")
    out: list[_InputFile] = []
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
        out.append(_InputFile(path, fmt, os.path.getsize(path), _is_compressed(path)))
    return out


def _check_output(cfg: PreprocessConfig) -> str:
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    if not os.path.isdir(out_dir):
        raise ConfigError(f"--output-prefix: directory {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"--output-prefix: directory {out_dir} is not writable")
    return out_dir


def _make_splitter(name: str):
    from megatron_taco.preprocessing.text import SplitterUnavailableError, make_sentence_splitter

    try:
        return make_sentence_splitter(name)
    except SplitterUnavailableError as e:
        raise ConfigError(f"--sentence-splitter {name}: {e}") from None


# ---------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _WorkerSpec:
    tokenizer_model: str  # the file, whatever its type
    tokenizer_type: str
    json_keys: tuple[str, ...]
    splitter: Any  # a text.make_sentence_splitter() splitter, or None
    append_eod: bool
    min_chars: int
    shard_dir: str
    dtype: str
    encode_threads: int


@dataclass
class _KeyBatch:
    tokens: np.ndarray  # flat, int64, eod included
    seq_lengths: np.ndarray  # int64 [sequences]
    doc_seq_counts: np.ndarray  # int64 [documents]


@dataclass
class _EncodedBatch:
    per_key: dict[str, _KeyBatch]
    documents: int
    unk_tokens: int  # [UNK]s over all keys, for the per-corpus rate in the summary
    tokens: int
    skipped: Counter
    examples: dict[str, list[str]]


def _add_example(examples: dict[str, list[str]], reason: str, source: str) -> None:
    lst = examples.setdefault(reason, [])
    if len(lst) < _EXAMPLES_PER_REASON:
        lst.append(source)


class BatchEncoder:
    """parse -> split -> encode for one batch of RawRecords (runs inside a worker)."""

    def __init__(
        self,
        tokenizer,
        json_keys: tuple[str, ...],
        *,
        splitter=None,
        append_eod: bool = False,
        min_chars: int = 0,
        encode_threads: int = 1,
    ) -> None:
        self.tokenizer = tokenizer
        self.json_keys = tuple(json_keys)
        self.splitter = splitter
        self.append_eod = append_eod
        self.min_chars = min_chars
        self.encode_threads = encode_threads

    def encode(self, records: list[RawRecord | Skipped] | RawLines) -> _EncodedBatch:
        skipped: Counter = Counter()
        examples: dict[str, list[str]] = {}
        docs = []
        if isinstance(records, RawLines):
            records = records.records()
        for raw in records:
            if isinstance(raw, Skipped):  # framing skips of RawLines (blank, not UTF-8)
                skipped[raw.reason] += 1
                _add_example(examples, raw.reason, raw.source)
                continue
            try:
                res = parse_raw(raw, self.json_keys, min_chars=self.min_chars)
            except Exception as e:
                skipped[PARSE_ERROR] += 1
                _add_example(examples, PARSE_ERROR, f"{raw.source}: {type(e).__name__}: {e}")
                continue
            if isinstance(res, Skipped):
                skipped[res.reason] += 1
                _add_example(examples, res.reason, res.source)
            else:
                docs.append(res)

        # Sentences of all documents of all keys in ONE encode call: sentencepiece's
        # per-call thread start-up makes per-document calls ~5x slower. Key-major order so
        # each key's sentences are one contiguous range.
        texts: list[str] = []
        counts: dict[str, np.ndarray] = {}
        for key in self.json_keys:
            if self.splitter is not None:
                # One call for the whole batch: blingfire splits many lines per C call.
                per_doc = self.splitter.split_many([d.text[key] for d in docs])
            else:
                per_doc = [[d.text[key]] for d in docs]
            for sents in per_doc:
                texts.extend(sents)
            counts[key] = np.fromiter(map(len, per_doc), dtype=np.int64, count=len(per_doc))
        ids = self.tokenizer.encode_batch(texts, num_threads=self.encode_threads) if texts else []
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
        bounds = np.concatenate(([0], np.cumsum(lengths)))

        per_key: dict[str, _KeyBatch] = {}
        sent_start = 0
        for key in self.json_keys:
            n = int(counts[key].sum())
            lens = lengths[sent_start : sent_start + n]
            toks = flat[bounds[sent_start] : bounds[sent_start + n]]
            doc_of_sent = np.repeat(np.arange(len(docs)), counts[key])
            keep = lens > 0  # empty sentences are dropped; they carry no tokens
            per_key[key] = _KeyBatch(
                toks, lens[keep], np.bincount(doc_of_sent[keep], minlength=len(docs))
            )
            sent_start += n

        # A record none of whose fields produced a token is skipped as empty; one where only
        # some did keeps an empty document in the others, so document i of every key's
        # dataset comes from the same record.
        has_tokens = np.zeros(len(docs), dtype=bool)
        for kb in per_key.values():
            has_tokens |= kb.doc_seq_counts > 0
        for i in np.flatnonzero(~has_tokens):
            skipped["empty"] += 1
            _add_example(examples, "empty", docs[int(i)].source)
        for kb in per_key.values():
            kb.doc_seq_counts = kb.doc_seq_counts[has_tokens]
            if self.append_eod:
                self._append_eod(kb)
        return _EncodedBatch(
            per_key,
            int(has_tokens.sum()),
            int(np.count_nonzero(flat == self.tokenizer.unk_id)),
            int(flat.shape[0]),
            skipped,
            examples,
        )

    def _append_eod(self, kb: _KeyBatch) -> None:
        nonempty = kb.doc_seq_counts > 0
        if not nonempty.any():
            return
        last_seq = (np.cumsum(kb.doc_seq_counts) - 1)[nonempty]
        ends = np.cumsum(kb.seq_lengths)[last_seq]
        kb.tokens = np.insert(kb.tokens, ends, self.tokenizer.eod_id)
        kb.seq_lengths = kb.seq_lengths.copy()
        kb.seq_lengths[last_seq] += 1


def _shard_prefix(shard_dir: str, rank: int, key: str) -> str:
    return os.path.join(shard_dir, f"shard{rank:03d}_{key}")


def _doc_counts_path(shard_prefix: str) -> str:
    return shard_prefix + ".docs"


class _ShardWriter:
    """One worker's output, per key: a shard dataset in which each BATCH is one document
    (one add_document call per batch instead of one per real document keeps the builder
    off the profile), plus a raw int64 file with the number of sequences of every real
    document, in order. The table batch number -> documents in it comes back to the main
    process, which rebuilds the real document boundaries while merging."""

    def __init__(self, spec: _WorkerSpec, rank: int, vocab_size: int) -> None:
        self.dtype = np.dtype(spec.dtype)
        self.prefixes = {k: _shard_prefix(spec.shard_dir, rank, k) for k in spec.json_keys}
        self.builders = {
            k: IndexedDatasetBuilder(data_file_path(p), self.dtype)
            for k, p in self.prefixes.items()
        }
        self.doc_files = {k: open(_doc_counts_path(p), "wb") for k, p in self.prefixes.items()}  # noqa: SIM115
        self.unigram = {k: np.zeros(vocab_size, dtype=np.int64) for k in spec.json_keys}
        self.n_seqs = dict.fromkeys(spec.json_keys, 0)
        self.n_tokens = dict.fromkeys(spec.json_keys, 0)
        self.n_docs = 0
        self.batch_seq: list[int] = []
        self.batch_docs: list[int] = []
        self.skipped: Counter = Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, seq: int, enc: _EncodedBatch) -> None:
        self.batch_seq.append(seq)
        self.batch_docs.append(enc.documents)
        for key, kb in enc.per_key.items():
            # ids < vocab_size, which best_dtype is chosen to hold
            self.builders[key].add_document(kb.tokens.astype(self.dtype), kb.seq_lengths)
            self.doc_files[key].write(kb.doc_seq_counts.astype("<i8").tobytes())
            if kb.tokens.size:
                self.unigram[key] += np.bincount(kb.tokens, minlength=self.unigram[key].shape[0])
            self.n_seqs[key] += int(kb.seq_lengths.shape[0])
            self.n_tokens[key] += int(kb.tokens.shape[0])
        self.n_docs += enc.documents
        self.skipped.update(enc.skipped)
        for reason, srcs in enc.examples.items():
            for s in srcs:
                _add_example(self.examples, reason, s)

    def finish(self) -> dict:
        for key, builder in self.builders.items():
            builder.finalize(index_file_path(self.prefixes[key]))
            self.doc_files[key].close()
        return {
            "batch_seq": np.asarray(self.batch_seq, dtype=np.int64),
            "batch_docs": np.asarray(self.batch_docs, dtype=np.int64),
            "documents": self.n_docs,
            "sequences": self.n_seqs,
            "tokens": self.n_tokens,
            "unigram": self.unigram,
            "skipped": dict(self.skipped),
            "examples": self.examples,
        }


def _worker_main(spec: _WorkerSpec, rank: int, tasks, results) -> None:
    # Ctrl-C reaches the whole process group; the main process decides how to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        tokenizer = load_tokenizer(spec.tokenizer_model, spec.tokenizer_type)
        encoder = BatchEncoder(
            tokenizer,
            spec.json_keys,
            splitter=spec.splitter,
            append_eod=spec.append_eod,
            min_chars=spec.min_chars,
            encode_threads=spec.encode_threads,
        )
        shards = _ShardWriter(spec, rank, tokenizer.vocab_size)
        # Everything alive now (modules, the tokenizer) lives as long as the process: out
        # of the collector's sight, a full collection only walks the batch in flight. And a
        # batch allocates a few thousand containers (records, documents, id lists) that all
        # die with it: with the default threshold of 700 the collector ran several times per
        # batch for nothing.
        gc.freeze()
        gc.set_threshold(20_000, *gc.get_threshold()[1:])
        parent = mp.parent_process()
        while True:
            try:
                item = tasks.get(timeout=1.0)
            except queue.Empty:
                # The main process was SIGKILLed: nobody will ever merge this shard.
                if parent is not None and not parent.is_alive():
                    return
                continue
            if item is None:
                break
            seq, records = item
            enc = encoder.encode(records)
            shards.add(seq, enc)
            results.put(("batch", rank, (seq, enc.documents, enc.unk_tokens, enc.tokens)))
        results.put(("done", rank, shards.finish()))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


# The workers do no linear algebra, but importing numpy starts a BLAS thread per core in
# each of them (~50 ms of CPU per worker, and N workers x cores threads); sentencepiece has
# its own threads (encode_threads).
_MATH_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def _single_threaded_math():
    """The environment spawned workers inherit: one BLAS/OpenMP thread. Restored after."""
    saved = {k: os.environ.get(k) for k in _MATH_THREAD_VARS}
    os.environ.update(dict.fromkeys(_MATH_THREAD_VARS, "1"))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _WorkerPool:
    def __init__(self, target, spec: _WorkerSpec, n: int, on_batch) -> None:
        # spawn, not fork: workers must not inherit the reader's open decompressors, the
        # queue feeder threads or torch state a caller may have imported (forking a
        # threaded process can deadlock). It is the default on macOS and Windows anyway.
        ctx = mp.get_context("spawn")
        self.tasks = ctx.Queue(maxsize=2 * n)
        self.results = ctx.Queue()
        self.on_batch = on_batch
        self.done: dict[int, dict] = {}
        self.procs = [
            ctx.Process(
                target=target,
                args=(spec, rank, self.tasks, self.results),
                name=f"preprocess-worker-{rank}",
                daemon=True,
            )
            for rank in range(n)
        ]
        with _single_threaded_math():
            for p in self.procs:
                p.start()

    def _handle(self, msg) -> None:
        kind, rank = msg[0], msg[1]
        if kind == "batch":
            self.on_batch(*msg[2])
        elif kind == "done":
            self.done[rank] = msg[2]
        else:
            raise PreprocessError(f"worker {rank} failed:\n{msg[2]}")

    def poll(self, timeout: float = 0.0) -> None:
        """Handle worker messages, waiting up to ``timeout`` for the first one; raise if a
        worker failed or died."""
        # Return as soon as something arrived: waiting out the whole timeout after the last
        # worker's report used to add up to _POLL_S to every run.
        with contextlib.suppress(queue.Empty):
            msg = self.results.get(timeout=timeout) if timeout > 0 else self.results.get_nowait()
            while True:
                self._handle(msg)
                msg = self.results.get_nowait()
        for rank, p in enumerate(self.procs):
            if rank not in self.done and p.exitcode is not None:
                # Its last message may still be in the pipe (a traceback put just before exit).
                with contextlib.suppress(queue.Empty):
                    while True:
                        self._handle(self.results.get(timeout=0.5))
                if rank not in self.done:
                    if p.exitcode < 0:
                        how = f"was killed by {signal.Signals(-p.exitcode).name} (out of memory?)"
                    else:
                        how = (
                            f"exited with code {p.exitcode} before it could report an error "
                            "(its traceback, if any, is on stderr above)"
                        )
                    raise PreprocessError(f"worker {rank} (pid {p.pid}) {how}")

    def submit(self, item) -> None:
        while True:
            try:
                self.tasks.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                self.poll()

    def finish(self) -> list[dict]:
        """Every worker's report. Their shards are closed when they report, so the merge
        can start while the processes are still tearing down; ``join`` them afterwards."""
        for _ in self.procs:
            self.submit(None)
        while len(self.done) < len(self.procs):
            self.poll(timeout=_POLL_S)
        return [self.done[r] for r in range(len(self.procs))]

    def join(self) -> None:
        for p in self.procs:
            p.join()

    def terminate(self) -> None:
        # The queue's feeder thread would otherwise block interpreter exit on a full pipe.
        self.tasks.cancel_join_thread()
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


# ---------------------------------------------------------------------------------------
# input progress
# ---------------------------------------------------------------------------------------


class _InputMeter:
    """Bytes of input consumed so far, compressed bytes for compressed files.

    iter_raw owns the file objects, so the position is read from the kernel's offset of
    the descriptor open on the current file (/proc/self/fdinfo); that counts exactly the
    on-disk bytes the decompressor has pulled. Where that is unavailable (no /proc, or
    pyarrow reading by pread/mmap) the payload sizes stand in, capped at the file size.
    """

    def __init__(self) -> None:
        self.done = 0
        self._real: str | None = None
        self._size = 0
        self._estimate = 0
        self._proc = os.path.isdir("/proc/self/fdinfo")

    def start(self, f: _InputFile) -> None:
        self._real = os.path.realpath(f.path)
        self._size = f.size
        self._estimate = 0

    def add_bytes(self, n: int) -> None:
        self._estimate += n

    def add_payload(self, raw: RawRecord) -> int:
        p = raw.payload
        if isinstance(p, (str, bytes)):
            n = len(p)
        elif isinstance(p, dict):
            n = sum(len(v) for v in p.values() if isinstance(v, (str, bytes)))
        else:
            n = 0
        self._estimate += n
        return n

    def _fd_position(self) -> int | None:
        if not self._proc or self._real is None:
            return None
        best = None
        try:
            fds = os.listdir("/proc/self/fd")
        except OSError:
            return None
        for fd in fds:
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != self._real:
                    continue
                with open(f"/proc/self/fdinfo/{fd}") as info:
                    for line in info:
                        if line.startswith("pos:"):
                            pos = int(line.split()[1])
                            best = pos if best is None else max(best, pos)
                            break
            except (OSError, ValueError):
                continue
        return best or None

    def finish(self) -> None:
        self.done += self._size
        self._real = None

    def consumed(self) -> int:
        if self._real is None:
            return self.done
        pos = self._fd_position()
        if pos is None:
            pos = self._estimate
        return self.done + min(pos, self._size)


# ---------------------------------------------------------------------------------------
# merge
# ---------------------------------------------------------------------------------------


def _copy_range(src_fd: int, dst_fd: int, offset: int, count: int) -> None:
    while count > 0:
        try:
            n = os.copy_file_range(src_fd, dst_fd, count, offset)
        except (AttributeError, OSError):
            n = 0  # no copy_file_range (old kernel, other OS, some filesystems)
        if n == 0:
            data = os.pread(src_fd, min(count, 16 << 20), offset)
            if not data:
                raise PreprocessError(f"shard ended early while copying byte {offset}")
            n = os.write(dst_fd, data)
        offset += n
        count -= n


@dataclass
class _Piece:
    shard: int  # worker rank
    s0: int  # sequences [s0, s1) of that worker's shard
    s1: int
    b0: int  # bytes [b0, b1) of its .bin
    b1: int
    d0: int  # real documents [d0, d1) of its document counts
    d1: int


def _merge_key(
    key: str, shard_prefixes: list[str], reports: list[dict], out_prefix: str, dtype: np.dtype
) -> tuple[int, int]:
    """Concatenate every shard's batches in batch order into out_prefix.bin/.idx; returns
    (sequences, documents)."""
    shards = [IndexedDataset(p) for p in shard_prefixes]  # validates each shard
    doc_counts = [np.fromfile(_doc_counts_path(p), dtype="<i8") for p in shard_prefixes]
    pieces: dict[int, _Piece] = {}
    for rank, rep in enumerate(reports):
        sh = shards[rank]
        first_doc = np.concatenate(([0], np.cumsum(rep["batch_docs"])))
        if sh.num_documents != len(rep["batch_seq"]) or doc_counts[rank].shape[0] != first_doc[-1]:
            raise PreprocessError(
                f"{shard_prefixes[rank]}: shard holds {sh.num_documents} batches and "
                f"{doc_counts[rank].shape[0]} documents, its worker reported "
                f"{len(rep['batch_seq'])} and {int(first_doc[-1])}"
            )
        ends = (
            np.append(sh.pointers, sh.pointers[-1] + sh.sizes[-1] * dtype.itemsize)
            if len(sh)
            else [0]
        )
        di = sh.document_indices
        for i, b in enumerate(rep["batch_seq"].tolist()):
            s0, s1 = int(di[i]), int(di[i + 1])
            pieces[b] = _Piece(
                rank, s0, s1, int(ends[s0]), int(ends[s1]), int(first_doc[i]), int(first_doc[i + 1])
            )
    n_batches = len(pieces)
    if sorted(pieces) != list(range(n_batches)):
        missing = sorted(set(range(max(pieces, default=-1) + 1)) - set(pieces))
        raise PreprocessError(f"batches missing from the shards: {missing[:10]}")
    order = [pieces[b] for b in range(n_batches)]

    fds = [os.open(data_file_path(p), os.O_RDONLY) for p in shard_prefixes]
    try:
        out_fd = os.open(data_file_path(out_prefix), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for pc in order:
                _copy_range(fds[pc.shard], out_fd, pc.b0, pc.b1 - pc.b0)
        finally:
            os.close(out_fd)
    finally:
        for fd in fds:
            os.close(fd)

    n_seq = sum(pc.s1 - pc.s0 for pc in order)
    n_doc = sum(pc.d1 - pc.d0 for pc in order)
    # Streamed column by column, one slice per batch: the index of a 40 GB corpus is never
    # held in memory twice.
    with open(index_file_path(out_prefix), "wb") as f:
        write_index_header(f, dtype, n_seq, n_doc + 1)
        for pc in order:
            f.write(shards[pc.shard].sizes[pc.s0 : pc.s1].astype("<i4").tobytes())
        base = 0
        for pc in order:
            f.write(
                (shards[pc.shard].pointers[pc.s0 : pc.s1] - pc.b0 + base).astype("<i8").tobytes()
            )
            base += pc.b1 - pc.b0
        f.write(np.zeros(1, dtype="<i8").tobytes())
        base = 0
        for pc in order:
            counts = doc_counts[pc.shard][pc.d0 : pc.d1]
            if int(counts.sum()) != pc.s1 - pc.s0:
                raise PreprocessError(
                    f"{shard_prefixes[pc.shard]}: a batch of {pc.s1 - pc.s0} sequences has "
                    f"document counts adding up to {int(counts.sum())}"
                )
            f.write((base + np.cumsum(counts)).astype("<i8").tobytes())
            base += pc.s1 - pc.s0
    return n_seq, n_doc


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(out_dir: str, base: str) -> list[str]:
    """Temporary directories of earlier runs with this prefix whose process is gone."""
    pattern = re.compile(re.escape(f".{base}.tmp-") + r"(\d+)")
    removed = []
    for name in os.listdir(out_dir):
        m = pattern.fullmatch(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


class _SignalGuard:
    """While active, SIGINT, SIGTERM and SIGHUP raise PreprocessInterrupted, so one cleanup
    path serves Ctrl-C, `kill` and a closed terminal. Inside ``deferred()`` (the final
    renames, a few milliseconds) a signal is only recorded: stopping halfway would leave
    some datasets of this run and some of the previous one."""

    SIGNALS = tuple(s for s in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, s))

    def __init__(self) -> None:
        self.pending: int | None = None
        self._defer = False
        self._previous: dict[int, Any] = {}

    def _handler(self, signum, _frame) -> None:
        if self._defer:
            self.pending = signum
            return
        raise PreprocessInterrupted(signum)

    def __enter__(self) -> _SignalGuard:
        # signal.signal only works in the main thread; elsewhere the caller's handlers stay.
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, h in self._previous.items():
            signal.signal(sig, h)

    @contextlib.contextmanager
    def deferred(self):
        self._defer = True
        try:
            yield
        finally:
            self._defer = False


@dataclass
class _Progress:
    bar: Any
    log_interval: int
    start: float = field(default_factory=time.monotonic)
    documents: int = 0
    records: int = 0
    shown_bytes: int = 0
    last_docs: int = 0

    def update(self, consumed: int, force: bool = False) -> None:
        if self.bar is None:
            return
        if not force and self.documents - self.last_docs < self.log_interval:
            return
        self.last_docs = self.documents
        elapsed = max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"{self.documents:,} docs, {self.documents / elapsed:,.0f} docs/s", refresh=False
        )
        if consumed > self.shown_bytes:
            self.bar.update(consumed - self.shown_bytes)
            self.shown_bytes = consumed
        else:
            self.bar.refresh()


def _read_input(f: _InputFile, json_keys: tuple[str, ...]):
    # A generator of its own so that only errors of the reading itself, not of the queue
    # the records go to, are reported as this file's.
    try:
        yield from iter_raw(f.path, f.fmt, json_keys=tuple(json_keys))
    except (CorpusError, OSError) as e:
        raise PreprocessError(f"{f.path}: cannot read input: {e}") from e


def _read_jsonl_blocks(f: _InputFile, max_lines: int):
    try:
        yield from iter_jsonl_blocks(f.path, max_lines=max_lines, max_bytes=MAX_BATCH_BYTES)
    except (CorpusError, OSError) as e:
        raise PreprocessError(f"{f.path}: cannot read input: {e}") from e


class Preprocessor:
    """One preprocessing run. ``worker_target`` is the function each worker process runs."""

    worker_target = staticmethod(_worker_main)

    def __init__(self, config: PreprocessConfig, *, progress: bool = True) -> None:
        self.cfg = config
        self.progress = progress
        self._pool: _WorkerPool | None = None

    # -- validation (before any work) --------------------------------------------------
    def validate(self) -> None:
        cfg = self.cfg
        self.tokenizer = load_config_tokenizer(cfg)
        self.out_dir = _check_output(cfg)
        self.files = _check_inputs(cfg)
        self.splitter = _make_splitter(cfg.sentence_splitter) if cfg.split_sentences else None
        self.dtype = best_dtype(self.tokenizer.vocab_size)
        self.prefixes = {k: dataset_prefix(cfg.output_prefix, k, cfg.level) for k in cfg.json_keys}

    def run(self) -> dict:
        self.validate()
        cfg = self.cfg
        base = os.path.basename(cfg.output_prefix)
        stale = _remove_stale_temps(self.out_dir, base)
        if stale:
            print(
                f"removed stale temporary files of interrupted runs: {', '.join(stale)}",
                file=sys.stderr,
            )
        if cfg.partitions > 1:
            print(
                f"note: --partitions {cfg.partitions} ignored: the workers already write shards "
                "in parallel and merge them in this run",
                file=sys.stderr,
            )
        tmp_dir = os.path.join(self.out_dir, f".{base}.tmp-{os.getpid()}")
        cpus = os.cpu_count() or 1
        with _SignalGuard() as guard:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            os.mkdir(tmp_dir)
            try:
                shard_dir = os.path.join(tmp_dir, "shards")
                os.mkdir(shard_dir)
                spec = _WorkerSpec(
                    tokenizer_model=os.path.abspath(tokenizer_file(cfg)),
                    tokenizer_type=cfg.tokenizer_type,
                    json_keys=tuple(cfg.json_keys),
                    splitter=self.splitter,
                    append_eod=cfg.append_eod,
                    min_chars=cfg.min_chars,
                    shard_dir=shard_dir,
                    dtype=self.dtype.str,
                    # Threads inside sentencepiece only help when processes leave cores idle.
                    encode_threads=max(1, cpus // cfg.workers),
                )
                summary = self._run(spec, tmp_dir, shard_dir)
                with guard.deferred():
                    self._commit(tmp_dir)
            finally:
                # A second Ctrl-C must not cut the cleanup short. Workers go first: they
                # must not write into the directory being removed.
                with guard.deferred():
                    if self._pool is not None:
                        self._pool.terminate()
                        self._pool = None
                    shutil.rmtree(tmp_dir, ignore_errors=True)
        if guard.pending is not None:
            print(
                f"received {signal.Signals(guard.pending).name} while moving the finished "
                "outputs into place; they are complete",
                file=sys.stderr,
            )
        self._print_summary(summary)
        return summary

    def _run(self, spec: _WorkerSpec, tmp_dir: str, shard_dir: str) -> dict:
        cfg = self.cfg
        start = time.monotonic()
        any_compressed = any(f.compressed for f in self.files)
        total_bytes = sum(f.size for f in self.files)
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc="input (compressed bytes)" if any_compressed else "input",
                file=sys.stderr,
                mininterval=0.5 if sys.stderr.isatty() else 10.0,
                dynamic_ncols=True,
            )
        prog = _Progress(bar, cfg.log_interval, start=start)

        # Which input each batch came from (batches never span two files), for the [UNK]
        # rate per corpus: the one number that shows a tokenizer unfit for a corpus before
        # any pretraining (without byte fallback every character it never saw is [UNK]).
        batch_file: list[int] = []
        file_unk = np.zeros((len(self.files), 2), dtype=np.int64)  # [files, (unk, tokens)]

        def on_batch(seq: int, n_docs: int, unk: int, tokens: int) -> None:
            prog.documents += n_docs
            file_unk[batch_file[seq]] += (unk, tokens)

        pool = self._pool = _WorkerPool(self.worker_target, spec, cfg.workers, on_batch)
        meter = _InputMeter()
        reader_skips: Counter = Counter()
        reader_examples: dict[str, list[str]] = {}
        records_read = 0
        seq = 0
        batch: list[RawRecord] = []
        batch_bytes = 0
        current_file = 0

        def submit(work) -> None:
            nonlocal seq
            batch_file.append(current_file)
            pool.submit((seq, work))
            seq += 1
            pool.poll()
            if bar is not None:  # consumed() reads /proc; only the bar needs it
                prog.update(meter.consumed())

        try:
            for i, f in enumerate(self.files):
                current_file = i
                meter.start(f)
                if f.fmt == "jsonl":
                    # Framing JSON lines is splitting lines: whole blocks of undecoded lines
                    # go to the workers, which is far cheaper than a RawRecord per line
                    # built, pickled and unpickled (the reader's CPU is the workers' too).
                    for item in _read_jsonl_blocks(f, cfg.chunk_size):
                        if isinstance(item, Skipped):
                            records_read += 1
                            reader_skips[item.reason] += 1
                            _add_example(reader_examples, item.reason, item.source)
                            continue
                        records_read += item.count
                        meter.add_bytes(item.nbytes)
                        submit(item)
                    meter.finish()
                    continue
                for item in _read_input(f, cfg.json_keys):
                    records_read += 1
                    if isinstance(item, Skipped):
                        reader_skips[item.reason] += 1
                        _add_example(reader_examples, item.reason, item.source)
                        continue
                    batch.append(item)
                    batch_bytes += meter.add_payload(item)
                    if len(batch) >= cfg.chunk_size or batch_bytes >= MAX_BATCH_BYTES:
                        submit(batch)
                        batch, batch_bytes = [], 0
                if batch:  # a batch holds one file's records (the output does not change)
                    submit(batch)
                    batch, batch_bytes = [], 0
                meter.finish()
            reports = pool.finish()
        finally:
            if bar is not None:
                prog.update(meter.consumed(), force=True)
                bar.close()

        skipped = Counter(reader_skips)
        examples = {k: list(v) for k, v in reader_examples.items()}
        for rep in reports:
            skipped.update(rep["skipped"])
            for reason, srcs in rep["examples"].items():
                for s in srcs:
                    _add_example(examples, reason, s)
        documents = sum(rep["documents"] for rep in reports)
        if documents == 0:
            detail = ", ".join(f"{r}: {n}" for r, n in sorted(skipped.items())) or "no records"
            raise PreprocessError(
                f"no document was written from {records_read} records ({detail}); check "
                "--input-format, --json-keys and --min-chars"
            )

        datasets = {}
        for key in cfg.json_keys:
            out_prefix = os.path.join(tmp_dir, os.path.basename(self.prefixes[key]))
            shard_prefixes = [_shard_prefix(shard_dir, r, key) for r in range(cfg.workers)]
            n_seq, n_doc = _merge_key(key, shard_prefixes, reports, out_prefix, self.dtype)
            unigram = np.sum([rep["unigram"][key] for rep in reports], axis=0, dtype=np.int64)
            np.save(unigram_path(out_prefix), unigram)
            self._verify(out_prefix, key, n_seq, n_doc, reports, unigram)
            tokens = sum(rep["tokens"][key] for rep in reports)
            datasets[key] = {
                "prefix": self.prefixes[key],
                "documents": n_doc,
                "sequences": n_seq,
                "tokens": tokens,
            }
        shutil.rmtree(shard_dir)
        pool.join()
        self._pool = None  # all workers exited cleanly

        elapsed = time.monotonic() - start
        total_seqs = sum(d["sequences"] for d in datasets.values())
        summary = {
            "output_prefix": cfg.output_prefix,
            "level": cfg.level,
            "inputs": [f.path for f in self.files],
            "input_bytes": total_bytes,
            "input_bytes_are_compressed": any_compressed,
            "documents_read": records_read,
            "documents_written": documents,
            "skipped": {r: int(skipped.get(r, 0)) for r in (*SKIP_REASONS, PARSE_ERROR)},
            "skipped_examples": examples,
            "sentences": total_seqs if cfg.split_sentences else None,
            "sequences": total_seqs,
            "tokens": sum(d["tokens"] for d in datasets.values()),
            "datasets": datasets,
            "unk": _unk_summary(self.files, file_unk),
            "vocab_size": self.tokenizer.vocab_size,
            # what pretraining and taco-build-samples check the tokenizer they are given against
            "tokenizer": {
                **tokenizer_record(self.tokenizer),
                "path": os.path.abspath(self.tokenizer.model_path),
            },
            "dtype": str(self.dtype),
            "workers": cfg.workers,
            "elapsed_s": round(elapsed, 3),
            "input_mb_per_s": round(total_bytes / 1e6 / max(elapsed, 1e-9), 3),
            "documents_per_s": round(documents / max(elapsed, 1e-9), 1),
        }
        with open(
            os.path.join(tmp_dir, os.path.basename(summary_path(cfg.output_prefix))), "w"
        ) as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        return summary

    def _verify(self, prefix, key, n_seq, n_doc, reports, unigram) -> None:
        expect_seq = sum(rep["sequences"][key] for rep in reports)
        expect_doc = sum(rep["documents"] for rep in reports)
        ds = IndexedDataset(prefix)  # re-validates pointers against the .bin size
        problems = []
        if len(ds) != expect_seq or n_seq != expect_seq:
            problems.append(f"{len(ds)} sequences, workers wrote {expect_seq}")
        if ds.num_documents != expect_doc or n_doc != expect_doc:
            problems.append(f"{ds.num_documents} documents, workers wrote {expect_doc}")
        if int(ds.sizes.sum(dtype=np.int64)) != int(unigram.sum()):
            problems.append(
                f"{int(ds.sizes.sum())} tokens but unigram counts sum to {int(unigram.sum())}"
            )
        if problems:
            raise PreprocessError(
                f"{index_file_path(prefix)}: merged dataset is inconsistent: {'; '.join(problems)}"
            )

    def _commit(self, tmp_dir: str) -> None:
        """Move the finished files to their final names: per dataset the old index goes
        first and the new one comes last, so a reader never pairs an index with a data file
        of another run, even if this process dies between two renames."""
        for prefix in self.prefixes.values():
            tmp = os.path.join(tmp_dir, os.path.basename(prefix))
            with contextlib.suppress(FileNotFoundError):
                os.remove(index_file_path(prefix))
            os.replace(data_file_path(tmp), data_file_path(prefix))
            os.replace(unigram_path(tmp), unigram_path(prefix))
            os.replace(index_file_path(tmp), index_file_path(prefix))
        final = summary_path(self.cfg.output_prefix)
        os.replace(os.path.join(tmp_dir, os.path.basename(final)), final)

    def _print_summary(self, s: dict) -> None:
        lines = [
            f"preprocessed {len(s['inputs'])} input file(s), {s['input_bytes'] / 1e6:,.1f} MB"
            + (" (compressed size)" if s["input_bytes_are_compressed"] else ""),
            f"  documents read {s['documents_read']:,}, written {s['documents_written']:,}",
        ]
        skipped = {r: n for r, n in s["skipped"].items() if n}
        if skipped:
            lines.append("  skipped: " + ", ".join(f"{r} {n:,}" for r, n in skipped.items()))
        for d in s["datasets"].values():
            lines.append(
                f"  {d['prefix']}.bin/.idx: {d['documents']:,} documents, "
                f"{d['sequences']:,} {s['level']} sequences, {d['tokens']:,} tokens"
            )
        lines.extend(_unk_lines(s["unk"]))
        lines.append(
            f"  {s['elapsed_s']:.1f} s, {s['input_mb_per_s']:.2f} MB/s, "
            f"{s['documents_per_s']:,.0f} documents/s, {s['workers']} worker(s)"
        )
        lines.append(f"  summary: {summary_path(s['output_prefix'])}")
        print("\n".join(lines), flush=True)


# Above this share of [UNK] a corpus is flagged in the summary: a tokenizer trained on the
# corpus it encodes, with byte fallback, stays at 0; one trained without byte fallback on
# other text turns every unseen emoji, CJK character or rare symbol into [UNK].
UNK_WARN_RATE = 1e-3


def _unk_summary(files: list[_InputFile], file_unk: np.ndarray) -> dict:
    def rate(unk, tokens):
        return round(float(unk) / max(int(tokens), 1), 8)

    unk, tokens = (int(x) for x in file_unk.sum(axis=0))
    return {
        "tokens": unk,
        "rate": rate(unk, tokens),
        "per_input": {
            f.path: {"tokens": int(u), "rate": rate(u, t)} for f, (u, t) in zip(files, file_unk)
        },
    }


def _unk_lines(unk: dict) -> list[str]:
    lines = [f"  [UNK]: {unk['rate']:.4%} of the tokens ({unk['tokens']:,})"]
    per_input = unk["per_input"]
    if len(per_input) > 1:
        lines += [f"    {p}: {u['rate']:.4%} ({u['tokens']:,})" for p, u in per_input.items()]
    bad = [p for p, u in per_input.items() if u["rate"] > UNK_WARN_RATE]
    if bad:
        lines.append(
            f"  warning: [UNK] is above {UNK_WARN_RATE:.1%} of the tokens of {', '.join(bad)}: "
            "the tokenizer cannot spell part of this text; retrain it on this corpus "
            "(taco-train-tokenizer keeps --byte-fallback on by default)"
        )
    return lines


def preprocess(config: PreprocessConfig, *, progress: bool = True) -> dict:
    """Run the whole pipeline; returns the summary (also written to PREFIX_summary.json)."""
    return Preprocessor(config, progress=progress).run()

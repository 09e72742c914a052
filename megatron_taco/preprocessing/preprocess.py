"""Corpus -> Megatron indexed datasets (the engine behind ``taco-preprocess-data``).

Pipeline::

    main process (reader)            N worker processes                 main process (merge)
    iter_raw over the inputs   ->    parse_raw, sentence split,   ->    shards copied in batch
    batches of RawRecords,           one flat encode_batch call,        order into the final
    numbered 0, 1, 2, ...            own shard .bin/.idx + a table      .bin/.idx, verified,
    (bounded queue)                  batch -> (first seq, first doc)    renamed into place

JSON-lines inputs skip the per-record framing: the reader only finds line boundaries
(``jsonl.iter_jsonl_blocks``) and a batch is a ``RawLines`` block, which for a plain file
is just (offset, length): the worker reads the lines itself. At document level the tokenizer
is fast enough that building, pickling and piping a RawRecord per line cost the reader about
a tenth of the tokenizer's CPU again.

The parts: config.py (the flags, checked before any work), corpora.py (reading), encode.py
(one batch -> token ids), workers.py (the processes and the bounded queue), shards.py (each
worker's shard and the merge in batch order), staging.py (the temporary directory, signals,
the final renames), report.py (the progress bar and the summary).

Megatron's ``--partitions`` is not needed: Megatron splits the input into partitions so
that several pools can tokenize in parallel and merges them afterwards (with
``--split-sentences`` even in a second invocation). Here the workers already write shards
in parallel from one stream, and the merge is part of the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator

from megatron_taco.data.indexed_dataset import best_dtype
from megatron_taco.data.tokenizer import load_config_tokenizer, tokenizer_file
from megatron_taco.preprocessing.config import (
    InputFile,
    PreprocessConfig,
    PreprocessError,
    check_inputs,
    check_output,
    dataset_prefix,
    make_splitter,
    summary_path,
)
from megatron_taco.preprocessing.corpora import iter_raw
from megatron_taco.preprocessing.jsonl import RawLines, iter_jsonl_blocks
from megatron_taco.preprocessing.records import CorpusError, RawRecord, Skipped
from megatron_taco.preprocessing.report import Progress, Tally, build_summary, print_summary
from megatron_taco.preprocessing.shards import merge_shards
from megatron_taco.preprocessing.staging import (
    SignalGuard,
    commit,
    remove_stale_temps,
    temp_dir,
)
from megatron_taco.preprocessing.workers import WorkerPool, WorkerSpec, worker_main

# Besides --chunk-size records, a batch is closed at this many payload bytes, so a corpus of
# whole books (one record = one book) cannot put gigabytes in flight.
MAX_BATCH_BYTES = 4 << 20


def _input_errors(f: InputFile, items: Iterator):
    # A generator of its own so that only errors of the reading itself, not of the queue
    # the records go to, are reported as this file's.
    try:
        yield from items
    except (CorpusError, OSError) as e:
        raise PreprocessError(f"{f.path}: cannot read input: {e}") from e


class Preprocessor:
    """One preprocessing run. ``worker_target`` is the function each worker process runs."""

    worker_target = staticmethod(worker_main)

    def __init__(self, config: PreprocessConfig, *, progress: bool = True) -> None:
        self.cfg = config
        self.progress = progress
        self._pool: WorkerPool | None = None

    def validate(self) -> None:
        """Every check that needs no work done: tokenizer, output directory, inputs."""
        cfg = self.cfg
        self.tokenizer = load_config_tokenizer(cfg)
        self.out_dir = check_output(cfg)
        self.files = check_inputs(cfg)
        self.splitter = make_splitter(cfg.sentence_splitter) if cfg.split_sentences else None
        self.dtype = best_dtype(self.tokenizer.vocab_size)
        self.prefixes = {k: dataset_prefix(cfg.output_prefix, k, cfg.level) for k in cfg.json_keys}

    def run(self) -> dict:
        self.validate()
        cfg = self.cfg
        base = os.path.basename(cfg.output_prefix)
        stale = remove_stale_temps(self.out_dir, base)
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
        tmp_dir = temp_dir(self.out_dir, base)
        with SignalGuard() as guard:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            os.mkdir(tmp_dir)
            try:
                shard_dir = os.path.join(tmp_dir, "shards")
                os.mkdir(shard_dir)
                summary = self._run(tmp_dir, shard_dir)
                with guard.deferred():
                    commit(tmp_dir, list(self.prefixes.values()), summary_path(cfg.output_prefix))
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
        print_summary(summary)
        return summary

    def _worker_spec(self, shard_dir: str) -> WorkerSpec:
        cfg = self.cfg
        return WorkerSpec(
            tokenizer_model=os.path.abspath(tokenizer_file(cfg)),
            tokenizer_type=cfg.tokenizer_type,
            json_keys=tuple(cfg.json_keys),
            splitter=self.splitter,
            append_eod=cfg.append_eod,
            min_chars=cfg.min_chars,
            shard_dir=shard_dir,
            dtype=self.dtype.str,
            # Threads inside sentencepiece only help when processes leave cores idle.
            encode_threads=max(1, (os.cpu_count() or 1) // cfg.workers),
        )

    def _run(self, tmp_dir: str, shard_dir: str) -> dict:
        """Read, encode and merge into ``tmp_dir``; returns the summary, written there too."""
        start = time.monotonic()
        tally = Tally(len(self.files))
        prog = Progress(self.files, self.cfg.log_interval, show=self.progress, start=start)

        def on_batch(seq: int, n_docs: int, unk: int, tokens: int) -> None:
            prog.documents += n_docs
            tally.on_batch(seq, unk, tokens)

        spec = self._worker_spec(shard_dir)
        pool = self._pool = WorkerPool(self.worker_target, spec, self.cfg.workers, on_batch)
        try:
            self._feed(pool, prog, tally)
            reports = pool.finish()
        finally:
            prog.close()
        tally.add_reports(reports)
        if tally.documents == 0:
            detail = ", ".join(f"{r}: {n}" for r, n in sorted(tally.skips.counts.items()))
            raise PreprocessError(
                f"no document was written from {tally.records} records "
                f"({detail or 'no records'}); check --input-format, --json-keys and --min-chars"
            )
        datasets = merge_shards(shard_dir, reports, self.prefixes, tmp_dir, self.dtype)
        shutil.rmtree(shard_dir)
        pool.join()
        self._pool = None  # all workers exited cleanly
        elapsed = time.monotonic() - start
        summary = build_summary(
            self.cfg, self.files, tally, datasets, self.tokenizer, self.dtype, elapsed
        )
        name = os.path.basename(summary_path(self.cfg.output_prefix))
        with open(os.path.join(tmp_dir, name), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        return summary

    def _feed(self, pool: WorkerPool, prog: Progress, tally: Tally) -> None:
        """Stage 1 in this process: every input's batches to the workers, numbered in order."""
        for i, f in enumerate(self.files):
            prog.meter.start(f)
            batches = (
                self._blocks(f, prog, tally) if f.fmt == "jsonl" else self._batches(f, prog, tally)
            )
            for work in batches:
                tally.batch_file.append(i)
                pool.submit((len(tally.batch_file) - 1, work))
                pool.poll()
                prog.tick()
            prog.meter.finish()

    def _blocks(self, f: InputFile, prog: Progress, tally: Tally) -> Iterator[RawLines]:
        # Framing JSON lines is splitting lines: whole blocks of undecoded lines go to the
        # workers, which is far cheaper than a RawRecord per line built, pickled and
        # unpickled (the reader's CPU is the workers' too).
        blocks = iter_jsonl_blocks(f.path, max_lines=self.cfg.chunk_size, max_bytes=MAX_BATCH_BYTES)
        for item in _input_errors(f, blocks):
            if isinstance(item, Skipped):
                tally.records += 1
                tally.skips.add(item.reason, item.source)
                continue
            tally.records += item.count
            prog.meter.add_bytes(item.nbytes)
            yield item

    def _batches(self, f: InputFile, prog: Progress, tally: Tally) -> Iterator[list[RawRecord]]:
        batch: list[RawRecord] = []
        batch_bytes = 0
        for item in _input_errors(f, iter_raw(f.path, f.fmt, json_keys=tuple(self.cfg.json_keys))):
            tally.records += 1
            if isinstance(item, Skipped):
                tally.skips.add(item.reason, item.source)
                continue
            batch.append(item)
            batch_bytes += prog.meter.add_payload(item)
            if len(batch) >= self.cfg.chunk_size or batch_bytes >= MAX_BATCH_BYTES:
                yield batch
                batch, batch_bytes = [], 0
        if batch:  # a batch holds one file's records (the output does not change)
            yield batch


def preprocess(config: PreprocessConfig, *, progress: bool = True) -> dict:
    """Run the whole pipeline; returns the summary (also written to PREFIX_summary.json)."""
    return Preprocessor(config, progress=progress).run()

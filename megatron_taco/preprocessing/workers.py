"""The worker processes: each loads the tokenizer, encodes the batches it takes from a bounded
queue and writes its own shard. Memory stays flat whatever the input size: the queue holds at
most ``2 * workers`` batches, and each batch is capped in records and bytes by the reader."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import queue
import signal
import traceback
from dataclasses import dataclass
from typing import Any

from megatron_taco.data.tokenizer import load_tokenizer
from megatron_taco.preprocessing.config import PreprocessError
from megatron_taco.preprocessing.encode import BatchEncoder
from megatron_taco.preprocessing.shards import ShardWriter

_POLL_S = 0.2


@dataclass(frozen=True)
class WorkerSpec:
    tokenizer_model: str  # the file, whatever its type
    tokenizer_type: str
    json_keys: tuple[str, ...]
    splitter: Any  # a text.make_sentence_splitter() splitter, or None
    append_eod: bool
    min_chars: int
    shard_dir: str
    dtype: str
    encode_threads: int


def worker_main(spec: WorkerSpec, rank: int, tasks, results) -> None:
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
        shards = ShardWriter(spec.shard_dir, rank, spec.json_keys, spec.dtype, tokenizer.vocab_size)
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
MATH_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def single_threaded_math():
    """The environment spawned workers inherit: one BLAS/OpenMP thread. Restored after."""
    saved = {k: os.environ.get(k) for k in MATH_THREAD_VARS}
    os.environ.update(dict.fromkeys(MATH_THREAD_VARS, "1"))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class WorkerPool:
    def __init__(self, target, spec: WorkerSpec, n: int, on_batch) -> None:
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
        with single_threaded_math():
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

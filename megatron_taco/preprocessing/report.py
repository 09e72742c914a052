"""What a run reports: while it runs, a progress bar on stderr (input bytes consumed,
compressed bytes for compressed files, against their total, and documents per second); at
the end the summary of its counts, written to PREFIX_summary.json and printed."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

from megatron_taco.data.tokenizer import tokenizer_record
from megatron_taco.preprocessing.config import InputFile, PreprocessConfig, summary_path
from megatron_taco.preprocessing.encode import PARSE_ERROR, Skips
from megatron_taco.preprocessing.records import SKIP_REASONS, RawRecord


class InputMeter:
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

    def start(self, f: InputFile) -> None:
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
        best = 0
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
                            best = max(best, int(line.split()[1]))
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


class Progress:
    """The bar (None without ``show``), refreshed every ``log_interval`` documents."""

    def __init__(self, files: list[InputFile], log_interval: int, *, show: bool, start: float):
        self.meter = InputMeter()
        self.log_interval = log_interval
        self.start = start
        self.documents = 0
        self._shown_bytes = 0
        self._last_docs = 0
        self.bar: Any = None
        if show:
            from tqdm import tqdm

            compressed = any(f.compressed for f in files)
            self.bar = tqdm(
                total=sum(f.size for f in files),
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc="input (compressed bytes)" if compressed else "input",
                file=sys.stderr,
                mininterval=0.5 if sys.stderr.isatty() else 10.0,
                dynamic_ncols=True,
            )

    def tick(self, force: bool = False) -> None:
        if self.bar is None:  # consumed() reads /proc; only the bar needs it
            return
        if not force and self.documents - self._last_docs < self.log_interval:
            return
        self._last_docs = self.documents
        elapsed = max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"{self.documents:,} docs, {self.documents / elapsed:,.0f} docs/s", refresh=False
        )
        consumed = self.meter.consumed()
        if consumed > self._shown_bytes:
            self.bar.update(consumed - self._shown_bytes)
            self._shown_bytes = consumed
        else:
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.tick(force=True)
            self.bar.close()


# Above this share of [UNK] a corpus is flagged in the summary: a tokenizer trained on the
# corpus it encodes, with byte fallback, stays at 0; one trained without byte fallback on
# other text turns every unseen emoji, CJK character or rare symbol into [UNK].
UNK_WARN_RATE = 1e-3


class Tally:
    """What the main process counts: records read and the skips found while framing them,
    then the workers' skips and documents, and the [UNK]s per input, the one number that
    shows a tokenizer unfit for a corpus before any pretraining (without byte fallback every
    character it never saw is [UNK])."""

    def __init__(self, n_files: int) -> None:
        self.records = 0
        self.documents = 0
        self.skips = Skips()
        self.batch_file: list[int] = []  # the input of each batch (never two files)
        self.file_unk = np.zeros((n_files, 2), dtype=np.int64)  # [files, (unk, tokens)]

    def on_batch(self, seq: int, unk: int, tokens: int) -> None:
        self.file_unk[self.batch_file[seq]] += (unk, tokens)

    def add_reports(self, reports: list[dict]) -> None:
        for rep in reports:
            self.skips.update(rep["skips"])
        self.documents = sum(rep["documents"] for rep in reports)


def build_summary(
    cfg: PreprocessConfig,
    files: list[InputFile],
    tally: Tally,
    datasets: dict[str, dict],
    tokenizer,
    dtype: np.dtype,
    elapsed: float,
) -> dict:
    total_bytes = sum(f.size for f in files)
    total_seqs = sum(d["sequences"] for d in datasets.values())
    return {
        "output_prefix": cfg.output_prefix,
        "level": cfg.level,
        "inputs": [f.path for f in files],
        "input_bytes": total_bytes,
        "input_bytes_are_compressed": any(f.compressed for f in files),
        "documents_read": tally.records,
        "documents_written": tally.documents,
        "skipped": {r: int(tally.skips.counts.get(r, 0)) for r in (*SKIP_REASONS, PARSE_ERROR)},
        "skipped_examples": tally.skips.examples,
        "sentences": total_seqs if cfg.split_sentences else None,
        "sequences": total_seqs,
        "tokens": sum(d["tokens"] for d in datasets.values()),
        "datasets": datasets,
        "unk": _unk_summary(files, tally.file_unk),
        "vocab_size": tokenizer.vocab_size,
        # what pretraining and taco-build-samples check the tokenizer they are given against
        "tokenizer": {**tokenizer_record(tokenizer), "path": os.path.abspath(tokenizer.model_path)},
        "dtype": str(dtype),
        "workers": cfg.workers,
        "elapsed_s": round(elapsed, 3),
        "input_mb_per_s": round(total_bytes / 1e6 / max(elapsed, 1e-9), 3),
        "documents_per_s": round(tally.documents / max(elapsed, 1e-9), 1),
    }


def _unk_summary(files: list[InputFile], file_unk: np.ndarray) -> dict:
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


def print_summary(s: dict) -> None:
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

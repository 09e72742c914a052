"""The progress display on stderr: input bytes consumed (compressed bytes for compressed
files) against their total, and documents per second."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from megatron_taco.preprocessing.config import InputFile
from megatron_taco.preprocessing.records import RawRecord


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

"""JSON lines, the format of most corpora here (jsonl, and the JSON forms of wikiextractor and
cc-news): one record per line, framed without decoding. ``iter_jsonl_blocks`` frames in
bulk: ``RawLines`` blocks of undecoded lines whose ``records()`` are exactly what
``corpora.iter_raw`` yields for them, so the reader process builds, decodes and pickles
nothing per record."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass

from megatron_taco.preprocessing.records import CorpusError, RawRecord, Skipped, decode
from megatron_taco.preprocessing.streams import (
    check_file,
    compression_kind,
    corrupt_source,
    is_stream_error,
    numbered_lines,
    open_binary,
)


def _jsonl_record(line: bytes, src: str, fmt: str = "jsonl") -> RawRecord | Skipped:
    if not line or line.isspace():  # not line.strip(): no copy of every line
        return Skipped("empty", src)
    text = decode(line)
    if text is None:
        return Skipped("undecodable", src)
    return RawRecord(fmt, text, src)


def read_jsonl(path: str, fmt: str) -> Iterator[RawRecord | Skipped]:
    for lineno, line in numbered_lines(path):
        yield _jsonl_record(line, f"{path}:{lineno}", fmt)


@dataclass(frozen=True)
class RawLines:
    """Lines ``first_lineno`` .. ``first_lineno + count - 1`` of the JSON-lines file ``path``,
    framed but not decoded: ``nbytes`` bytes, newlines included. From a compressed file the
    block carries the ``lines``; from a plain file only where they are (``offset``), and
    ``records()`` reads them there, so a reader process hands blocks to workers without
    ever copying their text to them."""

    path: str
    first_lineno: int
    count: int
    nbytes: int
    lines: list[bytes] | None = None
    offset: int = -1

    def read_lines(self) -> list[bytes]:
        if self.lines is not None:
            return self.lines
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.nbytes)
        lines = list(io.BytesIO(data))  # split after each b"\n", as iterating the file does
        if len(data) != self.nbytes or len(lines) != self.count:
            raise CorpusError(
                f"{self.path}: changed while being read (lines {self.first_lineno} to "
                f"{self.first_lineno + self.count - 1} are no longer at byte {self.offset})"
            )
        return lines

    def records(self) -> list[RawRecord | Skipped]:
        """What ``iter_raw(path, "jsonl")`` yields for these lines."""
        path, first = self.path, self.first_lineno
        return [
            _jsonl_record(line, f"{path}:{first + i}") for i, line in enumerate(self.read_lines())
        ]


_SCAN_BYTES = 4 << 20


def _plain_jsonl_blocks(path: str, max_lines: int, max_bytes: int) -> Iterator[RawLines]:
    # Only the line boundaries are needed here: bytes.find() over a reused buffer (a fresh
    # 4 MB bytes object per read costs more in page faults than the read itself).
    first, offset = 1, 0  # of the next block
    buf = bytearray(_SCAN_BYTES)
    filled, eof = 0, False  # buf[:filled]: the file from offset on, not in a block yet
    with open(path, "rb", buffering=0) as f:
        while True:
            start = 0
            while True:
                end, count = start, 0
                while count < max_lines and end - start < max_bytes:
                    nl = buf.find(b"\n", end, filled)
                    if nl < 0:
                        break
                    end, count = nl + 1, count + 1
                if count < max_lines and end - start < max_bytes:  # ran out of lines
                    if not eof:
                        break  # read on
                    if end < filled:  # the file's last line, without a newline
                        end, count = filled, count + 1
                    if count == 0:
                        return
                yield RawLines(path, first, count, end - start, offset=offset)
                first, offset, start = first + count, offset + end - start, end
            buf[: filled - start] = buf[start:filled]
            filled -= start
            if filled == len(buf):  # a line longer than the buffer
                buf.extend(bytes(len(buf)))
            with memoryview(buf) as view:
                n = f.readinto(view[filled:])
            eof = n == 0
            filled += n


def _stream_jsonl_blocks(path: str, max_lines: int, max_bytes: int) -> Iterator[RawLines | Skipped]:
    lines: list[bytes] = []
    first, size = 1, 0
    try:
        with open_binary(path) as f:
            for line in f:
                lines.append(line)
                size += len(line)
                if len(lines) >= max_lines or size >= max_bytes:
                    yield RawLines(path, first, len(lines), size, lines)
                    first += len(lines)
                    lines, size = [], 0
    except Exception as e:
        if not is_stream_error(e):
            raise
        if lines:
            yield RawLines(path, first, len(lines), size, lines)
        yield Skipped("undecodable", corrupt_source(path, e))
        return
    if lines:
        yield RawLines(path, first, len(lines), size, lines)


def iter_jsonl_blocks(
    path: str | os.PathLike, *, max_lines: int, max_bytes: int
) -> Iterator[RawLines | Skipped]:
    """``iter_raw(path, "jsonl")`` in blocks of at most ``max_lines`` lines and (unless one
    line is longer) ``max_bytes`` bytes. A truncated or corrupt compressed stream ends the
    file with the same ``Skipped`` as ``iter_raw``, after the blocks of lines before it."""
    path = os.fspath(path)
    if max_lines < 1:
        raise ValueError(f"max_lines must be >= 1, got {max_lines}")
    check_file(path)
    try:
        with open(path, "rb") as f:
            head = f.read(10)
    except OSError as e:
        raise CorpusError(f"{path}: cannot open ({e.strerror or e})") from e
    if compression_kind(head) is None:
        yield from _plain_jsonl_blocks(path, max_lines, max_bytes)
    else:
        yield from _stream_jsonl_blocks(path, max_lines, max_bytes)

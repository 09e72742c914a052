"""Opening corpus files: gzip, bzip2, xz or zstd detected from the magic bytes, not the name,
and which errors mean a truncated or corrupt stream (counted as ``Skipped("undecodable")``,
ending the file) rather than a failing disk (fatal)."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import os
import tarfile
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Iterator
from typing import BinaryIO

from megatron_taco.preprocessing.records import CorpusError

COMPRESSION_EXTS = (".gz", ".bz2", ".xz", ".zst", ".zstd")


class _Wrapper(io.RawIOBase):
    """Reads of ``raw`` served from ``_buf`` first; closing it closes ``raw``."""

    def __init__(self, raw, buf: bytes = b""):
        self._raw = raw
        self._buf = buf

    def readable(self) -> bool:
        return True

    def _from_buf(self, b) -> int:
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class Prefixed(_Wrapper):
    """``head`` followed by the rest of ``raw``: lets us sniff magic bytes on streams that
    cannot seek (tar members in streaming mode, decompressors)."""

    def __init__(self, head: bytes, raw):
        super().__init__(raw, head)

    def readinto(self, b) -> int:
        if self._buf:
            return self._from_buf(b)
        data = self._raw.read(len(b))
        b[: len(data)] = data
        return len(data)


class _ZstdReader(_Wrapper):
    """Multi-frame zstd decoding that, unlike zstandard's stream_reader, notices a stream
    cut off in the middle of a frame (it would silently return a short read)."""

    def __init__(self, raw, name: str):
        try:
            import zstandard
        except ImportError as e:
            raise CorpusError(
                f"{name}: zstd-compressed input needs the zstandard package (pip install zstandard)"
            ) from e
        super().__init__(raw)
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False

    def readinto(self, b) -> int:
        while not self._buf:
            chunk = self._raw.read(1 << 17)
            if not chunk:
                if self._in_frame:
                    raise EOFError(
                        "Compressed file ended before the end-of-stream marker was reached"
                    )
                return 0
            while chunk:
                if self._obj.eof:
                    self._obj = self._dctx.decompressobj()
                self._in_frame = True
                self._buf += self._obj.decompress(chunk)
                if self._obj.eof:
                    self._in_frame = False
                    chunk = self._obj.unused_data
                else:
                    chunk = b""
        return self._from_buf(b)


def compression_kind(head: bytes) -> str | None:
    if head.startswith(b"\x1f\x8b"):
        return "gz"
    if head.startswith(b"\xfd7zXZ\x00"):
        return "xz"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zst"
    # "BZh" + block size digit + block magic (pi) or end-of-stream magic (sqrt(pi)); the
    # full check keeps a text file that happens to start with "BZh" from being misread.
    if (
        head[:3] == b"BZh"
        and head[3:4] in b"123456789"
        and head[4:10] in (b"1AY&SY", b"\x17rE8P\x90")
    ):
        return "bz2"
    return None


def is_tar(head: bytes) -> bool:
    return len(head) >= 262 and head[257:262] == b"ustar"


def decompress(raw, name: str) -> BinaryIO:
    """Wrap a binary stream so that it reads decompressed bytes (one level)."""
    head = raw.read(10)
    stream = Prefixed(head, raw)
    kind = compression_kind(head)
    if kind == "gz":
        return gzip.GzipFile(fileobj=stream, mode="rb")
    if kind == "bz2":
        return bz2.BZ2File(stream, mode="rb")
    if kind == "xz":
        return lzma.LZMAFile(stream, mode="rb")
    if kind == "zst":
        return io.BufferedReader(_ZstdReader(stream, name), buffer_size=1 << 20)
    return io.BufferedReader(stream, buffer_size=1 << 20)


def check_file(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"input not found: {path}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a directory, expected a file")


def open_binary(path: str | os.PathLike) -> BinaryIO:
    """Decompressed bytes of ``path``; gzip/bzip2/xz/zstd are detected from magic bytes."""
    path = os.fspath(path)
    check_file(path)
    try:
        raw = open(path, "rb")  # noqa: SIM115 - ownership passes to the returned stream
    except OSError as e:
        raise CorpusError(f"{path}: cannot open ({e.strerror or e})") from e
    return decompress(raw, path)


def _stream_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [
        EOFError,
        zlib.error,
        lzma.LZMAError,
        tarfile.ReadError,
        ET.ParseError,
    ]
    with contextlib.suppress(ImportError):
        import zstandard

        errors.append(zstandard.ZstdError)
    with contextlib.suppress(ImportError):
        import pyarrow

        errors.append(pyarrow.ArrowException)
    return tuple(errors)


def is_stream_error(exc: BaseException) -> bool:
    if isinstance(exc, _stream_errors()):
        return True
    # bz2 and gzip report corrupt data as a plain OSError without an errno; a real I/O
    # failure (disk, NFS) carries one and must stay fatal.
    return (type(exc) is OSError or isinstance(exc, gzip.BadGzipFile)) and exc.errno is None


def corrupt_source(path: str, e: BaseException) -> str:
    return f"{path}: truncated or corrupt data, rest of file skipped ({type(e).__name__}: {e})"


def strip_compression(name: str) -> str:
    for ext in COMPRESSION_EXTS:
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    with open_binary(path) as f:
        yield from enumerate(f, 1)

"""Reading the raw pretraining corpora.

Reading is split in two stages so that the single reader process of the preprocessor only
does cheap I/O and the workers do the heavy parsing:

* ``iter_raw(path, fmt)`` decompresses and frames records (a JSON line, a wiki page, a tar
  member, a parquet row) and decodes UTF-8. It yields picklable ``RawRecord``s, or
  ``Skipped`` for what cannot be framed or decoded.
* ``parse_raw(raw, json_keys)`` runs in the workers: JSON decoding, wikitext -> plain text,
  field selection, cleaning, length filters. It returns a ``Document`` or a ``Skipped``.

``iter_records`` chains the two for single-process use. For JSON lines, where framing is
only splitting lines, ``iter_jsonl_blocks`` frames in bulk: it yields ``RawLines`` blocks of
undecoded lines whose ``records()`` are exactly what ``iter_raw`` yields for them, so the
reader builds, decodes and pickles nothing per record.

Document text follows the convention of ``text.py``: one paragraph per line. For formats
with a single natural text (everything except ``jsonl`` and ``parquet``) that text is stored
under the first json key; further json keys are looked up in the record's metadata (e.g.
``title`` or ``url``) and are ``missing_key`` when the format has no such field.

Per-format layout (``FORMATS``):

wikipedia-xml
    pages-articles(-multistream).xml[.bz2] from dumps.wikimedia.org, any export schema
    version (0.10, 0.11, ...). Streamed with iterparse; only namespace 0 pages, redirects
    skipped; the latest revision's wikitext goes through ``text.wikitext_to_plain``.
wikiextractor
    WikiExtractor output tree (AA/wiki_00, optionally .bz2), either ``--json`` lines
    ({"id", "url", "title", "text"}) or ``<doc id=.. url=.. title=..>`` blocks. In the
    ``<doc>`` form WikiExtractor repeats the title as the first body line; it is removed so
    both forms give the same text.
bookcorpus
    One plain-text book per file (a directory of books: pass the directory).
bookcorpus-lines
    One sentence per line, documents separated by one or more blank lines (the layout of
    the sentence-per-line BookCorpus exports). A file without blank lines would be one
    enormous document, so a document is also closed after ``BOOKCORPUS_MAX_LINES`` lines.
openwebtext
    openwebtext.tar.xz, whose members are urlsf_subsetNN-M_data.xz files that are
    themselves xz-compressed tars of .txt documents, the urlsf_subset*.xz files alone, or an
    extracted folder of .txt files. One document per .txt file.
cc-news
    news-please output: one article per .json file, JSON lines of articles, or parquet /
    arrow exports. Text = title + "\\n" + maintext (``text`` when there is no ``maintext``,
    as in the Hugging Face export); ``description`` is not used because news sites repeat
    it as the lead paragraph of the article.
jsonl
    Loose JSON lines; each json key is one field (Megatron's --json-keys).
parquet
    .parquet / .arrow (IPC file or stream, as in Hugging Face caches) / .feather, read in
    record batches; each json key is one column.

Every file may be compressed with gzip, bzip2, xz or zstd (detected from its magic bytes,
not its name). A compressed stream that is truncated or corrupt is counted once as
``Skipped("undecodable", "<file>: ...")`` and ends that file; records before it are kept.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import io
import json
import logging
import lzma
import os
import re
import tarfile
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO, TextIO

from megatron_taco.preprocessing.text import normalize_text, wikitext_to_plain

__all__ = [
    "BOOKCORPUS_MAX_LINES",
    "FORMATS",
    "SKIP_REASONS",
    "CorpusError",
    "Document",
    "RawLines",
    "RawRecord",
    "Skipped",
    "detect_format",
    "expand_inputs",
    "iter_jsonl_blocks",
    "iter_raw",
    "iter_records",
    "open_binary",
    "open_text",
    "parse_raw",
]

FORMATS = (
    "auto",
    "wikipedia-xml",
    "wikiextractor",
    "bookcorpus",
    "bookcorpus-lines",
    "openwebtext",
    "cc-news",
    "jsonl",
    "parquet",
)

SKIP_REASONS = {
    "empty": "no text after cleaning (blank line, empty article, null field)",
    "malformed_json": "not a JSON object, or a selected field is not text",
    "undecodable": "invalid UTF-8, broken framing, or a truncated/corrupt compressed stream",
    "too_short": "a selected field is shorter than min_chars after cleaning",
    "redirect": "wiki redirect page",
    "non_main_namespace": "wiki page outside the article namespace (Talk:, User:, ...)",
    "missing_key": "a json key is absent from the record",
}

# About the length of a long novel; see the module docstring (bookcorpus-lines).
BOOKCORPUS_MAX_LINES = 20_000

_TABLE_EXTS = (".parquet", ".arrow", ".feather")
_COMPRESSION_EXTS = (".gz", ".bz2", ".xz", ".zst", ".zstd")
_TAR_EXTS = (".tar", ".tgz", ".tbz2", ".txz", ".tzst")
_BATCH_ROWS = 1024
_MAX_NESTING = 3  # archives inside archives (openwebtext has 2 levels)
_CC_NEWS_TEXT_FIELDS = ("title", "maintext", "text")


class CorpusError(ValueError):
    """An input that cannot be read at all (unknown format, unreadable file, bad column).
    The message names the file."""


@dataclass(frozen=True)
class Document:
    text: dict[str, str]
    source: str


@dataclass(frozen=True)
class Skipped:
    reason: str
    source: str


@dataclass(frozen=True)
class RawRecord:
    fmt: str
    payload: str | bytes | dict
    source: str


# ---------------------------------------------------------------------------------------
# decompression
# ---------------------------------------------------------------------------------------


class _Prefixed(io.RawIOBase):
    """``head`` followed by the rest of ``raw``: lets us sniff magic bytes on streams that
    cannot seek (tar members in streaming mode, decompressors)."""

    def __init__(self, head: bytes, raw):
        self._head = head
        self._raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._raw.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _ZstdReader(io.RawIOBase):
    """Multi-frame zstd decoding that, unlike zstandard's stream_reader, notices a stream
    cut off in the middle of a frame (it would silently return a short read)."""

    def __init__(self, raw, name: str):
        try:
            import zstandard
        except ImportError as e:
            raise CorpusError(
                f"{name}: zstd-compressed input needs the zstandard package (pip install zstandard)"
            ) from e
        self._raw = raw
        self._name = name
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False
        self._buf = b""

    def readable(self) -> bool:
        return True

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
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


def _compression(head: bytes) -> str | None:
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


def _is_tar(head: bytes) -> bool:
    return len(head) >= 262 and head[257:262] == b"ustar"


def _decompress(raw, name: str) -> BinaryIO:
    """Wrap a binary stream so that it reads decompressed bytes (one level)."""
    head = raw.read(10)
    stream = _Prefixed(head, raw)
    kind = _compression(head)
    if kind == "gz":
        return gzip.GzipFile(fileobj=stream, mode="rb")
    if kind == "bz2":
        return bz2.BZ2File(stream, mode="rb")
    if kind == "xz":
        return lzma.LZMAFile(stream, mode="rb")
    if kind == "zst":
        return io.BufferedReader(_ZstdReader(stream, name), buffer_size=1 << 20)
    return io.BufferedReader(stream, buffer_size=1 << 20)


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"input not found: {path}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a directory, expected a file")


def open_binary(path: str | os.PathLike) -> BinaryIO:
    """Decompressed bytes of ``path``; gzip/bzip2/xz/zstd are detected from magic bytes."""
    path = os.fspath(path)
    _check_file(path)
    try:
        raw = open(path, "rb")  # noqa: SIM115 - ownership passes to the returned stream
    except OSError as e:
        raise CorpusError(f"{path}: cannot open ({e.strerror or e})") from e
    return _decompress(raw, path)


def open_text(path: str | os.PathLike) -> TextIO:
    """Decompressed UTF-8 text of ``path``, strict decoding (readers turn an invalid byte
    sequence into ``Skipped("undecodable")``; a plain read raises UnicodeDecodeError)."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="strict")


def _stream_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [
        EOFError,
        zlib.error,
        lzma.LZMAError,
        tarfile.ReadError,
        ET.ParseError,
    ]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    try:
        import pyarrow

        errors.append(pyarrow.ArrowException)
    except ImportError:
        pass
    return tuple(errors)


def _is_stream_error(exc: BaseException) -> bool:
    if isinstance(exc, _stream_errors()):
        return True
    # bz2 and gzip report corrupt data as a plain OSError without an errno; a real I/O
    # failure (disk, NFS) carries one and must stay fatal.
    return (type(exc) is OSError or isinstance(exc, gzip.BadGzipFile)) and exc.errno is None


# ---------------------------------------------------------------------------------------
# inputs and format detection
# ---------------------------------------------------------------------------------------

logger = logging.getLogger(__name__)
_GLOB_CHARS = re.compile(r"[*?\[]")


# In a corpus folder, files that are clearly not corpus text: documentation, code, images,
# checksums and licence files that ship beside the data (examples/corpus/ has two).
_NOT_CORPUS_EXTS = (
    ".md", ".rst", ".py", ".pyc", ".sh", ".ipynb", ".cfg", ".ini", ".toml", ".yaml", ".yml",
    ".lock", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf", ".css", ".js",
    ".sha1", ".sha256", ".sha512", ".md5", ".sig", ".asc",
)  # fmt: skip
_NOT_CORPUS_NAMES = re.compile(
    r"^(readme|license|licence|copying|notice|authors|attribution|changelog)(\.txt)?$", re.I
)


def is_corpus_candidate(name: str) -> bool:
    """False for a file a directory walk should leave out (see _NOT_CORPUS_EXTS)."""
    return not (name.lower().endswith(_NOT_CORPUS_EXTS) or _NOT_CORPUS_NAMES.match(name))


def _walk(directory: str) -> list[str]:
    found, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=True):
        # Hidden files and folders are editor/VCS/OS metadata (.git, .DS_Store), never data.
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for f in filenames:
            if f.startswith("."):
                continue
            (found if is_corpus_candidate(f) else skipped).append(os.path.join(dirpath, f))
    if skipped:
        names = ", ".join(os.path.basename(p) for p in sorted(skipped)[:3])
        more = ", ..." if len(skipped) > 3 else ""
        logger.info(
            "%s: skipped %d file(s) that are not corpus files (%s%s); name a file to read it anyway",
            directory, len(skipped), names, more,
        )  # fmt: skip
    return sorted(found)


def expand_inputs(inputs: list[str] | str) -> list[str]:
    """Files named by ``inputs`` (files, directories walked recursively, globs with ``**``):
    inputs in the given order, each expanded in sorted order, duplicates dropped."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    out: list[str] = []
    seen: set[str] = set()
    for item in inputs:
        item = os.fspath(item)
        if os.path.isdir(item):
            files = _walk(item)
        elif os.path.isfile(item):
            files = [item]
        elif _GLOB_CHARS.search(item):
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                raise FileNotFoundError(f"input pattern matched no files: {item}")
            files = []
            for m in matches:
                files.extend(_walk(m) if os.path.isdir(m) else [m])
        else:
            raise FileNotFoundError(f"input not found: {item}")
        for f in files:
            key = os.path.normpath(f)
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def _strip_compression(name: str) -> str:
    for ext in _COMPRESSION_EXTS:
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def _json_format(obj: dict) -> str:
    keys = set(obj)
    if keys & {"maintext", "date_publish", "source_domain"}:
        return "cc-news"
    if {"title", "text", "description", "domain"} <= keys:
        return "cc-news"  # the Hugging Face cc_news export
    if {"id", "url", "title", "text"} <= keys and "wiki" in str(obj.get("url", "")):
        return "wikiextractor"
    return "jsonl"


def _table_columns(path: str) -> list[str]:
    return list(_open_table(path, "parquet")[0].names)


def _read_head(path: str, limit: int) -> tuple[bytes, Exception | None]:
    """Up to ``limit`` decompressed bytes, and the stream error that stopped the read early
    if any: a truncated file is still detected from what precedes the cut."""
    chunks: list[bytes] = []
    size = 0
    try:
        with open_binary(path) as f:
            while size < limit:
                # read1: one underlying read, so bytes decoded before a cut are not lost
                chunk = f.read1(min(1 << 14, limit - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except Exception as e:
        if not _is_stream_error(e):
            raise
        return b"".join(chunks), e
    return b"".join(chunks), None


def detect_format(path: str) -> str:
    """The corpus format of a file (or of the files of a directory), from its name and, when
    the name is not enough, its first decompressed bytes. Raises CorpusError naming the
    file when no format fits."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"input not found: {path}")
    if os.path.isdir(path):
        files = expand_inputs([path])
        if not files:
            raise CorpusError(f"{path}: directory contains no input files")
        fmts = sorted({detect_format(f) for f in files})
        if len(fmts) != 1:
            raise CorpusError(
                f"{path}: files of several formats {fmts}; pass --input-format or split the inputs"
            )
        return fmts[0]

    name = os.path.basename(path).lower()
    base = _strip_compression(name)
    if base.endswith(_TABLE_EXTS):
        fmt = _json_format(dict.fromkeys(_table_columns(path)))
        return "cc-news" if fmt == "cc-news" else "parquet"
    if base.endswith(_TAR_EXTS) or name.endswith(_TAR_EXTS) or name.startswith("urlsf_subset"):
        return "openwebtext"
    if base.endswith(".xml") or "pages-articles" in name or "pages-meta" in name:
        return "wikipedia-xml"
    if re.fullmatch(r"wiki_\d+", base):
        return "wikiextractor"

    head, error = _read_head(path, 1 << 16)
    if _is_tar(head):
        return "openwebtext"
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
    stripped = text.lstrip()
    first_line = stripped.split("\n", 1)[0].strip()
    if stripped.startswith(("<mediawiki", "<?xml")):
        return "wikipedia-xml"
    if first_line.startswith("<doc "):
        return "wikiextractor"
    if first_line.startswith("{"):
        try:
            obj = json.loads(first_line)
        except json.JSONDecodeError:
            obj = None
        if obj is None and len(head) < (1 << 16) and error is None:
            # A pretty-printed single JSON object (news-please writes one per file).
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                obj = None
        if isinstance(obj, dict):
            return _json_format(obj)
        if obj is None and first_line == "{" and '"maintext"' in text:
            return "cc-news"  # a news-please article larger than the sniffed head
        if base.endswith((".json", ".jsonl", ".ndjson")):
            return "jsonl"  # malformed first line: the records themselves will be counted
    if base.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if base.endswith(".txt") or "." not in base:
        parts = os.path.normpath(os.path.abspath(path)).lower().split(os.sep)
        if any(p.startswith(("urlsf_subset", "openwebtext")) for p in parts[:-1]):
            return "openwebtext"  # an extracted OpenWebText folder (one document per file)
        if "books_large" in name:
            return "bookcorpus-lines"  # the sentence-per-line BookCorpus release
        if "\x00" not in text:  # an empty book is still a book (counted as empty)
            return "bookcorpus"
    if base.endswith(".json"):
        return "jsonl"
    if error is not None and not head:
        raise CorpusError(
            f"{path}: cannot read the start of the file to detect its format ({error})"
        )
    raise CorpusError(
        f"{path}: cannot detect the corpus format; pass one of --input-format "
        f"{', '.join(f for f in FORMATS if f != 'auto')}"
    )


# ---------------------------------------------------------------------------------------
# stage 1: framing (reader process)
# ---------------------------------------------------------------------------------------


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    with open_binary(path) as f:
        yield from enumerate(f, 1)


def _decode(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _jsonl_record(line: bytes, src: str, fmt: str = "jsonl") -> RawRecord | Skipped:
    if not line or line.isspace():  # not line.strip(): no copy of every line
        return Skipped("empty", src)
    text = _decode(line)
    if text is None:
        return Skipped("undecodable", src)
    return RawRecord(fmt, text, src)


def _read_jsonl(path: str, fmt: str) -> Iterator[RawRecord | Skipped]:
    for lineno, line in _lines(path):
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
        if not _is_stream_error(e):
            raise
        if lines:
            yield RawLines(path, first, len(lines), size, lines)
        yield Skipped("undecodable", _corrupt_source(path, e))
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
    _check_file(path)
    try:
        with open(path, "rb") as f:
            head = f.read(10)
    except OSError as e:
        raise CorpusError(f"{path}: cannot open ({e.strerror or e})") from e
    if _compression(head) is None:
        yield from _plain_jsonl_blocks(path, max_lines, max_bytes)
    else:
        yield from _stream_jsonl_blocks(path, max_lines, max_bytes)


_DOC_OPEN = re.compile(rb"^\s*<doc\s")
_DOC_CLOSE = re.compile(rb"^\s*</doc>\s*$")
_DOC_ATTR = re.compile(r'\b(id|url|title)="')


def _doc_attrs(header: str) -> dict[str, str]:
    # WikiExtractor writes attribute values unescaped, so a title may contain quotes:
    # each value runs to the quote before the next attribute (or before the closing ">").
    header = header.strip()
    if header.endswith(">"):
        header = header[:-1]
    starts = [(m.group(1), m.end()) for m in _DOC_ATTR.finditer(header)]
    attrs = {}
    for i, (key, start) in enumerate(starts):
        end = starts[i + 1][1] - len(starts[i + 1][0]) - 2 if i + 1 < len(starts) else len(header)
        attrs[key] = header[start:end].rstrip().removesuffix('"')
    return attrs


def _read_wikiextractor(path: str) -> Iterator[RawRecord | Skipped]:
    with open_binary(path) as f:
        head = f.read(4096)
    if head.lstrip().startswith(b"{"):
        yield from _read_jsonl(path, "wikiextractor")
        return
    doc: dict | None = None
    body: list[bytes] = []
    start = 0
    for lineno, line in _lines(path):
        if doc is None:
            if _DOC_OPEN.match(line):
                header = _decode(line)
                doc = {"_bad": header is None, **_doc_attrs(header or "")}
                body = []
                start = lineno
            elif line.strip():
                yield Skipped("undecodable", f"{path}:{lineno}: text outside <doc>...</doc>")
            continue
        if _DOC_CLOSE.match(line):
            src = f"{path}:{start}"
            text = None if doc.pop("_bad") else _decode(b"".join(body))
            if text is None:
                yield Skipped("undecodable", src)
            else:
                yield RawRecord("wikiextractor", {**doc, "text": text}, src)
            doc = None
        else:
            body.append(line)
    if doc is not None:
        yield Skipped("undecodable", f"{path}:{start}: <doc> not closed before the end of the file")


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


_REDIRECT = re.compile(r"\s*#\s*redirect\b", re.IGNORECASE)


class _ShortReads:
    """``read(n)`` as ``read1(n)``: a buffered decompressor's read(n) keeps reading until it
    has n bytes, so a cut stream would take the pages decoded just before the cut with it."""

    def __init__(self, f):
        self._f = f

    def read(self, n: int = -1) -> bytes:
        return self._f.read1(n if n is not None and n >= 0 else 1 << 16)


def _read_wikipedia_xml(path: str) -> Iterator[RawRecord | Skipped]:
    namespaces: set[str] = set()  # non-main namespace names, for old dumps without <ns>
    with open_binary(path) as f:
        root = None
        for event, elem in ET.iterparse(_ShortReads(f), events=("start", "end")):
            if root is None:
                root = elem
            if event != "end":
                continue
            tag = _local(elem.tag)
            if tag == "namespace":
                if elem.get("key", "0") != "0" and elem.text:
                    namespaces.add(elem.text.strip().lower())
                continue
            if tag != "page":
                continue
            fields: dict[str, str | None] = {}
            redirect = False
            text = None
            for child in elem:
                ctag = _local(child.tag)
                if ctag in ("title", "ns", "id"):
                    fields[ctag] = child.text
                elif ctag == "redirect":
                    redirect = True
                elif ctag == "revision":
                    # pages-meta-history has every revision: the last one is current.
                    for sub in child:
                        if _local(sub.tag) == "text":
                            text = sub.text
            title = (fields.get("title") or "").strip()
            src = f"{path}#{title}"
            ns = fields.get("ns")
            prefix = title.split(":", 1)[0].lower() if ":" in title else None
            if (ns is not None and ns.strip() != "0") or (ns is None and prefix in namespaces):
                yield Skipped("non_main_namespace", src)
            elif redirect or _REDIRECT.match(text or ""):
                yield Skipped("redirect", src)
            else:
                payload = {
                    "title": title,
                    "id": (fields.get("id") or "").strip(),
                    "text": text or "",
                }
                yield RawRecord("wikipedia-xml", payload, src)
            # Drop the finished page (and everything before it) so memory stays flat on a
            # 20 GB dump: iterparse otherwise keeps the whole tree.
            root.clear()


def _read_whole(path: str, fmt: str) -> Iterator[RawRecord | Skipped]:
    with open_binary(path) as f:
        data = f.read()
    text = _decode(data)
    yield Skipped("undecodable", path) if text is None else RawRecord(fmt, text, path)


def _read_bookcorpus_lines(path: str) -> Iterator[RawRecord | Skipped]:
    lines: list[str] = []
    start = 1

    def flush():
        text = "\n".join(lines)
        lines.clear()
        return RawRecord("bookcorpus-lines", text, f"{path}:{start}")

    for lineno, raw in _lines(path):
        if not raw.strip():
            if lines:
                yield flush()
            start = lineno + 1
            continue
        if not lines:
            start = lineno
        line = _decode(raw)
        if line is None:
            # One sentence is the unit here; the rest of the book is still good.
            yield Skipped("undecodable", f"{path}:{lineno}")
            continue
        lines.append(line.rstrip("\r\n"))
        if len(lines) >= BOOKCORPUS_MAX_LINES:
            yield flush()
            start = lineno + 1
    if lines:
        yield flush()


def _tar_members(stream, source: str, depth: int) -> Iterator[RawRecord | Skipped]:
    with tarfile.open(fileobj=stream, mode="r|") as tf:
        for member in tf:
            if not member.isfile():
                continue
            fobj = tf.extractfile(member)
            if fobj is None:
                continue
            sep = "/" if "#" in source else "#"
            yield from _openwebtext_stream(fobj, f"{source}{sep}{member.name}", depth + 1)


def _openwebtext_stream(raw, source: str, depth: int) -> Iterator[RawRecord | Skipped]:
    """Documents in ``raw``: a (compressed) tar is walked member by member, recursively
    (openwebtext.tar.xz -> urlsf_subset*.xz -> .txt); anything else is one document."""
    stream = _decompress(raw, source)
    head = stream.read(512)
    if _is_tar(head) and depth < _MAX_NESTING:
        yield from _tar_members(io.BufferedReader(_Prefixed(head, stream)), source, depth)
        return
    data = head + stream.read()
    text = _decode(data)
    yield Skipped("undecodable", source) if text is None else RawRecord("openwebtext", text, source)


def _read_openwebtext(path: str) -> Iterator[RawRecord | Skipped]:
    with open(path, "rb") as raw:
        yield from _openwebtext_stream(raw, path, 0)


def _read_cc_news(path: str, json_keys) -> Iterator[RawRecord | Skipped]:
    if _strip_compression(os.path.basename(path).lower()).endswith(_TABLE_EXTS):
        yield from _read_table(path, "cc-news", json_keys)
        return
    # JSON lines if the first non-blank line is a JSON value on its own, otherwise a
    # single (pretty-printed) news-please article.
    with open_binary(path) as f:
        first = b""
        for line in f:
            if line.strip():
                first = line
                break
        try:
            json.loads(first)
            line_mode = True
        except (json.JSONDecodeError, UnicodeDecodeError):
            line_mode = False
        if not line_mode:
            data = first + f.read()
    if line_mode:
        yield from _read_jsonl(path, "cc-news")
    elif not data.strip():
        yield Skipped("empty", path)
    else:
        text = _decode(data)
        yield Skipped("undecodable", path) if text is None else RawRecord("cc-news", text, path)


def _is_text_type(t, numbers: bool = False) -> bool:
    import pyarrow as pa

    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True
    if numbers and (pa.types.is_integer(t) or pa.types.is_floating(t)):
        return True
    if hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _is_text_type(t.value_type)
    if pa.types.is_dictionary(t):
        return _is_text_type(t.value_type)
    return False


def _open_table(path: str, fmt: str):
    """(schema, batch iterator factory) of a parquet/arrow/feather file."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    name = os.path.basename(path).lower()
    if name.endswith(_COMPRESSION_EXTS):
        raise CorpusError(f"{path}: compressed {fmt} tables are not supported; decompress the file")
    try:
        if name.endswith(".parquet"):
            pf = pq.ParquetFile(path)
            schema = pf.schema_arrow
            return schema, lambda cols: pf.iter_batches(batch_size=_BATCH_ROWS, columns=cols)
        source = pa.memory_map(path)
        try:
            reader = ipc.open_file(source)
            schema = reader.schema

            def batches(cols, reader=reader):
                for i in range(reader.num_record_batches):
                    b = reader.get_batch(i)
                    yield b.select(cols) if cols is not None else b

            return schema, batches
        except pa.ArrowInvalid:
            # Hugging Face datasets caches are IPC *streams*, not IPC files.
            stream = ipc.open_stream(pa.memory_map(path))

            def sbatches(cols, stream=stream):
                for b in stream:
                    yield b.select(cols) if cols is not None else b

            return stream.schema, sbatches
    except (OSError, pa.ArrowException) as e:
        raise CorpusError(f"{path}: not a readable parquet/arrow/feather file ({e})") from e


def _read_table(path: str, fmt: str, json_keys) -> Iterator[RawRecord | Skipped]:
    schema, batches = _open_table(path, fmt)
    names = list(schema.names)
    if json_keys is None:
        cols = [n for n in names if _is_text_type(schema.field(n).type)]
    else:
        wanted = list(json_keys)
        if fmt == "cc-news":
            if "maintext" not in names and "text" not in names:
                raise CorpusError(
                    f"{path}: a cc-news table needs a 'maintext' or 'text' column; columns are {names}"
                )
            wanted = [k for k in _CC_NEWS_TEXT_FIELDS if k in names] + list(json_keys[1:])
        missing = [k for k in wanted if k not in names]
        if missing:
            raise CorpusError(
                f"{path}: no column {missing} (json keys {list(json_keys)}); columns are {names}"
            )
        # Numbers are accepted for metadata keys (ids); binary, nested and time columns
        # have no single text form.
        not_text = [k for k in wanted if not _is_text_type(schema.field(k).type, numbers=True)]
        if not_text:
            raise CorpusError(
                f"{path}: column(s) {not_text} are not text ({[str(schema.field(k).type) for k in not_text]})"
            )
        cols = list(dict.fromkeys(wanted))
    row = 0
    for batch in batches(cols):
        for rec in batch.to_pylist():
            yield RawRecord(fmt, rec, f"{path}#row={row}")
            row += 1


def iter_raw(
    path: str, fmt: str, *, json_keys: tuple[str, ...] | None = None
) -> Iterator[RawRecord | Skipped]:
    """Stage 1: decompress and frame the records of ``path`` (a file, or a directory whose
    files are read in ``expand_inputs`` order). ``json_keys`` only narrows which table
    columns are read; it is optional here and required by ``parse_raw``."""
    path = os.fspath(path)
    if fmt not in FORMATS:
        raise CorpusError(
            f"unknown format {fmt!r} for {path}; expected one of {', '.join(FORMATS)}"
        )
    if not os.path.exists(path):
        raise FileNotFoundError(f"input not found: {path}")
    if os.path.isdir(path):
        for f in expand_inputs([path]):
            yield from iter_raw(f, fmt, json_keys=json_keys)
        return
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "jsonl":
        gen = _read_jsonl(path, "jsonl")
    elif fmt == "parquet":
        gen = _read_table(path, "parquet", json_keys)
    elif fmt == "wikipedia-xml":
        gen = _read_wikipedia_xml(path)
    elif fmt == "wikiextractor":
        gen = _read_wikiextractor(path)
    elif fmt == "bookcorpus":
        gen = _read_whole(path, "bookcorpus")
    elif fmt == "bookcorpus-lines":
        gen = _read_bookcorpus_lines(path)
    elif fmt == "openwebtext":
        gen = _read_openwebtext(path)
    else:
        gen = _read_cc_news(path, json_keys)
    try:
        yield from gen
    except Exception as e:
        if not _is_stream_error(e):
            raise
        yield Skipped("undecodable", _corrupt_source(path, e))


def _corrupt_source(path: str, e: BaseException) -> str:
    return f"{path}: truncated or corrupt data, rest of file skipped ({type(e).__name__}: {e})"


# ---------------------------------------------------------------------------------------
# stage 2: parsing (worker processes)
# ---------------------------------------------------------------------------------------


class _Skip(Exception):
    def __init__(self, reason: str):
        self.reason = reason


_JSON = json.JSONDecoder()
_JSON_SPACE = " \t\n\r"  # the whitespace JSON allows between tokens


def _json_loads(text: str):
    # json.loads(text) without two of its three Python-level layers, which cost as much
    # CPU per JSON line as the C scanner itself. Same result; the same inputs fail.
    start = len(text) - len(text.lstrip(_JSON_SPACE))
    obj, end = _JSON.raw_decode(text, start)
    if end != len(text) and text[end:].strip(_JSON_SPACE):
        raise json.JSONDecodeError("Extra data", text, end)
    return obj


def _json_object(payload) -> dict:
    if isinstance(payload, dict):
        return payload
    try:
        obj = _json_loads(payload) if isinstance(payload, str) else json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        raise _Skip("malformed_json") from None
    if not isinstance(obj, dict):
        raise _Skip("malformed_json")
    return obj


def _as_text(value) -> str:
    if value is None:
        raise _Skip("empty")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)  # paragraph lists, as some exports store text
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # ids, dates as numbers: metadata keys, not prose
    raise _Skip("malformed_json")


def _wikiextractor_text(obj: dict) -> str:
    text = _as_text(obj.get("text"))
    title = (obj.get("title") or "").strip()
    first, _, rest = text.lstrip("\n").partition("\n")
    if title and first.strip() == title:
        return rest
    return text


def _canonical(raw: RawRecord) -> tuple[str | None, dict]:
    """(the format's document text or None for field formats, the record's fields)."""
    fmt, payload = raw.fmt, raw.payload
    if isinstance(payload, bytes):
        decoded = _decode(payload)
        if decoded is None:
            raise _Skip("undecodable")
        payload = decoded
    if fmt in ("jsonl", "parquet"):
        return None, _json_object(payload)
    if fmt == "wikipedia-xml":
        wikitext = payload.get("text") or ""
        if _REDIRECT.match(wikitext):
            raise _Skip("redirect")
        return wikitext_to_plain(wikitext), payload
    if fmt == "wikiextractor":
        obj = _json_object(payload)
        return _wikiextractor_text(obj), obj
    if fmt in ("bookcorpus", "bookcorpus-lines", "openwebtext"):
        return payload, {}
    if fmt == "cc-news":
        obj = _json_object(payload)
        body = obj.get("maintext")
        if body is None:
            body = obj.get("text")
        title = obj.get("title")
        parts = [_as_text(p) for p in (title, body) if p is not None]
        if body is None or not _as_text(body).strip():
            raise _Skip("empty")  # a headline alone is not an article
        return "\n".join(parts), obj
    raise ValueError(f"{raw.source}: RawRecord has unknown format {fmt!r}")


def parse_raw(
    raw: RawRecord, json_keys: tuple[str, ...], *, min_chars: int = 0
) -> Document | Skipped:
    """Stage 2: turn a framed record into a Document (or a Skipped with the reason).

    Every selected field is cleaned with ``text.normalize_text``; a field that is then
    empty makes the record ``empty``, one shorter than ``min_chars`` ``too_short``.
    """
    if not json_keys:
        raise ValueError("json_keys must name at least one field")
    try:
        canonical, fields = _canonical(raw)
        values = {}
        for i, key in enumerate(json_keys):
            if i == 0 and canonical is not None:
                values[key] = canonical
            elif key not in fields:
                raise _Skip("missing_key")
            else:
                values[key] = _as_text(fields[key])
        texts = {k: normalize_text(v) for k, v in values.items()}
        if not all(texts.values()):
            raise _Skip("empty")
        if min_chars and any(len(t) < min_chars for t in texts.values()):
            raise _Skip("too_short")
    except _Skip as s:
        return Skipped(s.reason, raw.source)
    return Document(texts, raw.source)


def iter_records(
    path: str, fmt: str, json_keys: tuple[str, ...], *, min_chars: int = 0
) -> Iterator[Document | Skipped]:
    """Both stages in one process: Documents and Skipped records of ``path`` in file order."""
    if not json_keys:
        raise ValueError("json_keys must name at least one field")
    for rec in iter_raw(path, fmt, json_keys=tuple(json_keys)):
        yield (
            rec
            if isinstance(rec, Skipped)
            else parse_raw(rec, tuple(json_keys), min_chars=min_chars)
        )

"""One reader per corpus format, in the registry ``READERS`` (format name -> ``Reader``).

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

import io
import json
import os
import re
import tarfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from megatron_taco.preprocessing.jsonl import read_jsonl
from megatron_taco.preprocessing.records import (
    CorpusError,
    RawRecord,
    Skip,
    Skipped,
    as_text,
    decode,
    json_object,
)
from megatron_taco.preprocessing.streams import (
    COMPRESSION_EXTS,
    Prefixed,
    decompress,
    is_tar,
    numbered_lines,
    open_binary,
    strip_compression,
)
from megatron_taco.preprocessing.text import wikitext_to_plain

# About the length of a long novel; see the module docstring (bookcorpus-lines).
BOOKCORPUS_MAX_LINES = 20_000
_MAX_NESTING = 3  # archives inside archives (openwebtext has 2 levels)
TABLE_EXTS = (".parquet", ".arrow", ".feather")
_BATCH_ROWS = 1024
_CC_NEWS_TEXT_FIELDS = ("title", "maintext", "text")


@dataclass(frozen=True)
class Reader:
    """One format. ``read(path, json_keys)`` frames the records of one file (stage 1, the
    reader process; ``json_keys`` only narrows which table columns are read).
    ``text(payload)`` runs in the workers (stage 2) on a record's decoded payload and
    returns (the format's document text, the record's fields), or raises ``records.Skip``;
    None for formats whose records are JSON objects (or table rows) of fields only."""

    read: Callable[[str, tuple[str, ...] | None], Iterator[RawRecord | Skipped]]
    text: Callable[[str | dict], tuple[str, dict]] | None = None


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


def _read_wikipedia_xml(path: str, json_keys) -> Iterator[RawRecord | Skipped]:
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


def _wikipedia_text(page: dict) -> tuple[str, dict]:
    wikitext = page.get("text") or ""
    if _REDIRECT.match(wikitext):
        raise Skip("redirect")
    return wikitext_to_plain(wikitext), page


_DOC_OPEN = re.compile(rb"^\s*<doc\s")
_DOC_CLOSE = re.compile(rb"^\s*</doc>\s*$")
_DOC_ATTR = re.compile(r'\b(id|url|title)="')


def _doc_attrs(header: str) -> dict[str, str]:
    # WikiExtractor writes attribute values unescaped, so a title may contain quotes:
    # each value runs to the quote before the next attribute (or before the closing ">").
    header = header.strip().removesuffix(">")
    starts = [(m.group(1), m.end()) for m in _DOC_ATTR.finditer(header)]
    attrs = {}
    for i, (key, start) in enumerate(starts):
        end = starts[i + 1][1] - len(starts[i + 1][0]) - 2 if i + 1 < len(starts) else len(header)
        attrs[key] = header[start:end].rstrip().removesuffix('"')
    return attrs


def _read_wikiextractor(path: str, json_keys) -> Iterator[RawRecord | Skipped]:
    with open_binary(path) as f:
        head = f.read(4096)
    if head.lstrip().startswith(b"{"):
        yield from read_jsonl(path, "wikiextractor")
        return
    doc: dict | None = None
    body: list[bytes] = []
    start = 0
    for lineno, line in numbered_lines(path):
        if doc is None:
            if _DOC_OPEN.match(line):
                header = decode(line)
                doc = {"_bad": header is None, **_doc_attrs(header or "")}
                body = []
                start = lineno
            elif line.strip():
                yield Skipped("undecodable", f"{path}:{lineno}: text outside <doc>...</doc>")
            continue
        if _DOC_CLOSE.match(line):
            src = f"{path}:{start}"
            text = None if doc.pop("_bad") else decode(b"".join(body))
            if text is None:
                yield Skipped("undecodable", src)
            else:
                yield RawRecord("wikiextractor", {**doc, "text": text}, src)
            doc = None
        else:
            body.append(line)
    if doc is not None:
        yield Skipped("undecodable", f"{path}:{start}: <doc> not closed before the end of the file")


def _wikiextractor_text(payload) -> tuple[str, dict]:
    obj = json_object(payload)
    text = as_text(obj.get("text"))
    title = (obj.get("title") or "").strip()
    first, _, rest = text.lstrip("\n").partition("\n")
    return (rest if title and first.strip() == title else text), obj


def _plain_text(text: str) -> tuple[str, dict]:
    return text, {}


def _read_book(path: str, json_keys) -> Iterator[RawRecord | Skipped]:
    with open_binary(path) as f:
        data = f.read()
    text = decode(data)
    yield Skipped("undecodable", path) if text is None else RawRecord("bookcorpus", text, path)


def _read_bookcorpus_lines(path: str, json_keys) -> Iterator[RawRecord | Skipped]:
    lines: list[str] = []
    start = 1

    def flush():
        text = "\n".join(lines)
        lines.clear()
        return RawRecord("bookcorpus-lines", text, f"{path}:{start}")

    for lineno, raw in numbered_lines(path):
        if not raw.strip():
            if lines:
                yield flush()
            start = lineno + 1
            continue
        if not lines:
            start = lineno
        line = decode(raw)
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
    stream = decompress(raw, source)
    head = stream.read(512)
    if is_tar(head) and depth < _MAX_NESTING:
        yield from _tar_members(io.BufferedReader(Prefixed(head, stream)), source, depth)
        return
    data = head + stream.read()
    text = decode(data)
    yield Skipped("undecodable", source) if text is None else RawRecord("openwebtext", text, source)


def _read_openwebtext(path: str, json_keys) -> Iterator[RawRecord | Skipped]:
    with open(path, "rb") as raw:
        yield from _openwebtext_stream(raw, path, 0)


def _read_cc_news(path: str, json_keys) -> Iterator[RawRecord | Skipped]:
    if strip_compression(os.path.basename(path).lower()).endswith(TABLE_EXTS):
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
        yield from read_jsonl(path, "cc-news")
    elif not data.strip():
        yield Skipped("empty", path)
    else:
        text = decode(data)
        yield Skipped("undecodable", path) if text is None else RawRecord("cc-news", text, path)


def _cc_news_text(payload) -> tuple[str, dict]:
    obj = json_object(payload)
    body = obj.get("maintext")
    if body is None:
        body = obj.get("text")
    title = obj.get("title")
    parts = [as_text(p) for p in (title, body) if p is not None]
    if body is None or not as_text(body).strip():
        raise Skip("empty")  # a headline alone is not an article
    return "\n".join(parts), obj


def _is_text_type(t, numbers: bool = False) -> bool:
    import pyarrow as pa

    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True
    if numbers and (pa.types.is_integer(t) or pa.types.is_floating(t)):
        return True
    if hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_dictionary(t):
        return _is_text_type(t.value_type)
    return False


def _open_table(path: str, fmt: str):
    """(schema, columns -> record batch iterator, to call once) of a parquet/arrow/feather
    file."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    name = os.path.basename(path).lower()
    if name.endswith(COMPRESSION_EXTS):
        raise CorpusError(f"{path}: compressed {fmt} tables are not supported; decompress the file")
    try:
        if name.endswith(".parquet"):
            pf = pq.ParquetFile(path)
            schema = pf.schema_arrow
            return schema, lambda cols: pf.iter_batches(batch_size=_BATCH_ROWS, columns=cols)
        source = pa.memory_map(path)
        try:
            reader = ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            # Hugging Face datasets caches are IPC *streams*, not IPC files.
            reader = ipc.open_stream(pa.memory_map(path))
            batches = reader  # iterating a stream reader yields its record batches
        return reader.schema, lambda cols: (b if cols is None else b.select(cols) for b in batches)
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


def table_columns(path: str) -> list[str]:
    return list(_open_table(path, "parquet")[0].names)


# The order is the order of --input-format's choices.
READERS: dict[str, Reader] = {
    "wikipedia-xml": Reader(_read_wikipedia_xml, _wikipedia_text),
    "wikiextractor": Reader(_read_wikiextractor, _wikiextractor_text),
    "bookcorpus": Reader(_read_book, _plain_text),
    "bookcorpus-lines": Reader(_read_bookcorpus_lines, _plain_text),
    "openwebtext": Reader(_read_openwebtext, _plain_text),
    "cc-news": Reader(_read_cc_news, _cc_news_text),
    "jsonl": Reader(lambda path, json_keys: read_jsonl(path, "jsonl")),
    "parquet": Reader(lambda path, json_keys: _read_table(path, "parquet", json_keys)),
}
# "auto": detected per file by inputs.detect_format.
FORMATS = ("auto", *READERS)

"""Which files an input names (files, directories walked recursively, globs) and which
corpus format each one is (``--input-format auto``)."""

from __future__ import annotations

import glob
import json
import logging
import os
import re

from megatron_taco.preprocessing.readers import READERS, TABLE_EXTS, table_columns
from megatron_taco.preprocessing.records import CorpusError
from megatron_taco.preprocessing.streams import (
    is_stream_error,
    is_tar,
    open_binary,
    strip_compression,
)

logger = logging.getLogger(__name__)
GLOB_CHARS = re.compile(r"[*?\[]")
_TAR_EXTS = (".tar", ".tgz", ".tbz2", ".txz", ".tzst")

# In a corpus folder, files that are clearly not corpus text: documentation, code, images,
# checksums and licence files that ship beside the data (examples/corpus/ has two).
_NOT_CORPUS_EXTS = (
    ".md",
    ".rst",
    ".py",
    ".pyc",
    ".sh",
    ".ipynb",
    ".cfg",
    ".ini",
    ".toml",
    ".yaml",
    ".yml",
    ".lock",
    ".png",
    ".jpg",
    ".jpeg",
    ".gif",
    ".svg",
    ".pdf",
    ".css",
    ".js",
    ".sha1",
    ".sha256",
    ".sha512",
    ".md5",
    ".sig",
    ".asc",
)
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
            directory,
            len(skipped),
            names,
            more,
        )
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
        elif GLOB_CHARS.search(item):
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


def _json_format(obj: dict) -> str:
    keys = set(obj)
    if keys & {"maintext", "date_publish", "source_domain"}:
        return "cc-news"
    if {"title", "text", "description", "domain"} <= keys:
        return "cc-news"  # the Hugging Face cc_news export
    if {"id", "url", "title", "text"} <= keys and "wiki" in str(obj.get("url", "")):
        return "wikiextractor"
    return "jsonl"


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
        if not is_stream_error(e):
            raise
        return b"".join(chunks), e
    return b"".join(chunks), None


def detect_format(path: str) -> str:
    """The corpus format of a file (or of the files of a directory), a key of
    ``readers.READERS``, from its name and, when the name is not enough, its first
    decompressed bytes. Raises CorpusError naming the file when no format fits. One ordered
    list of rules rather than a test per reader: which rule wins decides between formats
    (a .json file is cc-news, wikiextractor or jsonl by its keys)."""
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
    base = strip_compression(name)
    return _format_by_name(path, name, base) or _format_by_content(path, name, base)


def _format_by_name(path: str, name: str, base: str) -> str | None:
    if base.endswith(TABLE_EXTS):
        fmt = _json_format(dict.fromkeys(table_columns(path)))
        return "cc-news" if fmt == "cc-news" else "parquet"
    if base.endswith(_TAR_EXTS) or name.endswith(_TAR_EXTS) or name.startswith("urlsf_subset"):
        return "openwebtext"
    if base.endswith(".xml") or "pages-articles" in name or "pages-meta" in name:
        return "wikipedia-xml"
    if re.fullmatch(r"wiki_\d+", base):
        return "wikiextractor"
    return None


def _format_by_content(path: str, name: str, base: str) -> str:
    head, error = _read_head(path, 1 << 16)
    if is_tar(head):
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
        f"{path}: cannot detect the corpus format; pass one of --input-format {', '.join(READERS)}"
    )

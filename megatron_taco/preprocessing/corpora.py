"""Reading the raw pretraining corpora, in two stages so that the single reader process of
the preprocessor only does cheap I/O and the workers do the heavy parsing:

* ``iter_raw(path, fmt)`` decompresses and frames records (a JSON line, a wiki page, a tar
  member, a parquet row) and decodes UTF-8. It yields picklable ``RawRecord``s, or
  ``Skipped`` for what cannot be framed or decoded.
* ``parse_raw(raw, json_keys)`` runs in the workers: JSON decoding, wikitext -> plain text,
  field selection, cleaning, length filters. It returns a ``Document`` or a ``Skipped``.

Both look the format up in ``readers.READERS`` (one reader per format, and its layout);
``iter_records`` chains the two for single-process use. For JSON lines, where framing is
only splitting lines, ``jsonl.iter_jsonl_blocks`` frames in bulk.

Document text follows the convention of ``text.py``: one paragraph per line. For formats
with a single natural text (everything except ``jsonl`` and ``parquet``) that text is stored
under the first json key; further json keys are looked up in the record's metadata (e.g.
``title`` or ``url``) and are ``missing_key`` when the format has no such field.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from megatron_taco.preprocessing.inputs import detect_format, expand_inputs
from megatron_taco.preprocessing.readers import FORMATS, READERS
from megatron_taco.preprocessing.records import (
    CorpusError,
    Document,
    RawRecord,
    Skip,
    Skipped,
    as_text,
    decode,
    json_object,
)
from megatron_taco.preprocessing.streams import corrupt_source, is_stream_error
from megatron_taco.preprocessing.text import normalize_text


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
    reader = READERS[detect_format(path) if fmt == "auto" else fmt]
    try:
        yield from reader.read(path, json_keys)
    except Exception as e:
        if not is_stream_error(e):
            raise
        yield Skipped("undecodable", corrupt_source(path, e))


_FIELDS_ONLY = frozenset(name for name, reader in READERS.items() if reader.text is None)


def _canonical(raw: RawRecord) -> tuple[str | None, dict]:
    """(the format's document text or None for field formats, the record's fields)."""
    payload = raw.payload
    if isinstance(payload, bytes):
        payload = decode(payload)
        if payload is None:
            raise Skip("undecodable")
    if raw.fmt in _FIELDS_ONLY:  # first, and inline: most records are JSON lines
        return None, json_object(payload)
    reader = READERS.get(raw.fmt)
    if reader is None:
        raise ValueError(f"{raw.source}: RawRecord has unknown format {raw.fmt!r}")
    return reader.text(payload)


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
                raise Skip("missing_key")
            else:
                values[key] = as_text(fields[key])
        texts = {k: normalize_text(v) for k, v in values.items()}
        if not all(texts.values()):
            raise Skip("empty")
        if min_chars and any(len(t) < min_chars for t in texts.values()):
            raise Skip("too_short")
    except Skip as s:
        return Skipped(s.reason, raw.source)
    return Document(texts, raw.source)


def iter_records(
    path: str, fmt: str, json_keys: tuple[str, ...], *, min_chars: int = 0
) -> Iterator[Document | Skipped]:
    """Both stages in one process: Documents and Skipped records of ``path`` in file order."""
    if not json_keys:
        raise ValueError("json_keys must name at least one field")
    keys = tuple(json_keys)
    for rec in iter_raw(path, fmt, json_keys=keys):
        yield rec if isinstance(rec, Skipped) else parse_raw(rec, keys, min_chars=min_chars)

"""What reading a corpus yields (see corpora.py for the two stages), and the decoding helpers
the per-format readers share."""

from __future__ import annotations

import json
from dataclasses import dataclass

SKIP_REASONS = {
    "empty": "no text after cleaning (blank line, empty article, null field)",
    "malformed_json": "not a JSON object, or a selected field is not text",
    "undecodable": "invalid UTF-8, broken framing, or a truncated/corrupt compressed stream",
    "too_short": "a selected field is shorter than min_chars after cleaning",
    "redirect": "wiki redirect page",
    "non_main_namespace": "wiki page outside the article namespace (Talk:, User:, ...)",
    "missing_key": "a json key is absent from the record",
}


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


class Skip(Exception):
    """Raised while parsing a record (stage 2); ``corpora.parse_raw`` turns it into Skipped."""

    def __init__(self, reason: str):
        self.reason = reason


def decode(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


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


def json_object(payload) -> dict:
    if isinstance(payload, dict):
        return payload
    try:
        obj = _json_loads(payload) if isinstance(payload, str) else json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        raise Skip("malformed_json") from None
    if not isinstance(obj, dict):
        raise Skip("malformed_json")
    return obj


def as_text(value) -> str:
    if value is None:
        raise Skip("empty")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)  # paragraph lists, as some exports store text
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # ids, dates as numbers: metadata keys, not prose
    raise Skip("malformed_json")

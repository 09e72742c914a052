"""Text cleaning shared by every corpus reader, wikitext -> plain text, sentence splitting.

The convention every reader in ``corpora.py`` produces and ``SentenceSplitter`` relies on:
a document is plain text with one paragraph per line (``"\\n"`` between paragraphs, no hard
wrapping inside a paragraph). A newline is therefore a hard sentence boundary: a sentence
never spans two lines. All the real corpora already look like this (Wikipedia paragraphs,
OpenWebText and CC-News paragraphs, BookCorpus paragraphs or sentence-per-line files).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import itertools
import os
import re
import site
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mwparserfromhell import nodes as mw

# -- normalisation ----------------------------------------------------------------------

# C0 controls except \t \n \r, DEL, C1 controls, and zero-width/bidi marks. They come from
# bad OCR, PDF and HTML extraction, and only produce junk pieces in the tokenizer.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\u200e\u200f\u202a-\u202e\ufeff]")
# Every horizontal space (tabs, NBSP, the U+2000 block, ideographic space) becomes one
# ASCII space: SentencePiece would map them to "▁" anyway, and runs of them carry nothing.
_HSPACE = re.compile(r"[ \t\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]+")
_SPACE_RUN = re.compile("  +")
# The ASCII characters normalize_text must look at besides " " and "\n": the ASCII part of
# _CONTROL plus \t and \r.
_ASCII_IRREGULAR = bytes(c for c in range(0x20) if c != 0x0A) + b"\x7f"


def _clean_line(line: str) -> str:
    # Without controls, str.split()'s whitespace inside one splitlines() line is exactly the
    # _HSPACE set, so split/join is _HSPACE.sub(" ", line).strip() at C speed. \x1f (a control)
    # is the one exception: str.split() treats it as a space, _HSPACE does not.
    if "\x1f" in line:
        return _HSPACE.sub(" ", line).strip()
    return " ".join(line.split())


def split_lines(text: str) -> list[str]:
    """The non-blank lines of ``text``, each stripped, for any of \\n, \\r\\n, \\r, U+2028/2029."""
    return [line for line in map(_clean_line, text.splitlines()) if line]


def normalize_text(text: str) -> str:
    """Canonical document text: control characters removed, horizontal whitespace collapsed,
    lines stripped, blank lines dropped, lines joined with a single ``"\\n"``.

    Blank lines are dropped rather than kept as paragraph markers because every reader
    already emits one paragraph per line; a second separator would only double the
    information and the sentence splitter treats every newline as a boundary anyway.
    """
    # This runs on every field of every record, and the direct per-line regex version cost
    # half as much CPU as the tokenizer itself on document-level runs, so the usual case
    # takes a short cut: text whose only whitespace is " " and "\n", with nothing to delete.
    # Anything else (tabs, \r\n, NBSP, controls, but also harmless non-printables such as
    # U+00AD) takes the general path, which is the definition.
    if text.isascii():
        # ASCII: a C0 control (\t and \r included, \n excepted) or DEL. bytes.translate
        # scans ~4x faster than str.isprintable.
        raw = text.encode("ascii")
        irregular = len(raw.translate(None, _ASCII_IRREGULAR)) != len(raw)
        lines = None
    else:
        # str.isprintable() is False for every Cc, Cf and Zs/Zl/Zp character except " ":
        # all of _CONTROL (Cc, Cf), every line break but "\n", every other space.
        lines = text.split("\n")
        irregular = not all(map(str.isprintable, lines))
    if irregular:
        return "\n".join(split_lines(_CONTROL.sub("", text)))
    if "  " in text:
        text = _SPACE_RUN.sub(" ", text)  # one pass, where str.replace needs one per halving
        lines = None
    if lines is None:
        lines = text.split("\n")
    stripped = [line.strip(" ") for line in lines]
    if "" in stripped:
        stripped = [line for line in stripped if line]
    elif stripped == lines:
        return text  # already canonical (str.strip returns the same object when unchanged)
    return "\n".join(stripped)


# -- wikitext -> plain text -------------------------------------------------------------

# Tags whose content is not article prose (or not shown on the article page at all).
_DROP_TAGS = frozenset(
    {
        "ref",
        "references",
        "table",
        "tr",
        "td",
        "th",
        "caption",
        "gallery",
        "imagemap",
        "math",
        "chem",
        "ce",
        "score",
        "timeline",
        "graph",
        "mapframe",
        "maplink",
        "syntaxhighlight",
        "source",
        "pre",
        "includeonly",
        "templatedata",
        "templatestyles",
        "indicator",
        "categorytree",
        "inputbox",
        "hiero",
        "charinsert",
        "section",
        "style",
        "script",
    }
)
_BLOCK_TAGS = frozenset(
    {
        "p",
        "div",
        "blockquote",
        "center",
        "poem",
        "ul",
        "ol",
        "dl",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
    }
)
_MEDIA_PREFIXES = frozenset({"file", "image", "media", "category"})
# Interlanguage links are written with a lowercase language code ([[de:Foo]]); article
# titles with a colon start with a capital ([[Ion: Mass Appeal]]), which keeps them.
_INTERLANGUAGE = re.compile(r"(?:[a-z]{2,3}(?:-[a-z0-9]+)*|simple)")
# Sections made of citations, link lists and navigation, not prose. BERT-style corpora
# drop them together with lists, tables and headings.
_DROP_SECTIONS = frozenset(
    {
        "see also",
        "references",
        "external links",
        "further reading",
        "notes",
        "bibliography",
        "sources",
        "footnotes",
        "citations",
        "notes and references",
        "references and notes",
        "works cited",
        "gallery",
    }
)
# Inline templates whose visible output is prose, so dropping them would break sentences.
# Everything else (infoboxes, navboxes, citations, hatnotes, maintenance tags) is dropped.
_FIRST_PARAM_TEMPLATES = frozenset(
    {
        "nowrap",
        "nobr",
        "small",
        "big",
        "em",
        "strong",
        "nobold",
        "noitalic",
        "sic",
        "not a typo",
        "smallcaps",
        "sc",
        "abbr",
        "ill",
        "interlanguage link",
        "lang-x",
        "visible anchor",
        "vanchor",
        "keypress",
        "serif",
        "sans-serif",
        "mvar",
        "var",
        "math",
    }
)
_SECOND_PARAM_TEMPLATES = frozenset({"lang", "transl", "transliteration", "script"})
_CONVERT_TEMPLATES = frozenset({"convert", "cvt"})
_RANGE_WORDS = frozenset({"-", "–", "to", "and", "or", "by", "x", "×", "+/-", "to(-)"})

_LIST_MARK = (
    "\ue000"  # private-use char emitted for list items and ;terms, whose lines are dropped later
)
_PARA = "\n\n"
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_STYLE_QUOTES = re.compile(r"'{2,}")  # unbalanced '' / ''' that the parser left as text
_EMPTY_PARENS = re.compile(r"\(\s*(?:[,;:]\s*)*\)")
_OPEN_PUNCT = re.compile(r"\(\s*[,;:]+\s*")
_CLOSE_PUNCT = re.compile(r"\s*[,;:]+\s*\)")
_SPACE_BEFORE = re.compile(r"\s+([,.;:!?)\]])")
_SPACE_AFTER = re.compile(r"([(\[])\s+")
_HAS_WORD = re.compile(r"\w")


def _param(tpl: mw.Template, name: int | str) -> str | None:
    if not tpl.has(name):
        return None
    return _plain(tpl.get(name).value).strip()


def _template(tpl: mw.Template) -> str:
    name = str(tpl.name).strip().lower().replace("_", " ")
    if name in _FIRST_PARAM_TEMPLATES or name.startswith("lang-"):
        return _param(tpl, 1) or ""
    if name in _SECOND_PARAM_TEMPLATES:
        return _param(tpl, 2) or ""
    if name in _CONVERT_TEMPLATES:
        parts = [_param(tpl, i) for i in range(1, 5)]
        if parts[0] is None:
            return ""
        if parts[1] in _RANGE_WORDS and parts[2] is not None:
            return " ".join(p for p in parts if p)
        return " ".join(p for p in parts[:2] if p)
    if name in ("circa", "c."):
        year = _param(tpl, 1)
        return f"c. {year}" if year else "c."
    return ""


def _wikilink(link: mw.Wikilink) -> str:
    title = str(link.title).strip()
    if title.startswith(":"):
        # [[:Category:Foo|...]] is an ordinary visible link; the colon only stops the
        # page from being categorised.
        title = title[1:].strip()
    elif ":" in title:
        prefix = title.split(":", 1)[0].strip()
        if prefix.lower() in _MEDIA_PREFIXES:
            return ""
        if link.text is None and _INTERLANGUAGE.fullmatch(prefix):
            return ""
    if link.text is not None:
        text = _plain(link.text)
        if text.strip():
            return text
    return title


def _tag(tag: mw.Tag) -> str:
    markup = tag.wiki_markup
    if markup is not None:
        markup = str(markup)
        if markup in ("*", "#", ";"):
            return "\n" + _LIST_MARK
        if markup == ":":
            return ""  # indentation (quotes, replies): the text after it is kept
    name = str(tag.tag).strip().lower()
    if name in _DROP_TAGS:
        return ""
    if name == "br":
        return "\n"
    if name == "hr":
        return _PARA
    inner = _plain(tag.contents) if tag.contents is not None else ""
    if name in _BLOCK_TAGS:
        return _PARA + inner + _PARA
    return inner


def _node(node) -> str:
    from mwparserfromhell import nodes as mw

    if isinstance(node, mw.Text):
        return str(node.value)
    if isinstance(node, mw.Wikilink):
        return _wikilink(node)
    if isinstance(node, mw.Template):
        return _template(node)
    if isinstance(node, mw.Tag):
        return _tag(node)
    if isinstance(node, mw.ExternalLink):
        # [http://x Title] shows "Title"; bare and free URLs are not prose.
        return _plain(node.title) if node.title is not None else ""
    if isinstance(node, mw.HTMLEntity):
        return node.normalize()
    if isinstance(node, mw.Heading):
        return _PARA
    return ""  # Comment, Argument ({{{1}}}) and anything unknown produce nothing


def _plain(code) -> str:
    return "".join(_node(n) for n in code.nodes)


def _clean_paragraph(lines: list[str]) -> str:
    # MediaWiki renders a single newline inside a paragraph as a space.
    para = " ".join(lines)
    para = _STYLE_QUOTES.sub("", para)
    para = _HSPACE.sub(" ", para)
    para = _EMPTY_PARENS.sub("", para)
    para = _OPEN_PUNCT.sub("(", para)
    para = _CLOSE_PUNCT.sub(")", para)
    para = _SPACE_AFTER.sub(r"\1", para)
    para = _SPACE_BEFORE.sub(r"\1", para)
    return _HSPACE.sub(" ", para).strip()


def wikitext_to_plain(wikitext: str) -> str:
    """Article wikitext -> plain prose, one paragraph per line.

    Dropped: templates (infoboxes, navboxes, citations; a few inline prose templates such
    as {{lang}}, {{nowrap}}, {{convert}} keep their visible text), tables, <ref>s and other
    non-prose tags, files/images, categories, interlanguage links, comments, HTML tags (their
    text is kept), bare URLs, magic words, list items, section headings, and whole
    reference/link sections ("See also", "References", "External links", ...). Headings are
    dropped like in the BERT corpora (they are not sentences), but they still end a paragraph.
    Kept: link text ([[target|text]] -> text, [[target]] -> target), external link titles.
    """
    # Imported here: only Wikipedia dumps need it, and every preprocessing worker imports
    # this module (it costs ~20 ms of each worker's start-up).
    import mwparserfromhell
    from mwparserfromhell import nodes as mw

    code = mwparserfromhell.parse(wikitext.replace(_LIST_MARK, ""))
    pieces: list[str] = []
    skip_level = 0  # > 0 while inside a dropped section of that heading level
    for node in code.nodes:
        if isinstance(node, mw.Heading):
            level = node.level
            if skip_level and level > skip_level:
                continue
            title = _plain(node.title).strip().strip(":").lower()
            skip_level = level if title in _DROP_SECTIONS else 0
            pieces.append(_PARA)
            continue
        if skip_level:
            continue
        pieces.append(_node(node))
    text = _MAGIC_WORD.sub("", _CONTROL.sub("", "".join(pieces)))

    def prose(line: str) -> bool:  # blank lines and list items end a paragraph
        return bool(line.strip()) and not line.lstrip().startswith(_LIST_MARK)

    runs = itertools.groupby(text.split("\n"), key=prose)
    paragraphs = (
        _clean_paragraph([s.strip() for s in lines]) for is_prose, lines in runs if is_prose
    )
    return "\n".join(p for p in paragraphs if _HAS_WORD.search(p))


# -- sentence splitting -----------------------------------------------------------------

# Both splitters follow the same contract: split(text) -> the sentences of text, every line
# split on its own (a newline is a hard boundary), stripped, none empty; split_many(texts)
# is [split(t) for t in texts], as one call where the splitter can batch. Both pickle as
# their settings only, for the spawned preprocessing workers.
#
# blingfire is the default. On 4.9 MB of Wikipedia lead sections (benchmarks/
# bench_splitters.py) it keeps 99.5% of punkt's boundaries and adds 0.1% of its own, and
# most of the differences are punkt's errors ("Op." / "No." / "Vol." / initials followed
# by a number or a name, which punkt takes for sentence ends); it splits 3-5x faster one
# line at a time and ~15x faster batched as split_many does. punkt stays available for
# exact compatibility with Megatron-LM's splitting.
SENTENCE_SPLITTERS = ("blingfire", "punkt")
DEFAULT_SENTENCE_SPLITTER = "blingfire"


class SplitterUnavailableError(LookupError):
    """The chosen sentence splitter cannot run here; the message says what to do."""


class BlingfireSplitter:
    """Sentences by blingfire's sentence breaker (a compiled finite-state model, no data
    files), through its C entry point with byte offsets: the sentences are slices of the
    input itself, so no character is changed or lost.

    blingfire reads a single newline as a space and even a blank line only as a weak hint,
    so lines are joined with "\n U+2029 \n", which it always breaks at (no line of ours
    contains U+2029: split_lines breaks lines there). One call then splits a whole batch;
    a sentence that still crossed a line would be cut there. Per call, blingfire needs
    buffers of ~18 bytes per input byte, so calls are capped at _MAX_CALL_BYTES of text.
    """

    name = "blingfire"
    _SEP_BYTES = "\n\u2029\n".encode("utf-8")
    _MAX_CALL_BYTES = 1 << 20

    def __init__(self) -> None:
        self._lib = self._load_library()
        self._capacity = 0

    @staticmethod
    def _load_library():
        try:
            import blingfire
        except ImportError as e:
            raise SplitterUnavailableError(
                f"the blingfire splitter needs the blingfire package ({e}; pip install "
                "blingfire==0.1.8), or use --sentence-splitter punkt"
            ) from None
        except OSError as e:
            # Its wheel ships the library for x86-64 Linux, macOS and Windows only.
            raise SplitterUnavailableError(
                f"blingfire's native library does not load on this platform ({e}); use "
                "--sentence-splitter punkt"
            ) from None
        lib = blingfire.blingfire
        lib.TextToSentencesWithOffsets.restype = ctypes.c_int
        return lib

    def _buffers(self, nbytes: int):
        if nbytes > self._capacity:
            # The library's own wrapper sizes every buffer at twice the input; smaller offset
            # arrays make it write out of bounds.
            self._capacity = max(nbytes, 1 << 16)
            size = 2 * self._capacity
            self._out = ctypes.create_string_buffer(size)
            self._starts = (ctypes.c_int32 * size)()
            self._ends = (ctypes.c_int32 * size)()
        return self._out, self._starts, self._ends

    def _split_call(self, lines: list[bytes], out: list[list[str]]) -> None:
        """Append the sentences of each of ``lines`` (UTF-8) to ``out``, one list per line."""
        data = self._SEP_BYTES.join(lines)
        n = len(data)
        buf, starts, ends = self._buffers(n)
        size = 2 * self._capacity
        got = self._lib.TextToSentencesWithOffsets(data, n, buf, starts, ends, size)
        if got < 0 or got > size:
            if len(lines) > 1:  # find the line it cannot handle; the others still split
                for line in lines:
                    self._split_call([line], out)
                return
            out.append([lines[0].decode("utf-8").strip()])  # kept whole rather than lost
            return
        count = ctypes.string_at(buf, got).count(b"\n") + 1
        # Line i starts at byte first[i]; blingfire's offsets are inclusive byte positions.
        first = [0]
        for line in lines[:-1]:
            first.append(first[-1] + len(line) + len(self._SEP_BYTES))
        result: list[list[str]] = [[] for _ in lines]
        last = len(lines) - 1
        i = 0
        for a, b in zip(starts[:count], ends[:count]):
            while i < last and a >= first[i + 1]:
                i += 1
            text = data[a : b + 1].decode("utf-8", errors="replace")
            if "\u2029" in text:  # crossed a line: cut at the line boundaries
                pieces = text.split("\u2029")
                for k, piece in enumerate(pieces):
                    if piece.strip():
                        result[min(i + k, last)].append(piece.strip())
                i = min(i + len(pieces) - 1, last)
                continue
            text = text.strip()
            if text:
                result[i].append(text)
        out.extend(result)

    def split_many(self, texts: list[str]) -> list[list[str]]:
        per_text = [[line.encode("utf-8") for line in split_lines(t)] for t in texts]
        sentences_per_line: list[list[str]] = []
        call: list[bytes] = []
        call_bytes = 0
        for lines in per_text:
            for line in lines:
                call.append(line)
                call_bytes += len(line) + len(self._SEP_BYTES)
                if call_bytes >= self._MAX_CALL_BYTES:
                    self._split_call(call, sentences_per_line)
                    call, call_bytes = [], 0
        if call:
            self._split_call(call, sentences_per_line)
        it = iter(sentences_per_line)
        return [[s for _ in lines for s in next(it)] for lines in per_text]

    def split(self, text: str) -> list[str]:
        return self.split_many([text])[0]

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()

    def __repr__(self) -> str:
        return "BlingfireSplitter()"


def make_sentence_splitter(name: str = DEFAULT_SENTENCE_SPLITTER, language: str = "english"):
    """The splitter called ``name`` (one of SENTENCE_SPLITTERS). Raises
    SplitterUnavailableError (punkt: PunktNotFoundError) when it cannot run here."""
    if name == "punkt":
        return SentenceSplitter(language)
    if name == "blingfire":
        return BlingfireSplitter()
    raise ValueError(f"unknown sentence splitter {name!r}; expected one of {SENTENCE_SPLITTERS}")


# nltk punkt_tab, offline

NO_LLAMA_INDEX_ENV = "MEGATRON_TACO_NO_LLAMA_INDEX_PUNKT"
_PUNKT_DIR = ("tokenizers", "punkt_tab")


class PunktNotFoundError(SplitterUnavailableError):
    pass


def _llama_index_caches() -> list[str]:
    """nltk_cache directories bundled with llama-index-core, found without importing it
    (importing llama_index.core pulls in dozens of packages we do not install)."""
    bases: list[str] = []
    try:
        # llama_index is a namespace package: find_spec only lists its directories.
        spec = importlib.util.find_spec("llama_index")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        bases.extend(spec.submodule_search_locations)
    roots = list(sys.path)
    with contextlib.suppress(AttributeError):  # site is stubbed out in some embedded interpreters
        roots += site.getsitepackages() + [site.getusersitepackages()]
    bases.extend(os.path.join(r, "llama_index") for r in roots if r)
    caches = (os.path.abspath(os.path.join(b, "core", "_static", "nltk_cache")) for b in bases)
    return [cache for cache in dict.fromkeys(caches) if os.path.isdir(cache)]


def _candidate_roots(search_llama_index: bool) -> list[str]:
    import nltk.data

    roots: list[str] = []
    # NLTK_DATA is read here rather than relying on nltk.data.path, which captured it at
    # import time and misses a value set later (tests, notebooks).
    roots.extend(p for p in os.environ.get("NLTK_DATA", "").split(os.pathsep) if p)
    roots.extend(str(p) for p in nltk.data.path)
    if search_llama_index:
        roots.extend(_llama_index_caches())
    return list(dict.fromkeys(os.path.abspath(os.path.expanduser(r)) for r in roots))


_PUNKT_FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")


def _has_model(root: str, language: str) -> bool:
    """A complete model, unpacked or as the punkt_tab.zip that nltk's downloader leaves."""
    model = Path(root, *_PUNKT_DIR, language)
    if all((model / f).is_file() for f in _PUNKT_FILES):
        return True
    archive = Path(root, _PUNKT_DIR[0], _PUNKT_DIR[1] + ".zip")
    if not archive.is_file():
        return False
    try:
        with zipfile.ZipFile(archive) as zf:
            names = set(zf.namelist())
    except (OSError, zipfile.BadZipFile):
        return False
    return all(f"punkt_tab/{language}/{f}" in names for f in _PUNKT_FILES)


def find_punkt_tab(language: str = "english", *, search_llama_index: bool | None = None) -> str:
    """The nltk data directory (the one containing tokenizers/punkt_tab/<language>/).

    Searched in order: $NLTK_DATA, nltk.data.path, then the nltk_cache shipped inside an
    installed llama-index-core wheel. Set $MEGATRON_TACO_NO_LLAMA_INDEX_PUNKT=1 (or pass
    ``search_llama_index=False``) to skip the last one. Never downloads anything.
    """
    if search_llama_index is None:
        search_llama_index = os.environ.get(NO_LLAMA_INDEX_ENV, "").strip() in ("", "0")
    roots = _candidate_roots(search_llama_index)
    for root in roots:
        if _has_model(root, language):
            return root
    where = "\n  ".join(roots) or "(none)"
    raise PunktNotFoundError(
        f"nltk punkt_tab model for {language!r} not found (needed for sentence splitting). "
        f"Searched:\n  {where}\n"
        "Provide it offline in one of these ways:\n"
        "  * pip install --no-deps llama-index-core   (its wheel bundles "
        "llama_index/core/_static/nltk_cache/tokenizers/punkt_tab)\n"
        f"  * set NLTK_DATA to a directory containing tokenizers/punkt_tab/{language}/ "
        "(e.g. one filled by `python -m nltk.downloader -d DIR punkt_tab` on a machine with "
        "internet access)"
        + ("" if search_llama_index else f"\n(llama-index search disabled by {NO_LLAMA_INDEX_ENV})")
    )


class SentenceSplitter:
    """Splits a document into sentences with nltk's punkt_tab model.

    Every line is split on its own (a newline is a hard boundary, see the module docstring).
    Picklable: only the language and the model directory travel to worker processes; the
    model is loaded lazily on first use in each process.
    """

    def __init__(self, language: str = "english", *, nltk_data: str | None = None):
        self.language = language
        # Resolve now so a missing model fails in the parent process, before any worker starts.
        self.nltk_data = nltk_data if nltk_data is not None else find_punkt_tab(language)
        if not _has_model(self.nltk_data, language):
            raise PunktNotFoundError(
                f"{self.nltk_data}: no tokenizers/punkt_tab/{language}/ model in this directory"
            )
        self._tokenizer = None

    def _load(self):
        import nltk.data
        from nltk.tokenize.punkt import PunktSentenceTokenizer, load_punkt_params

        # nltk >= 3.9 refuses to open data files outside nltk.data.path (its path sandbox),
        # so the directory we found has to be registered there, as llama-index itself does.
        if self.nltk_data not in nltk.data.path:
            nltk.data.path.append(self.nltk_data)
        pointer = nltk.data.find(
            "/".join((*_PUNKT_DIR, self.language)) + "/", paths=[self.nltk_data]
        )
        # Same parameters PunktTokenizer(language) loads, but from exactly the directory
        # found above instead of whatever comes first on nltk.data.path.
        return PunktSentenceTokenizer(load_punkt_params(pointer))

    name = "punkt"

    def split(self, text: str) -> list[str]:
        if self._tokenizer is None:
            self._tokenizer = self._load()
        out: list[str] = []
        for line in split_lines(text):
            out.extend(s.strip() for s in self._tokenizer.tokenize(line) if s.strip())
        return out

    def split_many(self, texts: list[str]) -> list[list[str]]:
        return [self.split(t) for t in texts]

    def __getstate__(self):
        return {**self.__dict__, "_tokenizer": None}  # each process loads the model itself

    def __repr__(self) -> str:
        return f"SentenceSplitter(language={self.language!r}, nltk_data={self.nltk_data!r})"

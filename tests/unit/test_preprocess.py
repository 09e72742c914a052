"""The preprocessing engine: real worker processes, real fixtures, outputs checked token by
token against what corpora.py + the tokenizer produce in-process."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from megatron_taco.data.indexed_dataset import (
    IndexedDataset,
    data_file_path,
    index_file_path,
    unigram_path,
)
from megatron_taco.errors import ConfigError
from megatron_taco.preprocessing.config import (
    InputFile,
    PreprocessConfig,
    PreprocessError,
    dataset_prefix,
    summary_path,
)
from megatron_taco.preprocessing.corpora import iter_records
from megatron_taco.preprocessing.encode import PARSE_ERROR, BatchEncoder
from megatron_taco.preprocessing.inputs import detect_format, expand_inputs
from megatron_taco.preprocessing.preprocess import Preprocessor, preprocess
from megatron_taco.preprocessing.records import RawRecord, Skipped
from megatron_taco.preprocessing.report import InputMeter
from megatron_taco.preprocessing.text import SentenceSplitter, make_sentence_splitter
from megatron_taco.preprocessing.workers import (
    MATH_THREAD_VARS,
    single_threaded_math,
    worker_main,
)

CORPORA = Path(__file__).resolve().parents[1] / "fixtures" / "corpora"
BOTCHAN = Path(__file__).resolve().parents[1] / "fixtures" / "text" / "botchan_excerpt.txt"

# Every fixture of each format, preprocessed together in one run per format.
FORMAT_INPUTS = {
    "wikipedia-xml": ["wikipedia"],
    "wikiextractor": ["wikiextractor/doc", "wikiextractor/json"],
    "bookcorpus": ["bookcorpus/books"],
    "bookcorpus-lines": ["bookcorpus/books_large_p1.txt"],
    "openwebtext": ["openwebtext"],
    "cc-news": ["cc_news"],
    "jsonl": ["jsonl"],
    "parquet": ["parquet"],
}


def run(tmp_path, inputs, tokenizer_model, name="out", **kw) -> tuple[dict, str]:
    cfg = PreprocessConfig(
        input=tuple(str(i) for i in inputs),
        output_prefix=str(tmp_path / name),
        tokenizer_model=tokenizer_model,
        **kw,
    )
    return preprocess(cfg, progress=False), str(tmp_path / name)


def expected_documents(inputs, fmt="auto", keys=("text",), min_chars=0):
    """(documents, skip counter) exactly as corpora.py yields them, in file order."""
    docs, skipped = [], Counter()
    for f in expand_inputs([str(i) for i in inputs]):
        for r in iter_records(
            f, detect_format(f) if fmt == "auto" else fmt, keys, min_chars=min_chars
        ):
            if isinstance(r, Skipped):
                skipped[r.reason] += 1
            else:
                docs.append(r)
    return docs, skipped


def expected_sequences(doc_text, tokenizer, splitter, append_eod):
    texts = splitter.split(doc_text) if splitter is not None else [doc_text]
    seqs = [ids for ids in (tokenizer.encode(t) for t in texts) if ids]
    if append_eod and seqs:
        seqs[-1] = seqs[-1] + [tokenizer.eod_id]
    return seqs


def written_documents(prefix):
    ds = IndexedDataset(prefix)
    di = ds.document_indices
    return [[ds[int(s)].tolist() for s in range(di[d], di[d + 1])] for d in range(len(di) - 1)]


def file_bytes(prefix):
    return {ext: Path(prefix + ext).read_bytes() for ext in (".bin", ".idx", "_unigram.npy")}


@pytest.fixture(scope="module")
def splitter():
    return make_sentence_splitter()  # the default, one document at a time


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~400 documents of Botchan sentences (multi-paragraph), in JSON lines."""
    rng = random.Random(1234)
    lines = [ln for ln in BOTCHAN.read_text().splitlines() if ln.strip()]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for i in range(400):
            paras = rng.sample(lines, k=rng.randint(1, 5))
            f.write(json.dumps({"text": "\n".join(paras), "title": f"Doc {i}"}) + "\n")
    return path


# ---------------------------------------------------------------------------------------
# every corpus format


@pytest.mark.parametrize("fmt", sorted(FORMAT_INPUTS))
def test_each_format_matches_corpora(tmp_path, tokenizer_model, tokenizer, splitter, fmt):
    inputs = [CORPORA / p for p in FORMAT_INPUTS[fmt]]
    summary, out = run(tmp_path, inputs, tokenizer_model, split_sentences=True, append_eod=True)
    docs, skipped = expected_documents(inputs)
    expect = [expected_sequences(d.text["text"], tokenizer, splitter, True) for d in docs]
    expect = [e for e in expect if e]
    assert written_documents(dataset_prefix(out, "text", "sentence")) == expect
    assert summary["documents_written"] == len(expect) == len(docs)
    assert summary["documents_read"] == len(docs) + sum(skipped.values())
    assert {r: n for r, n in summary["skipped"].items() if n} == dict(skipped)
    assert summary["sentences"] == sum(len(e) for e in expect)


def test_document_level_and_two_keys(tmp_path, tokenizer_model, tokenizer, corpus):
    summary, out = run(tmp_path, [corpus], tokenizer_model, json_keys=("text", "title"), workers=2)
    docs, _ = expected_documents([corpus], keys=("text", "title"))
    for key in ("text", "title"):
        prefix = dataset_prefix(out, key, "document")
        written = written_documents(prefix)
        # one sequence per document, documents aligned across keys
        assert written == [[tokenizer.encode(d.text[key])] for d in docs]
        assert summary["datasets"][key]["documents"] == len(docs)
    assert summary["sentences"] is None
    assert summary["sequences"] == 2 * len(docs)


def test_round_trip_text_ids_text(tmp_path, tokenizer_model, tokenizer, splitter, corpus):
    _, out = run(tmp_path, [corpus], tokenizer_model, split_sentences=True, append_eod=True)
    docs, _ = expected_documents([corpus])
    written = written_documents(dataset_prefix(out, "text", "sentence"))
    checked = 0
    for i in random.Random(0).sample(range(len(docs)), 40):
        sentences = splitter.split(docs[i].text["text"])
        seqs = written[i]
        assert seqs[-1][-1] == tokenizer.eod_id
        assert all(tokenizer.eod_id not in s for s in seqs[:-1])
        seqs[-1] = seqs[-1][:-1]
        assert len(seqs) == len(sentences)
        for ids, sentence in zip(seqs, sentences):
            if tokenizer.unk_id in ids:
                continue  # a character the 800-piece test vocabulary cannot spell
            assert tokenizer.decode(ids) == " ".join(sentence.split())
            checked += 1
    assert checked > 50


# ---------------------------------------------------------------------------------------
# determinism, unigram counts, skips


def test_byte_identical_whatever_workers_and_chunk_size(tmp_path, tokenizer_model, corpus):
    outputs = []
    for workers, chunk in ((1, 256), (2, 7), (3, 5)):
        _, out = run(
            tmp_path, [corpus], tokenizer_model, name=f"w{workers}", workers=workers,
            chunk_size=chunk, split_sentences=True, append_eod=True,
        )  # fmt: skip
        outputs.append(file_bytes(dataset_prefix(out, "text", "sentence")))
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0][".bin"]) > 10_000


def test_unigram_counts_equal_bincount_of_bin(tmp_path, tokenizer_model, tokenizer, corpus):
    _, out = run(tmp_path, [corpus], tokenizer_model, workers=2, chunk_size=16, append_eod=True)
    prefix = dataset_prefix(out, "text", "document")
    counts = np.load(unigram_path(prefix))
    tokens = np.fromfile(data_file_path(prefix), dtype=IndexedDataset(prefix).dtype)
    assert counts.dtype == np.int64 and counts.shape == (tokenizer.vocab_size,)
    np.testing.assert_array_equal(counts, np.bincount(tokens, minlength=tokenizer.vocab_size))
    assert counts[tokenizer.eod_id] == IndexedDataset(prefix).num_documents


def test_skip_counts_by_reason_in_summary(tmp_path, tokenizer_model):
    bad = CORPORA / "bad"
    inputs = [bad / "mixed.jsonl"] + [
        bad / f"truncated.jsonl.{c}" for c in ("gz", "bz2", "xz", "zst")
    ]
    summary, out = run(tmp_path, inputs, tokenizer_model, input_format="jsonl", min_chars=200)
    _, skipped = expected_documents(inputs, fmt="jsonl", min_chars=200)
    assert (
        skipped["too_short"] > 0 and skipped["undecodable"] >= 5 and skipped["malformed_json"] > 0
    )
    assert {r: n for r, n in summary["skipped"].items() if n} == dict(skipped)
    assert summary["documents_read"] == summary["documents_written"] + sum(
        summary["skipped"].values()
    )
    # the file on disk says the same as the returned summary, with examples of each reason
    on_disk = json.loads(Path(summary_path(out)).read_text())
    assert on_disk["skipped"] == summary["skipped"]
    assert set(on_disk["skipped_examples"]) == set(skipped)
    assert PARSE_ERROR in summary["skipped"]


def test_wikipedia_skips_redirects_and_namespaces(tmp_path, tokenizer_model):
    summary, _ = run(tmp_path, [CORPORA / "wikipedia"], tokenizer_model)
    assert summary["skipped"]["redirect"] > 0
    assert summary["skipped"]["non_main_namespace"] > 0
    assert summary["input_bytes_are_compressed"]  # the .bz2 dump is one of the inputs


def test_nothing_written_is_an_error(tmp_path, tokenizer_model):
    path = tmp_path / "keys.jsonl"
    path.write_text('{"body": "no text key here."}\n' * 3)
    with pytest.raises(PreprocessError, match="missing_key: 3"):
        run(tmp_path, [path], tokenizer_model)
    assert sorted(os.listdir(tmp_path)) == ["keys.jsonl"]


# ---------------------------------------------------------------------------------------
# sentence splitters and the [UNK] rate

# punkt ends sentences at "No." and "Op.", blingfire does not: the two give different data.
ABBREVIATIONS = (
    "The Symphony No. 5 in C minor, Op. 67, is a symphony by Ludwig van Beethoven. It was "
    "composed between 1804 and 1808.\nSgt. Pepper is an album. It was released in 1967."
)


def test_sentence_splitter_option_picks_the_splitter(tmp_path, tokenizer_model, tokenizer, corpus):
    path = tmp_path / "abbrev.jsonl"
    path.write_text(json.dumps({"text": ABBREVIATIONS}) + "\n" + corpus.read_text())
    docs, _ = expected_documents([path])
    written = {}
    for name in ("punkt", "blingfire"):
        _, out = run(tmp_path, [path], tokenizer_model, name=name, split_sentences=True,
                     sentence_splitter=name, workers=2)  # fmt: skip
        written[name] = written_documents(dataset_prefix(out, "text", "sentence"))
        splitter = SentenceSplitter() if name == "punkt" else make_sentence_splitter(name)
        expect = [expected_sequences(d.text["text"], tokenizer, splitter, False) for d in docs]
        assert written[name] == expect
    assert len(written["punkt"][0]) == 7 and len(written["blingfire"][0]) == 4


def test_unk_rate_per_input(tmp_path, botchan_path, capsys):
    from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer
    from megatron_taco.data.tokenizer import Tokenizer

    plain, web = tmp_path / "plain.jsonl", tmp_path / "web.jsonl"
    lines = [ln for ln in botchan_path.read_text().splitlines() if ln.strip()]
    plain.write_text("".join(json.dumps({"text": ln}) + "\n" for ln in lines[:200]))
    web.write_text(
        "".join(
            json.dumps({"text": f"{ln} \U0001f600 \u6f22\u5b57 caf\u00e9"}) + "\n"
            for ln in lines[200:260]
        )
    )
    for byte_fallback in (False, True):
        model = train_tokenizer(
            TrainTokenizerConfig(
                input=(str(botchan_path),), model_prefix=str(tmp_path / f"spm{byte_fallback}"),
                vocab_size=600, byte_fallback=byte_fallback, character_coverage=1.0,
                num_threads=1,
            )
        )  # fmt: skip
        tok = Tokenizer(model)
        summary, out = run(tmp_path, [plain, web], model, name=f"out{byte_fallback}", workers=2)
        capsys.readouterr()
        per_input = summary["unk"]["per_input"]
        # an independent count: encode every document and count [UNK] ids
        for path in (plain, web):
            ids = [tok.encode(json.loads(x)["text"]) for x in path.read_text().splitlines()]
            unk = sum(i.count(tok.unk_id) for i in ids)
            assert per_input[str(path)]["tokens"] == unk
            assert per_input[str(path)]["rate"] == pytest.approx(unk / sum(map(len, ids)), abs=1e-8)
        total = summary["unk"]["tokens"]
        assert total == int(np.load(unigram_path(dataset_prefix(out, "text", "document")))[1])
        if byte_fallback:
            assert total == 0
        else:
            # each record adds three unknown characters: 😀, 漢字 (one [UNK]: a run) and é
            assert per_input[str(web)]["tokens"] >= 3 * 60
            assert per_input[str(plain)]["rate"] == 0 and per_input[str(web)]["rate"] > 1e-3
    # the summary printed by the tool names the bad corpus, and only it
    preprocess(
        PreprocessConfig(input=(str(plain), str(web)), output_prefix=str(tmp_path / "again"),
                         tokenizer_model=str(tmp_path / "spmFalse.model")),
        progress=False,
    )  # fmt: skip
    printed = capsys.readouterr().out
    warning = [ln for ln in printed.splitlines() if "warning: [UNK]" in ln]
    assert len(warning) == 1 and str(web) in warning[0] and str(plain) not in warning[0]


# ---------------------------------------------------------------------------------------
# the batch encoder on its own


def test_batch_encoder_eod_only_on_last_sequence_and_empty_dropped(tokenizer, splitter):
    records = [
        RawRecord("jsonl", json.dumps({"text": "First one. Second one here.\nThird."}), "a"),
        RawRecord("jsonl", json.dumps({"text": "   "}), "b"),  # empty after cleaning
        RawRecord("jsonl", json.dumps({"text": "Only sentence."}), "c"),
    ]
    enc = BatchEncoder(tokenizer, ("text",), splitter=splitter, append_eod=True).encode(records)
    kb = enc.per_key["text"]
    assert enc.documents == 2 and enc.skips.counts == Counter({"empty": 1})
    assert kb.doc_seq_counts.tolist() == [3, 1]
    ends = np.cumsum(kb.seq_lengths) - 1
    is_eod = kb.tokens[ends] == tokenizer.eod_id
    assert is_eod.tolist() == [False, False, True, True]
    assert int(kb.seq_lengths.sum()) == kb.tokens.shape[0]


# ---------------------------------------------------------------------------------------
# validation: every bad argument is named before any work starts


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"workers": 0}, "--workers"),
        ({"chunk_size": 0}, "--chunk-size"),
        ({"min_chars": -1}, "--min-chars"),
        ({"json_keys": ()}, "--json-keys"),
        ({"json_keys": ("a/b",)}, "--json-keys"),
        ({"json_keys": ("text", "text")}, "--json-keys"),
        ({"keep_newlines": True}, "--keep-newlines"),
        ({"dataset_impl": "lazy"}, "--dataset-impl"),
        ({"input_format": "csv"}, "--input-format"),
        ({"output_prefix": "somewhere/"}, "--output-prefix"),
        ({"sentence_splitter": "spacy"}, "--sentence-splitter"),
    ],
)
def test_config_errors_name_the_flag(change, flag):
    base = {"input": ("x.jsonl",), "output_prefix": "out", "tokenizer_model": "m.model"}
    with pytest.raises(ConfigError, match=f"^{flag}"):
        PreprocessConfig(**{**base, **change})


def test_filesystem_errors_name_the_file(tmp_path, tokenizer_model, corpus):
    ok = {
        "input": (str(corpus),),
        "output_prefix": str(tmp_path / "o"),
        "tokenizer_model": tokenizer_model,
    }
    cases = [
        ({"input": (str(corpus), str(tmp_path / "missing.jsonl"))}, "--input: .*missing.jsonl"),
        ({"input": (str(tmp_path / "nope*.jsonl"),)}, "--input: .*nope\\*.jsonl"),
        ({"tokenizer_model": str(tmp_path / "no.model")}, "--tokenizer-model: .*no.model"),
        ({"tokenizer_model": str(corpus)}, "--tokenizer-model: .*corpus.jsonl"),
        ({"output_prefix": str(tmp_path / "no_dir" / "o")}, "--output-prefix: .*no_dir"),
        (
            {"input": (str(CORPORA / "bad" / "not_a_corpus.bin"),)},
            "--input-format .*not_a_corpus.bin",
        ),
    ]
    for change, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            preprocess(PreprocessConfig(**{**ok, **change}), progress=False)
    assert not any(p.name.startswith(".o.") for p in tmp_path.iterdir())  # no work started


# ---------------------------------------------------------------------------------------
# failures and temp files


def _worker_with_bad_model(spec, rank, tasks, results):
    # The real worker, but its tokenizer cannot load: a genuine in-worker exception.
    worker_main(
        dataclasses.replace(spec, tokenizer_model="/nonexistent/spm.model"), rank, tasks, results
    )


def _worker_that_dies(spec, rank, tasks, results):
    tasks.get()
    os._exit(7)


class _BadModelRun(Preprocessor):
    worker_target = staticmethod(_worker_with_bad_model)


class _DyingRun(Preprocessor):
    worker_target = staticmethod(_worker_that_dies)


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (_BadModelRun, r"worker \d failed:\n(.|\n)*FileNotFoundError: /nonexistent/spm.model"),
        (_DyingRun, r"worker \d \(pid \d+\) exited with code 7"),
    ],
)
def test_worker_failure_fails_the_run_and_keeps_old_outputs(
    tmp_path, tokenizer_model, corpus, cls, message
):
    _, out = run(tmp_path, [corpus], tokenizer_model)
    prefix = dataset_prefix(out, "text", "document")
    before = file_bytes(prefix)
    cfg = PreprocessConfig(
        input=(str(corpus),), output_prefix=out, tokenizer_model=tokenizer_model, workers=2,
        chunk_size=8, append_eod=True,
    )  # fmt: skip
    with pytest.raises(PreprocessError, match=message):
        cls(cfg, progress=False).run()
    assert file_bytes(prefix) == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_stale_temp_of_dead_run_is_removed(tmp_path, tokenizer_model, corpus):
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f".out.tmp-{int(dead.stdout)}"
    (stale / "shards").mkdir(parents=True)
    (stale / "out_text_document.bin").write_bytes(b"partial")
    alive = tmp_path / ".out.tmp-1"  # pid 1 is alive: maybe a concurrent run, left alone
    alive.mkdir()
    other = tmp_path / f".out_other.tmp-{int(dead.stdout)}"  # another prefix: not ours
    other.mkdir()
    run(tmp_path, [corpus], tokenizer_model)
    assert not stale.exists() and alive.exists() and other.exists()


# ---------------------------------------------------------------------------------------
# input progress


def test_workers_start_with_single_threaded_math_and_the_env_is_restored(monkeypatch):
    import multiprocessing as mp

    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    ctx = mp.get_context("spawn")
    seen = ctx.Queue()
    with single_threaded_math():
        child = ctx.Process(target=_report_env, args=(seen, MATH_THREAD_VARS))
        child.start()
    assert seen.get(timeout=60) == dict.fromkeys(MATH_THREAD_VARS, "1")
    child.join()
    assert os.environ["OMP_NUM_THREADS"] == "8" and "OPENBLAS_NUM_THREADS" not in os.environ


def _report_env(queue, names):
    queue.put({k: os.environ.get(k) for k in names})


def test_input_meter_counts_compressed_bytes_read(tmp_path):
    path = tmp_path / "big.jsonl.gz"
    payload = os.urandom(3 << 20).hex().encode()  # incompressible: 6 MB of hex
    with gzip.open(path, "wb") as f:
        f.write(payload)
    size = path.stat().st_size
    meter = InputMeter()
    meter.start(InputFile(str(path), "jsonl", size, True))
    with gzip.open(path, "rb") as f:
        f.read(1 << 20)
        mid = meter.consumed()
        assert 0 < mid < size  # the on-disk position, not the 1 MB decompressed
    meter.finish()
    assert meter.consumed() == size


def test_index_is_readable_by_own_reader_with_expected_shape(tmp_path, tokenizer_model, corpus):
    summary, out = run(
        tmp_path, [corpus], tokenizer_model, split_sentences=True, workers=2, chunk_size=9
    )
    prefix = dataset_prefix(out, "text", "sentence")
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16
    assert len(ds) == summary["datasets"]["text"]["sequences"]
    assert ds.num_documents == 400
    assert os.path.getsize(index_file_path(prefix)) == 34 + 12 * len(ds) + 8 * 401


def test_unavailable_splitter_is_one_line_naming_the_flag(tmp_path, tokenizer_model, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "blingfire", None)  # not installed
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": "One. Two."}) + "\n")
    with pytest.raises(ConfigError) as err:
        run(tmp_path, [path], tokenizer_model, split_sentences=True)
    message = str(err.value)
    assert message.startswith("--sentence-splitter blingfire: ") and "\n" not in message
    assert "--sentence-splitter punkt" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]  # nothing started

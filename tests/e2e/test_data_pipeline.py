"""Steps 1-3 of examples/demo.sh as a user runs them: train the tokenizer, preprocess, build
the sample indices, each a real CLI subprocess from the repository root, on the first
documents of the bundled corpus. What comes out is then checked against megatron-core's
reader, against the source text and against itself."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from megatron_taco.data.indexed_dataset import IndexedDataset, data_file_path, unigram_path
from megatron_taco.data.tokenizer import Tokenizer
from megatron_taco.preprocessing.text import make_sentence_splitter, normalize_text

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "examples" / "corpus" / "demo.jsonl.gz"
N_DOCS = 120  # of the corpus's ~450: enough for every split to have documents, and quick
VOCAB = 1000
SAMPLES = {"train": 300, "valid": 16, "test": 8}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(*args) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, f"{args[0]} failed:\n{res.stdout}\n{res.stderr}"
    return res


@dataclass(frozen=True)
class Pipeline:
    source: list[dict]  # the records given to the tools, in order
    tokenizer_model: Path
    prefix: str  # the preprocessed dataset
    cache: Path
    build_samples: tuple  # the build_samples.py command line
    first_build: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Pipeline:
    out = tmp_path_factory.mktemp("pipeline")
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        lines = list(islice(f, N_DOCS))
    assert len(lines) == N_DOCS
    corpus = out / "slice.jsonl.gz"
    with gzip.open(corpus, "wt", encoding="utf-8") as f:
        f.writelines(lines)

    run("tools/train_tokenizer.py", "--input", corpus, "--model-prefix", out / "tokenizer",
        "--vocab-size", VOCAB, "--split-sentences")  # fmt: skip
    model = out / "tokenizer.model"
    run("tools/preprocess_data.py", "--input", corpus, "--tokenizer-model", model,
        "--output-prefix", out / "demo", "--split-sentences", "--workers", 2)  # fmt: skip
    prefix = str(out / "demo_text_sentence")
    build = ("tools/build_samples.py", "--data-path", prefix, "--tokenizer-model", model,
             "--seq-length", 128, "--split", "90,5,5", "--train-samples", SAMPLES["train"],
             "--valid-samples", SAMPLES["valid"], "--test-samples", SAMPLES["test"],
             "--data-cache-path", out / "cache")  # fmt: skip
    return Pipeline(
        source=[json.loads(line) for line in lines],
        tokenizer_model=model,
        prefix=prefix,
        cache=out / "cache",
        build_samples=build,
        first_build=run(*build),
    )


def documents(ds: IndexedDataset) -> list[list[list[int]]]:
    di = ds.document_indices
    return [[ds[int(s)].tolist() for s in range(di[d], di[d + 1])] for d in range(len(di) - 1)]


def test_megatron_core_reads_the_same_dataset(pipeline):
    mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    ours = IndexedDataset(pipeline.prefix)
    theirs = mcore.IndexedDataset(pipeline.prefix)
    assert ours.num_documents == N_DOCS  # every record of the slice became a document
    assert len(ours) > 10 * N_DOCS  # sentence level: many sequences per document
    assert len(theirs) == len(ours)
    np.testing.assert_array_equal(theirs.sequence_lengths, ours.sizes)
    np.testing.assert_array_equal(theirs.document_indices, ours.document_indices)
    for i in range(len(ours)):
        np.testing.assert_array_equal(theirs[i], ours[i])
    i = int(np.argmax(ours.sizes))
    np.testing.assert_array_equal(theirs.get(i, offset=2, length=5), ours.get(i, 2, 5))


def test_ids_decode_to_the_normalised_source_sentences(pipeline):
    tokenizer = Tokenizer(pipeline.tokenizer_model)
    splitter = make_sentence_splitter()  # the default the tool used
    written = documents(IndexedDataset(pipeline.prefix))
    checked = with_unknown = 0
    for record, sequences in zip(pipeline.source, written):
        sentences = splitter.split(normalize_text(record["text"]))
        assert len(sequences) == len(sentences)
        for ids, sentence in zip(sequences, sentences):
            if tokenizer.unk_id in ids:
                with_unknown += 1  # a character the 1000-piece vocabulary left out
                continue
            # SentencePiece's own normalisation collapses whitespace; nothing else differs
            assert tokenizer.decode(ids) == " ".join(sentence.split())
            checked += 1
    assert checked > 20 * with_unknown


def test_unigram_counts_are_the_bincount_of_the_bin(pipeline):
    ds = IndexedDataset(pipeline.prefix)
    counts = np.load(unigram_path(pipeline.prefix))
    tokens = np.fromfile(data_file_path(pipeline.prefix), dtype=ds.dtype)
    assert counts.dtype == np.int64 and counts.shape == (VOCAB,)
    np.testing.assert_array_equal(counts, np.bincount(tokens, minlength=VOCAB))
    assert counts.sum() == ds.sizes.sum()


def split_rows(stdout: str) -> dict[str, list[str]]:
    """The per-split rows of build_samples' summary table, as columns."""
    return {
        cols[0]: cols
        for cols in (line.split() for line in stdout.splitlines())
        if cols and cols[0] in SAMPLES and len(cols) == 11
    }


def cache_state(cache: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in cache.iterdir()}


def test_build_samples_summarises_each_split_then_reuses_its_cache(pipeline):
    first = pipeline.first_build
    assert f"sample indices cached in {pipeline.cache}" in first.stdout
    rows = split_rows(first.stdout)
    assert set(rows) == set(SAMPLES), first.stdout
    for split, cols in rows.items():
        # split dataset docs skipped epochs samples mean-tok max-tok padding truncated status
        assert cols[1] == "demo_text_sentence"
        assert int(cols[2]) > 0 and int(cols[5]) == SAMPLES[split]
        assert 2 < float(cols[6]) <= int(cols[7]) <= 128
        assert cols[10] == "built"
    assert re.search(r"^example: sample \d+ of train", first.stdout, re.M)
    index_files = sorted(p for p in pipeline.cache.iterdir() if p.suffix == ".npy")
    assert len(index_files) == len(SAMPLES)
    before = cache_state(pipeline.cache)

    second = run(*pipeline.build_samples)
    rows_again = split_rows(second.stdout)
    assert {s: cols[10] for s, cols in rows_again.items()} == dict.fromkeys(SAMPLES, "loaded")
    # the same samples: every column but the status agrees
    assert {s: c[:10] for s, c in rows_again.items()} == {s: c[:10] for s, c in rows.items()}
    assert second.stderr.count("loaded cached bert_sample_index") == len(SAMPLES)
    assert "built bert_sample_index" not in second.stderr
    assert cache_state(pipeline.cache) == before  # nothing rewritten, nothing added

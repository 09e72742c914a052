import logging
import os
import pickle
import re
import warnings

import numpy as np
import pytest

from megatron_taco.cli import build_samples
from megatron_taco.data.bert_dataset import BertSampleDataset, build_train_valid_test_datasets
from megatron_taco.data.blending import BlendedDataset
from megatron_taco.data.cache import load_or_build
from megatron_taco.data.config import DataConfig
from megatron_taco.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_taco.errors import ConfigError
from tests.conftest import BOTCHAN


def sentences_of_botchan():
    text = " ".join(BOTCHAN.read_text(encoding="utf-8").split())
    return [s for s in re.split(r"(?<=[.!?;])\s+", text) if s]


def write_dataset(prefix, tokenizer, docs_of=7, offset=0, append_eod=False):
    sents = sentences_of_botchan()[offset:]
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    docs = []
    for i in range(0, len(sents) - docs_of + 1, docs_of):
        doc = [tokenizer.encode(s) for s in sents[i : i + docs_of]]
        if append_eod:
            doc[-1] = doc[-1] + [tokenizer.sep_id]
        builder.add_document(doc)
        docs.append(doc)
    builder.finalize(str(prefix) + ".idx")
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("corpus")
    write_dataset(d / "a", tokenizer)
    write_dataset(d / "b", tokenizer, docs_of=5, offset=3)
    return d


def config(corpus, tokenizer_model, tmp_path, **kw):
    kw.setdefault("data_path", (str(corpus / "a"),))
    kw.setdefault("data_cache_path", str(tmp_path / "cache"))
    kw.setdefault("seq_length", 48)
    return DataConfig(tokenizer_model=tokenizer_model, **kw)


def test_sample_fields(corpus, tokenizer):
    ds = IndexedDataset(str(corpus / "a"))
    index = np.array([[0, 3, 44], [7, 9, 5], [3, 4, 44]], dtype=np.int64)
    data = BertSampleDataset(
        ds,
        index,
        seq_length=48,
        cls_id=tokenizer.cls_id,
        sep_id=tokenizer.sep_id,
        pad_id=tokenizer.pad_id,
        word_start_mask=tokenizer.word_start_mask(),
        special_token_mask=tokenizer.is_special_mask(),
    )
    assert len(data) == 3
    for i, (s, e, t) in enumerate(index.tolist()):
        x = data[i]
        assert x["index"] == i
        body = np.concatenate([ds[j] for j in range(s, e)]).astype(np.int64)[:t]
        n = x["length"]
        assert n == body.shape[0] + 2 <= 48
        tok = x["tokens"]
        assert tok.dtype == np.int64 and tok.shape == (48,)
        assert tok[0] == tokenizer.cls_id and tok[n - 1] == tokenizer.sep_id
        assert np.array_equal(tok[1 : n - 1], body)
        assert np.all(tok[n:] == tokenizer.pad_id)
        # sentence numbers follow the stored sentences (cut with the body)
        lens = ds.sizes[s:e]
        want = np.repeat(np.arange(e - s), lens)[: n - 2]
        assert np.array_equal(x["sentence_ids"][1 : n - 1], want)
        assert x["sentence_ids"][0] == x["sentence_ids"][n - 1] == -1
        assert np.all(x["sentence_ids"][n:] == -1)
        ws = x["word_starts"]
        assert ws.dtype == bool and ws[0] and ws[n - 1] and not ws[n:].any()
        assert np.array_equal(ws[1 : n - 1], tokenizer.word_start_mask()[body])
        sp = x["special"]
        assert sp[0] and sp[n - 1] and sp[n:].all() and not sp[1 : n - 1].any()
    assert data[1]["length"] == 7  # target 5 truncates the two sentences
    with pytest.raises(IndexError):
        data[3]
    too_long = BertSampleDataset(
        ds,
        np.array([[0, 3, 60]]),
        seq_length=48,
        cls_id=2,
        sep_id=3,
        pad_id=0,
        word_start_mask=tokenizer.word_start_mask(),
    )
    with pytest.raises(ValueError, match="longer --seq-length"):
        too_long[0]


def test_trailing_eod_gives_one_sep(tmp_path, tokenizer):
    write_dataset(tmp_path / "eod", tokenizer, append_eod=True)
    ds = IndexedDataset(str(tmp_path / "eod"))
    assert ds[6][-1] == tokenizer.sep_id  # the last sentence of document 0
    data = BertSampleDataset(
        ds,
        np.array([[4, 7, 500]]),
        seq_length=512,
        cls_id=2,
        sep_id=tokenizer.sep_id,
        pad_id=0,
        word_start_mask=tokenizer.word_start_mask(),
        special_token_mask=tokenizer.is_special_mask(),
    )
    x = data[0]
    n = x["length"]
    assert n == int(ds.sizes[4:7].sum()) + 1  # [CLS] body-without-eod [SEP]
    assert np.count_nonzero(x["tokens"] == tokenizer.sep_id) == 1


def test_build_datasets_cache_reuse_and_rebuild(
    corpus, tokenizer, tokenizer_model, tmp_path, caplog
):
    cfg = config(corpus, tokenizer_model, tmp_path)
    train, valid, test = build_train_valid_test_datasets(cfg, tokenizer, (300, 20, 0))
    assert test is None
    assert len(train) == 300 and len(valid) == 20
    assert train.info["status"] == "built" and valid.info["status"] == "built"
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len([f for f in files if f.endswith("description.json")]) == 2
    npys = [tmp_path / "cache" / f for f in files if f.endswith(".npy")]
    mtimes = [p.stat().st_mtime_ns for p in npys]
    # train and valid use disjoint documents
    ds = train.indexed_dataset
    n_docs = ds.num_documents
    train_end = ds.document_indices[train.info["doc_range"][1]]
    assert train.info["doc_range"] == [0, round(n_docs * 0.949)]
    assert np.asarray(train.sample_index)[:, 1].max() <= train_end
    assert np.asarray(valid.sample_index)[:, 0].min() >= train_end
    x = train[5]
    assert x["tokens"][0] == tokenizer.cls_id and x["index"] == 5

    caplog.set_level("INFO", logger="megatron_taco.data.cache")
    again, _, _ = build_train_valid_test_datasets(cfg, tokenizer, (300, 20, 0))
    assert again.info["status"] == "loaded"
    assert "loaded cached" in caplog.text
    assert isinstance(again.sample_index, np.memmap)
    assert np.array_equal(again.sample_index, train.sample_index)
    assert [p.stat().st_mtime_ns for p in npys] == mtimes  # not rewritten
    # pickles as the cache file, not its contents
    assert len(pickle.dumps(again)) < 20_000
    assert np.array_equal(pickle.loads(pickle.dumps(again))[7]["tokens"], again[7]["tokens"])

    changed = config(corpus, tokenizer_model, tmp_path, seed=99)
    other, _, _ = build_train_valid_test_datasets(changed, tokenizer, (300, 0, 0))
    assert other.info["status"] == "built"
    assert not np.array_equal(other.sample_index, train.sample_index)
    assert len([f for f in os.listdir(tmp_path / "cache") if f.endswith("description.json")]) == 3


def test_blended_datasets(corpus, tokenizer, tokenizer_model, tmp_path):
    cfg = config(
        corpus,
        tokenizer_model,
        tmp_path,
        data_path=("0.25", str(corpus / "a"), "0.75", str(corpus / "b")),
        split="90,10,0",
    )
    train, valid, test = build_train_valid_test_datasets(cfg, tokenizer, (400, 40, 0))
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset) and test is None
    assert len(train) == 400
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert abs(counts[0] - 100) <= 1
    assert [len(p) for p in train.datasets] == [101, 302]  # ceil(ceil(w n) * 1.005)
    assert [train[i]["index"] for i in range(5)] == list(range(5))
    again, _, _ = build_train_valid_test_datasets(cfg, tokenizer, (400, 40, 0))
    assert all(p.info["status"] == "loaded" for p in again.datasets)


def test_empty_split_with_samples_requested(corpus, tokenizer, tokenizer_model, tmp_path, caplog):
    # The default --split 949,50,1 on a small corpus: a one-line note sized to the data,
    # not a warning that names the --eval-iters default's 400 samples.
    caplog.set_level(logging.INFO, logger="megatron_taco.data.bert_dataset")
    cfg = config(corpus, tokenizer_model, tmp_path, split="949,50,1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train, valid, test = build_train_valid_test_datasets(cfg, tokenizer, (10, 5, 400))
    assert len(train) == 10 and len(valid) == 5 and test is None
    docs = IndexedDataset(str(corpus / "a")).num_documents
    (note,) = [r.getMessage() for r in caplog.records if "note:" in r.getMessage()]
    assert note == (
        f"note: --split 949,50,1 gives the test split 0.1% of the {docs} documents of "
        f"{corpus / 'a'}, which rounds to none: test evaluation is skipped (a test share of "
        f"about {100 / docs:.2g}% or more would give it a document)"
    )
    cfg = config(corpus, tokenizer_model, tmp_path, split="100,0,0")
    train, valid, test = build_train_valid_test_datasets(cfg, tokenizer, (10, 5, 0))
    assert len(train) == 10 and valid is None and test is None
    cfg = config(corpus, tokenizer_model, tmp_path, split="0,1,0")
    with pytest.raises(ConfigError, match="--split.*train split none of"):
        build_train_valid_test_datasets(cfg, tokenizer, (10, 5, 0))


def test_unwritable_cache_builds_in_memory(corpus, tokenizer, tokenizer_model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = config(corpus, tokenizer_model, tmp_path, data_cache_path=str(blocker / "cache"))
    with pytest.warns(UserWarning, match="cannot write"):
        train, _, _ = build_train_valid_test_datasets(cfg, tokenizer, (50, 0, 0))
    assert train.info["status"] == "memory" and len(train) == 50


def test_cache_entries_are_atomic_and_described(tmp_path):
    calls = []

    def build():
        calls.append(1)
        return {"x": np.arange(5)}, {"note": "hi"}

    e1 = load_or_build("thing", {"a": 1}, ("x",), build, str(tmp_path))
    e2 = load_or_build("thing", {"a": 1}, ("x",), build, str(tmp_path))
    e3 = load_or_build("thing", {"a": 2}, ("x",), build, str(tmp_path))
    assert len(calls) == 2 and (e1.status, e2.status, e3.status) == ("built", "loaded", "built")
    assert e1.key == e2.key != e3.key and e2.info == {"note": "hi"}
    names = sorted(os.listdir(tmp_path))
    assert names == sorted(
        f"thing-{k}-{s}" for k in (e1.key, e3.key) for s in ("x.npy", "description.json")
    )
    # an entry without its description (a crash before it was written) is rebuilt
    os.unlink(tmp_path / f"thing-{e1.key}-description.json")
    assert load_or_build("thing", {"a": 1}, ("x",), build, str(tmp_path)).status == "built"


def test_config_validation(corpus, tokenizer_model, tmp_path):
    with pytest.raises(ConfigError, match="--seq-length"):
        config(corpus, tokenizer_model, tmp_path, seq_length=4)
    with pytest.raises(ConfigError, match="--short-seq-prob"):
        config(corpus, tokenizer_model, tmp_path, short_seq_prob=1.5)
    with pytest.raises(ConfigError, match="--min-sentences"):
        config(corpus, tokenizer_model, tmp_path, min_sentences=0)
    with pytest.raises(ConfigError, match="--split"):
        config(corpus, tokenizer_model, tmp_path, split="a,b")
    with pytest.raises(ConfigError, match="--data-path.*positive"):
        config(corpus, tokenizer_model, tmp_path, data_path=("0", "x", "1", "y"))
    cfg = config(corpus, tokenizer_model, tmp_path, data_path=str(corpus / "a"))
    assert cfg.data_path == (str(corpus / "a"),)
    assert config(corpus, tokenizer_model, tmp_path, data_cache_path=None).cache_dir() == str(
        corpus / "cache"
    )
    missing = config(
        corpus,
        tokenizer_model,
        tmp_path,
        data_path=("1", str(corpus / "a"), "1", str(corpus / "nope")),
    )
    with pytest.raises(ConfigError, match=r"--data-path.*nope.*nope\.idx does not exist"):
        missing.validate_files()
    os.link(corpus / "a.idx", tmp_path / "half.idx")
    with pytest.raises(ConfigError, match=r"half\.bin does not exist"):
        config(corpus, tokenizer_model, tmp_path, data_path=str(tmp_path / "half")).validate_files()
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        DataConfig(
            data_path=(str(corpus / "a"),), tokenizer_model=str(tmp_path / "x.model")
        ).validate_files()


def test_build_samples_cli(corpus, tokenizer_model, tmp_path, capsys):
    argv = [
        "--data-path",
        "1",
        str(corpus / "a"),
        "3",
        str(corpus / "b"),
        "--tokenizer-model",
        tokenizer_model,
        "--seq-length",
        "40",
        "--split",
        "8,1,1",
        "--train-samples",
        "200",
        "--valid-samples",
        "20",
        "--test-samples",
        "10",
        "--data-cache-path",
        str(tmp_path / "c"),
    ]
    assert build_samples.main(argv) == 0
    out = capsys.readouterr().out
    assert "blend of 200" in out and "requested 0.7500" in out
    assert out.count("built") == 6 and "[CLS]" in out
    assert build_samples.main(argv) == 0
    assert capsys.readouterr().out.count("loaded") == 6
    with pytest.raises(SystemExit):
        build_samples.main(
            [
                "--data-path",
                str(tmp_path / "missing"),
                "--tokenizer-model",
                tokenizer_model,
                "--train-samples",
                "5",
            ]
        )
    assert "missing.idx does not exist" in capsys.readouterr().err

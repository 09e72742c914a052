import hashlib
import os
import time
import warnings

import numpy as np

from megatron_taco.data.indexed_dataset import IndexedDatasetBuilder
from tests.helpers import run_distributed


class FakeTokenizer:
    vocab_size = 64
    pad_id, cls_id, sep_id = 0, 2, 3

    def word_start_mask(self):
        return np.arange(self.vocab_size) % 3 == 0

    def is_special_mask(self):
        return np.isin(np.arange(self.vocab_size), [0, 2, 3, 4])


def write_corpus(prefix):
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(200):
        builder.add_document(
            [rng.integers(5, 64, size=rng.integers(1, 20)) for _ in range(rng.integers(1, 9))]
        )
    builder.finalize(prefix + ".idx")


def digest(arr):
    return hashlib.md5(np.ascontiguousarray(arr).tobytes()).hexdigest()


def build_on_all_ranks(rank, world_size, data_path, tokenizer_model, cache_dir):
    from megatron_taco.data.bert_dataset import build_train_valid_test_datasets
    from megatron_taco.data.config import DataConfig
    from megatron_taco.parallel import comm

    cfg = DataConfig(
        data_path=tuple(data_path),
        tokenizer_model=tokenizer_model,
        seq_length=32,
        split="90,10,0",
        data_cache_path=cache_dir,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train, valid, _ = build_train_valid_test_datasets(
            cfg, FakeTokenizer(), (500, 50, 0), comm.barrier
        )
    parts = train.datasets if hasattr(train, "datasets") else [train]
    return {
        "statuses": [p.info["status"] for p in parts]
        + [
            valid_part.info["status"]
            for valid_part in (valid.datasets if hasattr(valid, "datasets") else [valid])
        ],
        "train": [digest(p.sample_index) for p in parts],
        "first_tokens": train[0]["tokens"].tolist(),
        "done": time.time(),
        "warnings": [str(w.message) for w in caught],
    }


def count_builds(rank, world_size, cache_dir):
    from megatron_taco.data.cache import load_or_build
    from megatron_taco.parallel import comm

    builds = []

    def build():
        builds.append(rank)
        time.sleep(0.5)  # rank 1 must wait at the barrier, not find half-written files
        return {"x": np.arange(1000) * 7}, {}

    entry = load_or_build("probe", {"what": "distributed"}, ("x",), build, cache_dir, comm.barrier)
    return len(builds), entry.status, digest(entry.arrays["x"]), time.time()


def test_rank0_builds_once_others_wait(tmp_path):
    cache = str(tmp_path / "cache")
    results = run_distributed(count_builds, 2, cache)
    assert [r[0] for r in results] == [1, 0]
    assert [r[1] for r in results] == ["built", "loaded"]
    assert results[0][2] == results[1][2]
    described = os.path.join(
        cache, [f for f in os.listdir(cache) if f.endswith("description.json")][0]
    )
    assert results[1][3] >= os.path.getmtime(described)  # rank 1 finished after the files appeared


def test_datasets_identical_on_every_rank(tmp_path):
    write_corpus(str(tmp_path / "a"))
    write_corpus(str(tmp_path / "b"))
    (tmp_path / "tok.model").write_bytes(b"unused by FakeTokenizer")
    data_path = ["1", str(tmp_path / "a"), "2", str(tmp_path / "b")]
    cache = str(tmp_path / "cache")
    first = run_distributed(build_on_all_ranks, 2, data_path, str(tmp_path / "tok.model"), cache)
    assert set(first[0]["statuses"]) == {"built"} and set(first[1]["statuses"]) == {"loaded"}
    assert first[0]["train"] == first[1]["train"]
    assert first[0]["first_tokens"] == first[1]["first_tokens"]
    n_files = len(os.listdir(cache))
    # a second run (a restart) reuses every file on every rank
    second = run_distributed(build_on_all_ranks, 2, data_path, str(tmp_path / "tok.model"), cache)
    assert all(set(r["statuses"]) == {"loaded"} for r in second)
    assert second[0]["train"] == first[0]["train"]
    assert len(os.listdir(cache)) == n_files


def test_unwritable_cache_every_rank_builds_in_memory(tmp_path):
    write_corpus(str(tmp_path / "a"))
    (tmp_path / "tok.model").write_bytes(b"x")
    (tmp_path / "blocker").write_text("a file where the cache directory should be")
    results = run_distributed(
        build_on_all_ranks,
        2,
        [str(tmp_path / "a")],
        str(tmp_path / "tok.model"),
        str(tmp_path / "blocker" / "cache"),
    )
    assert all(set(r["statuses"]) == {"memory"} for r in results)
    assert results[0]["train"] == results[1]["train"]
    assert any("cannot write" in w for w in results[0]["warnings"])
    assert any("building it in memory" in w for w in results[1]["warnings"])

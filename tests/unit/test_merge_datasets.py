import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_taco.cli import merge_datasets as merge_cli
from megatron_taco.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    data_file_path,
    index_file_path,
)

REPO = Path(__file__).resolve().parents[2]
VOCAB = 50


def _write(prefix, docs, dtype=np.uint16, counts=True):
    b = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
    unigram = np.zeros(VOCAB, dtype=np.int64)
    for doc in docs:
        for seq in doc:
            b.add_item(seq)
            unigram += np.bincount(seq, minlength=VOCAB)
        b.end_document()
    b.finalize(index_file_path(prefix))
    if counts:
        np.save(prefix + "_unigram.npy", unigram)
    return unigram


def _docs(seed, n):
    rng = np.random.default_rng(seed)
    return [
        [
            rng.integers(0, VOCAB, size=int(rng.integers(1, 20)))
            for _ in range(int(rng.integers(1, 4)))
        ]
        for _ in range(n)
    ]


@pytest.fixture
def three(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    parts = [_docs(k, n) for k, n in enumerate((3, 5, 2))]
    # names chosen so that sorted order differs from creation order
    names = ["b_part", "a_part", "c_part"]
    counts = [_write(str(src / name), docs) for name, docs in zip(names, parts)]
    return src, dict(zip(names, parts)), dict(zip(names, counts))


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}


def _flat(docs):
    return [s for d in docs for s in d]


def test_merge_directory_equals_concatenation(three, tmp_path):
    src, parts, counts = three
    out = str(tmp_path / "out" / "merged")
    assert merge_cli.main(["--input", str(src), "--output-prefix", out]) == 0
    ds = IndexedDataset(out)
    order = sorted(parts)  # a directory merges in sorted prefix order, like Megatron's tool
    expected = [d for name in order for d in parts[name]]
    assert len(ds) == len(_flat(expected))
    for i, seq in enumerate(_flat(expected)):
        np.testing.assert_array_equal(ds[i], seq)
    assert (
        ds.document_indices.tolist()
        == np.concatenate(([0], np.cumsum([len(d) for d in expected]))).tolist()
    )
    merged_counts = np.load(out + "_unigram.npy")
    assert merged_counts.dtype == np.int64
    np.testing.assert_array_equal(merged_counts, sum(counts.values()))
    np.testing.assert_array_equal(
        merged_counts, np.bincount(np.concatenate(_flat(expected)), minlength=VOCAB)
    )
    # no temporary file is left behind
    assert sorted(os.listdir(tmp_path / "out")) == [
        "merged.bin",
        "merged.idx",
        "merged_unigram.npy",
    ]


def test_merge_prefix_list_keeps_given_order(three, tmp_path):
    src, parts, _ = three
    order = ["c_part", "a_part"]
    out = str(tmp_path / "merged")
    merge_cli.main(["--input", *[str(src / n) for n in order], "--output-prefix", out])
    ds = IndexedDataset(out)
    expected = _flat([d for n in order for d in parts[n]])
    assert [ds[i].tolist() for i in range(len(ds))] == [s.tolist() for s in expected]


def test_shim_runs_from_repo_root(three, tmp_path):
    src, parts, _ = three
    out = str(tmp_path / "merged")
    proc = subprocess.run(
        [sys.executable, "tools/merge_datasets.py", "--input", str(src), "--output-prefix", out],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(IndexedDataset(out)) == sum(len(_flat(d)) for d in parts.values())


def _error(capsys, argv):
    with pytest.raises(SystemExit) as info:
        merge_cli.main(argv)
    assert info.value.code != 0
    return capsys.readouterr().err


def test_bad_inputs_are_named(three, tmp_path, capsys):
    src, _, _ = three
    out = str(tmp_path / "m")
    err = _error(capsys, ["--input", str(tmp_path / "nope"), "--output-prefix", out])
    assert "--input" in err and "nope.idx" in err

    err = _error(capsys, ["--input", str(src / "a_part.bin"), "--output-prefix", out])
    assert "without .bin/.idx" in err

    # mixed dtypes
    _write(str(tmp_path / "wide"), _docs(9, 2), dtype=np.int32)
    err = _error(
        capsys, ["--input", str(src / "a_part"), str(tmp_path / "wide"), "--output-prefix", out]
    )
    assert "do not share a token dtype" in err and "int32" in err

    # counts on some inputs only
    os.remove(src / "b_part_unigram.npy")
    err = _error(capsys, ["--input", str(src), "--output-prefix", out])
    assert "b_part_unigram.npy" in err and "some inputs have unigram counts" in err

    # counts of different vocabulary sizes
    np.save(src / "b_part_unigram.npy", np.zeros(VOCAB + 1, dtype=np.int64))
    err = _error(capsys, ["--input", str(src), "--output-prefix", out])
    assert "different vocabularies" in err

    err = _error(capsys, ["--input", str(src / "a_part"), "--output-prefix", str(src / "a_part")])
    assert "--output-prefix" in err and "also an input" in err
    assert not any(Path(tmp_path).glob("m*"))


def test_corrupt_input_leaves_nothing(three, tmp_path, capsys):
    src, _, _ = three
    with open(src / "b_part.bin", "ab") as f:
        f.write(b"\0\0")  # b_part is the second input in sorted order
    before = _snapshot(src)
    out_dir = tmp_path / "out"
    err = _error(capsys, ["--input", str(src), "--output-prefix", str(out_dir / "merged")])
    assert "b_part.bin" in err and "too long" in err
    assert _snapshot(src) == before
    assert not out_dir.exists() or list(out_dir.iterdir()) == []


def test_failure_mid_copy_is_atomic(three, tmp_path, monkeypatch):
    src, _, _ = three
    out = tmp_path / "merged"
    # An earlier good merge exists under the final name; a failed re-merge must keep it intact.
    merge_cli.main(["--input", str(src / "a_part"), "--output-prefix", str(out)])
    old = _snapshot(tmp_path)
    before = _snapshot(src)

    real_add_index = IndexedDatasetBuilder.add_index
    calls = []

    def add_index_then_fail(self, prefix):
        calls.append(prefix)
        if len(calls) == 2:
            # the real copy of the second input happens, then the disk "fills up"
            real_add_index(self, prefix)
            raise OSError(28, "No space left on device")
        real_add_index(self, prefix)

    monkeypatch.setattr(IndexedDatasetBuilder, "add_index", add_index_then_fail)
    with pytest.raises(OSError, match="No space left"):
        merge_cli.merge_datasets(merge_cli.MergeConfig(input=(str(src),), output_prefix=str(out)))
    assert len(calls) == 2
    assert _snapshot(src) == before
    assert _snapshot(tmp_path) == old  # no temp files, previous output untouched
    IndexedDataset(str(out))


def test_corrupt_index_detected_by_add_index(three, tmp_path):
    src, _, _ = three
    os.truncate(src / "c_part.idx", 40)
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match="c_part.idx"):
        b.add_index(str(src / "c_part"))

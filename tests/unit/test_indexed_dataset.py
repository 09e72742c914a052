import os
import pickle
import struct

import numpy as np
import pytest
import torch

from megatron_taco.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    best_dtype,
    data_file_path,
    index_file_path,
)


def _random_documents(rng, num_docs, vocab, max_sentences=5, max_len=40):
    # Include empty sequences and a document with no sequences: both are legal in Megatron files.
    docs = []
    for d in range(num_docs):
        n = 0 if d == 3 else int(rng.integers(1, max_sentences + 1))
        docs.append([rng.integers(0, vocab, size=int(rng.integers(0, max_len))) for _ in range(n)])
    return docs


def _write(prefix, docs, dtype):
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(seq)
        builder.end_document()
    builder.finalize(index_file_path(prefix))


def _assert_matches(ds, docs):
    flat = [s for doc in docs for s in doc]
    assert len(ds) == len(flat)
    np.testing.assert_array_equal(ds.sizes, [len(s) for s in flat])
    expected_docs = np.concatenate(([0], np.cumsum([len(d) for d in docs])))
    np.testing.assert_array_equal(ds.document_indices, expected_docs)
    for i, seq in enumerate(flat):
        got = ds[i]
        assert got.dtype == ds.dtype
        np.testing.assert_array_equal(got, seq)


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 65000), (np.int32, 200_000)])
def test_round_trip(tmp_path, dtype, vocab):
    docs = _random_documents(np.random.default_rng(0), 12, vocab)
    prefix = str(tmp_path / "ds")
    _write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert ds.sizes.dtype == np.int32 and ds.pointers.dtype == np.int64
    assert ds.document_indices.dtype == np.int64
    _assert_matches(ds, docs)
    itemsize = np.dtype(dtype).itemsize
    np.testing.assert_array_equal(
        ds.pointers, np.concatenate(([0], np.cumsum(ds.sizes[:-1].astype(np.int64) * itemsize)))
    )
    # zero copy: the sequence is a view of the mapped file, and read-only
    assert not ds[0].flags.writeable
    assert ds[-1].tolist() == [s for d in docs for s in d][-1].tolist()
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]


def test_inputs_list_tensor_and_add_document(tmp_path):
    prefix = str(tmp_path / "ds")
    b = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    b.add_item([1, 2, 3])
    b.add_item(torch.tensor([4, 5], dtype=torch.int64))
    b.end_document()
    b.add_document([[6], np.array([7, 8, 9])])
    b.add_document(torch.tensor([10, 11, 12, 13]), lengths=[1, 3])
    b.finalize(index_file_path(prefix))
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [
        [1, 2, 3],
        [4, 5],
        [6],
        [7, 8, 9],
        [10],
        [11, 12, 13],
    ]
    assert ds.document_indices.tolist() == [0, 2, 4, 6]
    assert ds.num_documents == 3
    assert [s.tolist() for s in ds[1:4]] == [[4, 5], [6], [7, 8, 9]]


def test_builder_rejects_bad_input(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="does not fit uint16"):
        b.add_item([1, 70000])
    with pytest.raises(ValueError, match="lengths sum to 3"):
        b.add_document([1, 2, 3, 4], lengths=[1, 2])
    b.add_item([1])
    with pytest.raises(IndexedDatasetError, match="after the last end_document"):
        b.finalize(str(tmp_path / "x.idx"))
    with pytest.raises(ValueError, match="cannot be stored"):
        IndexedDatasetBuilder(str(tmp_path / "y.bin"), dtype=np.uint32)


def test_get_with_offset_and_length(tmp_path):
    prefix = str(tmp_path / "ds")
    _write(prefix, [[np.arange(10)], [np.arange(100, 105)]], np.int32)
    ds = IndexedDataset(prefix)
    assert ds.get(0).tolist() == list(range(10))
    assert ds.get(0, offset=3).tolist() == list(range(3, 10))
    assert ds.get(0, offset=3, length=4).tolist() == [3, 4, 5, 6]
    assert ds.get(1, offset=5).tolist() == []
    assert ds.get(1, 1, 2).tolist() == [101, 102]
    with pytest.raises(IndexError, match="runs past the end"):
        ds.get(0, offset=8, length=3)  # would otherwise silently read sequence 1's tokens
    with pytest.raises(IndexError, match="offset 11"):
        ds.get(0, offset=11)


def test_best_dtype():
    assert best_dtype(32000) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(250_000) == np.int32


def test_pickle_reopens_by_path(tmp_path):
    prefix = str(tmp_path / "ds")
    docs = _random_documents(np.random.default_rng(1), 5, 1000)
    _write(prefix, docs, np.uint16)
    ds = IndexedDataset(prefix)
    blob = pickle.dumps(ds)
    assert len(blob) < 300  # only the path travels, not the mapped data
    clone = pickle.loads(blob)
    assert clone.path_prefix == prefix
    _assert_matches(clone, docs)


def test_add_index_merge(tmp_path):
    rng = np.random.default_rng(2)
    parts = [_random_documents(rng, n, 500) for n in (4, 1, 6)]
    prefixes = []
    for k, docs in enumerate(parts):
        prefixes.append(str(tmp_path / f"part{k}"))
        _write(prefixes[-1], docs, np.uint16)
    merged = str(tmp_path / "merged")
    b = IndexedDatasetBuilder(data_file_path(merged), dtype=np.uint16)
    for p in prefixes:
        b.add_index(p)
    b.finalize(index_file_path(merged))
    _assert_matches(IndexedDataset(merged), [d for docs in parts for d in docs])

    # merging equals writing the concatenation directly, byte for byte
    direct = str(tmp_path / "direct")
    _write(direct, [d for docs in parts for d in docs], np.uint16)
    for path_of in (data_file_path, index_file_path):
        with open(path_of(merged), "rb") as f1, open(path_of(direct), "rb") as f2:
            assert f1.read() == f2.read()

    wrong = IndexedDatasetBuilder(str(tmp_path / "w.bin"), dtype=np.int32)
    with pytest.raises(IndexedDatasetError, match="dtype uint16 differs"):
        wrong.add_index(prefixes[0])


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16).finalize(index_file_path(prefix))
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]


# ---- megatron-core interoperability -------------------------------------------------------


@pytest.fixture(scope="module")
def mcore():
    return pytest.importorskip("megatron.core.datasets.indexed_dataset")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_core_interop(tmp_path, mcore, dtype):
    docs = _random_documents(np.random.default_rng(3), 9, 30000)

    ours = str(tmp_path / "ours")
    _write(ours, docs, dtype)
    theirs_view = mcore.IndexedDataset(ours, mmap=True)
    np.testing.assert_array_equal(theirs_view.sequence_lengths, IndexedDataset(ours).sizes)
    np.testing.assert_array_equal(
        theirs_view.document_indices, np.concatenate(([0], np.cumsum([len(d) for d in docs])))
    )
    flat = [s for d in docs for s in d]
    assert len(theirs_view) == len(flat)
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(theirs_view[i], seq)

    theirs = str(tmp_path / "theirs")
    b = mcore.IndexedDatasetBuilder(theirs + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(torch.from_numpy(seq))
        b.end_document()
    b.finalize(theirs + ".idx")
    _assert_matches(IndexedDataset(theirs), docs)

    for path_of in (data_file_path, index_file_path):
        with open(path_of(ours), "rb") as f1, open(path_of(theirs), "rb") as f2:
            assert f1.read() == f2.read(), path_of(ours)


def test_megatron_core_reads_our_merge(tmp_path, mcore):
    rng = np.random.default_rng(4)
    parts = [_random_documents(rng, n, 100) for n in (3, 5)]
    prefixes = [str(tmp_path / f"p{k}") for k in range(2)]
    for p, docs in zip(prefixes, parts):
        _write(p, docs, np.uint16)
    ours, theirs = str(tmp_path / "m_ours"), str(tmp_path / "m_theirs")
    b = IndexedDatasetBuilder(ours + ".bin", dtype=np.uint16)
    t = mcore.IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)
    for p in prefixes:
        b.add_index(p)
        t.add_index(p)
    b.finalize(ours + ".idx")
    t.finalize(theirs + ".idx")
    for ext in (".bin", ".idx"):
        with open(ours + ext, "rb") as f1, open(theirs + ext, "rb") as f2:
            assert f1.read() == f2.read()


# ---- corruption -----------------------------------------------------------------------------


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    _write(prefix, [[np.arange(5), np.arange(3)], [np.arange(7)]], np.uint16)
    return prefix


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _corrupt_magic(p):
    _patch(index_file_path(p), 0, b"XXIDIDX")


def _corrupt_version(p):
    _patch(index_file_path(p), 9, struct.pack("<Q", 2))


def _corrupt_dtype(p):
    _patch(index_file_path(p), 17, struct.pack("<B", 42))


def _truncate_idx(p):
    os.truncate(index_file_path(p), os.path.getsize(index_file_path(p)) - 8)


def _truncate_idx_header(p):
    os.truncate(index_file_path(p), 20)


def _extra_idx_bytes(p):
    with open(index_file_path(p), "ab") as f:
        f.write(b"\0" * 8)


def _truncate_bin(p):
    os.truncate(data_file_path(p), os.path.getsize(data_file_path(p)) - 2)


def _extra_bin_bytes(p):
    with open(data_file_path(p), "ab") as f:
        f.write(b"\0\0")


def _bad_pointer(p):
    # second sequence pointer: header 34 + 3 sizes * 4 + 1 pointer * 8
    _patch(index_file_path(p), 34 + 12 + 8, struct.pack("<q", 4))


def _decreasing_docs(p):
    # document indices [0, 2, 3] -> [0, 4, 3]
    _patch(index_file_path(p), 34 + 12 + 24 + 8, struct.pack("<q", 4))


def _docs_wrong_end(p):
    # document indices [0, 2, 3] -> [0, 2, 2]
    _patch(index_file_path(p), 34 + 12 + 24 + 16, struct.pack("<q", 2))


def _missing_idx(p):
    os.remove(index_file_path(p))


def _missing_bin(p):
    os.remove(data_file_path(p))


@pytest.mark.parametrize(
    "corrupt,which,message",
    [
        (_corrupt_magic, "idx", "bad magic"),
        (_corrupt_version, "idx", "unsupported index version 2"),
        (_corrupt_dtype, "idx", "unknown dtype code 42"),
        (_truncate_idx, "idx", "truncated index"),
        (_truncate_idx_header, "idx", "truncated index"),
        (_extra_idx_bytes, "idx", "trailing bytes"),
        (_truncate_bin, "bin", "data file truncated"),
        (_extra_bin_bytes, "bin", "data file too long"),
        (_bad_pointer, "idx", "pointer of sequence 1"),
        (_decreasing_docs, "idx", "document index decreases"),
        (_docs_wrong_end, "idx", "document index ends at 2"),
        (_missing_idx, "idx", "index file not found"),
        (_missing_bin, "bin", "data file not found"),
    ],
)
def test_corruption_is_reported(good, corrupt, which, message):
    IndexedDataset(good)  # sanity: the file is fine before corruption
    corrupt(good)
    path = index_file_path(good) if which == "idx" else data_file_path(good)
    with pytest.raises(IndexedDatasetError, match=message) as info:
        IndexedDataset(good)
    assert str(info.value).startswith(path)

import pickle

import numpy as np
import pytest

from megatron_taco.data import blending
from megatron_taco.data.blending import (
    BlendedDataset,
    blend_indices,
    dataset_passes,
    parse_data_path,
    samples_per_dataset,
)
from megatron_taco.errors import ConfigError


def prefix_deviation(weights, dataset_index):
    w = np.asarray(weights) / np.sum(weights)
    n = np.arange(1, dataset_index.shape[0] + 1)
    return np.array([np.abs(np.cumsum(dataset_index == k) - w[k] * n).max() for k in range(len(w))])


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [0.01, 0.99], [1, 3]])
def test_two_datasets_every_prefix_within_half_a_sample(weights):
    d, s = blend_indices(weights, 5000)
    assert d.dtype == np.int16 and s.dtype == np.int64
    assert prefix_deviation(weights, d).max() <= 0.5 + 1e-9


@pytest.mark.parametrize(
    "weights", [[0.2, 0.3, 0.5], [0.6, 0.3, 0.1], [1, 1, 1], [0.05, 0.9, 0.05]]
)
def test_three_datasets_within_one_sample(weights):
    d, _ = blend_indices(weights, 6000)
    w = np.asarray(weights) / np.sum(weights)
    dev = prefix_deviation(weights, d)
    assert np.all(dev <= (1 + w) / 2 + 1e-9)  # the documented bound, K = 3
    assert dev.max() < 1


def test_many_datasets_bound_and_sample_order():
    rng = np.random.default_rng(0)
    w = rng.dirichlet(np.ones(8))
    d, s = blend_indices(w, 20000)
    assert np.all(prefix_deviation(w, d) <= (1 + 6 * w) / 2 + 1e-9)
    for k in range(8):
        # each dataset's samples are used in order, none skipped
        assert np.array_equal(s[d == k], np.arange(np.count_nonzero(d == k)))


def test_blocks_join_seamlessly(monkeypatch):
    full = blend_indices([0.25, 0.35, 0.4], 3000)
    monkeypatch.setattr(blending, "_BLOCK", 97)  # many small merges
    blocked = blend_indices([0.25, 0.35, 0.4], 3000)
    assert np.array_equal(full[0], blocked[0]) and np.array_equal(full[1], blocked[1])


def test_single_dataset_and_empty():
    d, s = blend_indices([2.0], 10)
    assert np.all(d == 0) and np.array_equal(s, np.arange(10))
    d, s = blend_indices([0.5, 0.5], 0)
    assert d.shape == s.shape == (0,)


@pytest.mark.parametrize("bad", [[], [0.5, 0.0], [-1, 2], [np.nan, 1]])
def test_bad_weights(bad):
    with pytest.raises(ValueError, match="weights"):
        blend_indices(bad, 10)


def test_samples_per_dataset_covers_the_stream():
    w = [0.3, 0.7]
    d, _ = blend_indices(w, 1000)
    counts = samples_per_dataset(w, 1000, d)
    assert counts == [302, 704]  # ceil(ceil(w * n) * 1.005), as Megatron
    assert all(c >= u for c, u in zip(counts, np.bincount(d)))


def test_parse_data_path():
    assert parse_data_path(["wiki"]) == (["wiki"], [1.0])
    prefixes, weights = parse_data_path(["3", "wiki", "1", "books"])
    assert prefixes == ["wiki", "books"] and weights == [0.75, 0.25]


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "no dataset"),
        (["0.3"], "weight without"),
        (["wiki", "books"], "weight before each"),
        (["0.3", "wiki", "books"], "weight before each"),
        (["0.3", "wiki", "books", "0.7"], "expected a weight"),
        (["0.3", "0.4", "0.7", "books"], "expected a dataset prefix"),
        (["0", "wiki", "1", "books"], "positive"),
        (["-1", "wiki", "1", "books"], "positive"),
        (["inf", "wiki", "1", "books"], "positive"),
    ],
)
def test_parse_data_path_errors(bad, match):
    with pytest.raises(ConfigError, match="--data-path.*" + match):
        parse_data_path(bad)


class Numbers:
    def __init__(self, tag, n):
        self.tag, self.n = tag, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert 0 <= i < self.n
        return {"tag": self.tag, "local": i, "index": i}


def test_blended_dataset(tmp_path):
    a, b = Numbers("a", 40), Numbers("b", 80)
    ds = BlendedDataset([a, b], [1, 2], 100)
    assert len(ds) == 100
    items = [ds[i] for i in range(100)]
    assert [x["index"] for x in items] == list(range(100))  # blended position, not local
    assert sum(x["tag"] == "a" for x in items) in (33, 34)
    assert [x["local"] for x in items if x["tag"] == "b"] == list(
        range(sum(x["tag"] == "b" for x in items))
    )
    with pytest.raises(IndexError):
        ds[100]
    with pytest.raises(ValueError, match="has 10 samples but the blend"):
        BlendedDataset([Numbers("a", 10), b], [1, 2], 100)
    # memory-mapped indices pickle as their files
    d, s = blend_indices([1, 2], 100)
    np.save(tmp_path / "d.npy", d)
    np.save(tmp_path / "s.npy", s)
    mapped = BlendedDataset(
        [a, b],
        [1, 2],
        100,
        dataset_index=np.load(tmp_path / "d.npy", mmap_mode="r"),
        dataset_sample_index=np.load(tmp_path / "s.npy", mmap_mode="r"),
    )
    blob = pickle.dumps(mapped)
    assert len(blob) < 1000
    again = pickle.loads(blob)
    assert isinstance(again.dataset_index, np.memmap)
    assert [again[i] for i in range(100)] == items


def test_dataset_passes_per_epoch():
    """An epoch of N = 1000 samples over datasets of 300 and 700 samples per pass: weights
    0.6 / 0.4 see the first 2.0 passes of one and 0.57 of the other; weights proportional
    to the sizes see each exactly once."""
    d, _ = blend_indices([0.6, 0.4], 1000)
    (a, pa), (b, pb) = dataset_passes(d, 1000, [300, 700])
    assert (a, b) == (600, 400) and pa == 2.0 and pb == pytest.approx(400 / 700)
    d, _ = blend_indices([0.3, 0.7], 1000)
    assert dataset_passes(d, 1000, [300, 700]) == [(300, 1.0), (700, 1.0)]
    assert dataset_passes(d, 990, [300, 700])[1][0] in (692, 693)  # a prefix of the blend
    assert dataset_passes(None, 96, [100]) == [(96, 0.96)]

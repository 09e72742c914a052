"""Stable instances and per-epoch permutations (data/epochs.py)."""

import numpy as np
import pytest

from megatron_taco.data.epochs import EpochPermutation, InstanceEpochDataset


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_every_epoch_is_a_permutation(n):
    perm = EpochPermutation(n, seed=11)
    for epoch in range(3):
        order = perm(epoch, np.arange(n))
        assert sorted(order.tolist()) == list(range(n))
    np.testing.assert_array_equal(perm(1, np.arange(n)), EpochPermutation(n, 11)(1, np.arange(n)))


def test_epochs_and_seeds_give_different_orders():
    n = 500
    a, b = EpochPermutation(n, 1)(0, np.arange(n)), EpochPermutation(n, 1)(1, np.arange(n))
    c = EpochPermutation(n, 2)(0, np.arange(n))
    assert (a != b).mean() > 0.9 and (a != c).mean() > 0.9
    # Roughly uniform: the position of instance 0 over many epochs spreads over [0, n).
    where = [
        int(np.flatnonzero(EpochPermutation(n, 1)(e, np.arange(n)) == 0)[0]) for e in range(200)
    ]
    assert np.mean(where) == pytest.approx(n / 2, rel=0.2)


def test_instance_stream_visits_every_instance_once_per_epoch():
    base = [{"tokens": i} for i in range(10)]
    ds = InstanceEpochDataset(base, num_instances=8, num_epochs=3, seed=5)
    assert len(ds) == 24
    for epoch in range(3):
        items = [ds[epoch * 8 + j] for j in range(8)]
        assert sorted(it["index"] for it in items) == list(range(8))
        assert all(it["epoch"] == epoch and it["tokens"] == it["index"] for it in items)
        assert [it["global_index"] for it in items] == list(range(epoch * 8, epoch * 8 + 8))
    with pytest.raises(IndexError):
        ds[24]
    with pytest.raises(ValueError):
        InstanceEpochDataset(base, num_instances=11, num_epochs=1, seed=0)

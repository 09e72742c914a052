"""Real epochs over a fixed set of instances (SAS's self-augmentation needs the same
instance x in every epoch).

Instances are numbered 0..N-1 once for the life of a run: the first N samples of the train
dataset (one pass of the BERT sample mapping over the train split, or over the blend of
several --data-path datasets). Epoch e visits all of them in its own seeded order, the
global sample stream being

    g = e * N + j   ->   instance pi_e(j),   pi_e a permutation of [0, N) seeded by (seed, e)

pi_e is a keyed Feistel permutation with cycle walking: computed per index in O(1) memory,
so no [N] permutation array is built per epoch and per DataLoader worker (25.6M instances
would be 200 MB each).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_MASK32 = np.uint64(0xFFFFFFFF)
_ROUNDS = 4


def _round_keys(seed: int, epoch: int) -> np.ndarray:
    ss = np.random.SeedSequence([int(seed), 0x5A5, int(epoch)])
    return ss.generate_state(_ROUNDS, dtype=np.uint64) & _MASK32


def _mix(x: np.ndarray, key: np.uint64, mask: np.uint64) -> np.ndarray:
    # A murmur3-style finaliser of (half-block + key): any bijective-enough mixing works here;
    # the Feistel structure makes the whole map a permutation regardless.
    h = (x + key) & _MASK32
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & _MASK32
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & _MASK32
    h ^= h >> np.uint64(16)
    return h & mask


class EpochPermutation:
    """pi_e(j) for j in [0, n): a bijection of [0, n) for every epoch e."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError(f"EpochPermutation needs n >= 1, got {n}")
        self.n, self.seed = int(n), int(seed)
        # Balanced Feistel on 2*half bits covers [0, 4^half) >= n; cycle walking maps the
        # values >= n back into range (expected < 4 extra rounds since 4^half < 4n).
        self.half = max(1, (int(n - 1).bit_length() + 1) // 2)
        self._cache: tuple[int, np.ndarray] | None = None

    def _keys(self, epoch: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, _round_keys(self.seed, epoch))
        return self._cache[1]

    def _feistel(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        bits = np.uint64(self.half)
        mask = np.uint64((1 << self.half) - 1)
        left, right = x >> bits, x & mask
        for key in keys:
            left, right = right, left ^ _mix(right, key, mask)
        return (left << bits) | right

    def __call__(self, epoch: int, j) -> np.ndarray:
        shape = np.shape(j)
        j = np.atleast_1d(np.asarray(j, dtype=np.int64)).ravel()
        if j.size and (j.min() < 0 or j.max() >= self.n):
            raise IndexError(f"index out of [0, {self.n})")
        keys = self._keys(epoch)
        x = self._feistel(j.astype(np.uint64), keys)
        out_of_range = x >= np.uint64(self.n)
        while out_of_range.any():
            x[out_of_range] = self._feistel(x[out_of_range], keys)
            out_of_range = x >= np.uint64(self.n)
        return x.astype(np.int64).reshape(shape)


class InstanceEpochDataset:
    """The global sample stream over ``num_instances`` fixed instances of ``base``: item g is
    instance pi_e(g mod N) of epoch e = g // N, with ``index`` set to the instance id (so
    per-instance randomness, e.g. SAS's replaced set, is the same in every epoch),
    ``epoch`` set to e and ``global_index`` to g (iteration g // global batch size)."""

    def __init__(self, base: Any, num_instances: int, num_epochs: int, seed: int) -> None:
        if not 1 <= num_instances <= len(base):
            raise ValueError(
                f"num_instances {num_instances} must be in [1, {len(base)}] (the base dataset)"
            )
        if num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
        self.base = base
        self.num_instances = int(num_instances)
        self.num_epochs = int(num_epochs)
        self.permutation = EpochPermutation(self.num_instances, seed)

    def __len__(self) -> int:
        return self.num_instances * self.num_epochs

    def instance_of(self, g: int) -> tuple[int, int]:
        """(epoch, instance id) of global sample ``g``."""
        if not 0 <= g < len(self):
            raise IndexError(f"sample {g} out of [0, {len(self)})")
        epoch, j = divmod(int(g), self.num_instances)
        return epoch, int(self.permutation(epoch, j))

    def __getitem__(self, g: int) -> dict[str, Any]:
        epoch, instance = self.instance_of(g)
        return {**self.base[instance], "index": instance, "epoch": epoch, "global_index": int(g)}

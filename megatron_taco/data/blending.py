"""Weighted blending of several datasets into one sample stream (``--data-path 0.3 a 0.7 b``).

:func:`blend_indices` decides, for every position of the blended stream, which dataset it
comes from and which of that dataset's samples it is, so that every prefix of the stream
holds each dataset in proportion to its weight.

Megatron's ``build_blending_indices`` is a sequential greedy (pick the dataset whose count
lags its share the most) that needs a compiled loop. This module instead merges the
datasets' samples by the *time* each one is due: dataset ``k``'s ``j``-th sample is due at
``(j + 1/2) / w_k`` (Sainte-Lague/Webster's divisors), and the stream is all samples sorted by
due time (ties: lower dataset first). That is a stable sort, vectorised, and has a proven
prefix bound: after any ``n`` samples, dataset ``k`` has ``c_k`` with

    |c_k - w_k * n| <= (1 + (K - 2) * w_k) / 2          (K datasets, weights summing to 1)

i.e. at most 1/2 for two datasets and below 1 for three; Megatron's greedy measures ~1
and ~1.5 on the same cases. (Proof: at the due time T of the n-th sample every dataset has
``w_k T - 1/2 <= c_k <= w_k T + 1/2``; subtract ``w_k`` times their sum.) The stream is not
Megatron's, so the indices are not interchangeable with its cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from megatron_taco.data.cache import array_from_state, array_state
from megatron_taco.data.indexed_dataset import check_index
from megatron_taco.errors import ConfigError

BLEND_INDEX_VERSION = 1  # part of the cache key; bump when the stream changes

# Megatron builds each dataset ceil(weight * size * (1 + 0.005)) samples, so small rounding
# differences between the blend and the per-dataset counts never run a dataset dry.
SIZE_SURPLUS = 0.005

# Samples merged per sort: bounds memory to a few times this many entries for any size.
_BLOCK = 1 << 21


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """``["wiki"]`` -> ``(["wiki"], [1.0])``; ``["0.3", "wiki", "0.7", "books"]`` -> weights
    normalised to sum to 1. Several prefixes need a weight each."""
    if isinstance(data_path, str):
        data_path = [data_path]
    items = [str(x) for x in data_path]
    if not items:
        raise ConfigError(
            "--data-path: no dataset given; expected PREFIX or W1 PREFIX1 W2 PREFIX2 ..."
        )
    if any(not x.strip() for x in items):
        raise ConfigError(f"--data-path: empty entry in {items!r}")

    def number(x: str) -> float | None:
        try:
            return float(x)
        except ValueError:
            return None

    if len(items) == 1:
        if number(items[0]) is not None:
            raise ConfigError(
                f"--data-path: {items[0]!r} looks like a weight without a dataset prefix after it"
            )
        return items, [1.0]
    if len(items) % 2 == 1 or number(items[0]) is None:
        raise ConfigError(
            f"--data-path: {items!r}: several datasets need a weight before each prefix, "
            "e.g. '--data-path 0.3 wiki_text_sentence 0.7 books_text_sentence'"
        )
    prefixes: list[str] = []
    weights: list[float] = []
    for i in range(0, len(items), 2):
        w, prefix = number(items[i]), items[i + 1]
        if w is None:
            raise ConfigError(
                f"--data-path: expected a weight at position {i + 1}, got {items[i]!r} "
                f"(entries alternate weight, prefix: {items!r})"
            )
        if number(prefix) is not None:
            raise ConfigError(
                f"--data-path: expected a dataset prefix after weight {items[i]!r}, got the "
                f"number {prefix!r}"
            )
        if not math.isfinite(w) or w <= 0:
            raise ConfigError(
                f"--data-path: the weight of {prefix!r} must be a positive number, got {items[i]!r}"
            )
        prefixes.append(prefix)
        weights.append(w)
    total = sum(weights)
    return prefixes, [w / total for w in weights]


def _check_weights(weights) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.shape[0] == 0:
        raise ValueError(f"weights must be a non-empty 1-D sequence, got {weights!r}")
    if w.shape[0] > np.iinfo(np.int16).max:
        raise ValueError(
            f"at most {np.iinfo(np.int16).max} datasets can be blended, got {w.shape[0]}"
        )
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"weights must be finite and > 0, got {weights!r}")
    return w / w.sum()


def blend_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index int16 [size], dataset_sample_index int64 [size])``: position ``i`` of
    the blended stream is sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``.
    Each dataset's samples are used in order 0, 1, 2, ..."""
    w = _check_weights(weights)
    if isinstance(size, bool) or int(size) != size or size < 0:
        raise ValueError(f"size must be an integer >= 0, got {size!r}")
    size = int(size)
    k = w.shape[0]
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    # Due times advance by 1 per sample on average (weights sum to 1), so a block of due
    # times [t0, t1) holds about t1 - t0 samples. The j ranges per block are computed with the
    # same formula at each boundary, so blocks partition every dataset's samples exactly.
    ids = np.arange(k, dtype=np.int16)
    done = 0
    t1 = 0.0
    j_lo = np.zeros(k, dtype=np.int64)
    while done < size:
        t1 += float(min(_BLOCK, size - done + k))
        # samples due before t1: (j + 1/2) / w < t1  <=>  j < w t1 - 1/2
        j_hi = np.maximum(np.ceil(w * t1 - 0.5), 0).astype(np.int64)
        counts = j_hi - j_lo
        j = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in zip(j_lo, j_hi)])
        d = np.repeat(ids, counts)
        due = (j + 0.5) / w[d]
        order = np.argsort(due, kind="stable")  # stable: ties go to the lower dataset id
        take = min(size - done, order.shape[0])
        dataset_index[done : done + take] = d[order[:take]]
        sample_index[done : done + take] = j[order[:take]]
        done += take
        j_lo = j_hi
    return dataset_index, sample_index


def samples_per_dataset(weights, size: int, dataset_index: np.ndarray | None = None) -> list[int]:
    """How many samples to build for each dataset so the blend of ``size`` never runs one dry:
    Megatron's ``ceil(ceil(w * size) * 1.005)``, and at least what the stream uses."""
    w = _check_weights(weights)
    want = [int(math.ceil(math.ceil(x * size) * (1 + SIZE_SURPLUS))) for x in w]
    if dataset_index is not None:
        used = np.bincount(np.asarray(dataset_index, dtype=np.int64), minlength=w.shape[0])
        want = [max(a, int(b)) for a, b in zip(want, used)]
    return want


class BlendedDataset:
    """``datasets`` interleaved by weight into ``size`` samples.

    A sample that is a dict with an ``"index"`` entry gets the blended position as its index,
    so per-sample randomness (masking) seeded from it differs between datasets.
    """

    def __init__(
        self,
        datasets: Sequence,
        weights,
        size: int,
        *,
        dataset_index: np.ndarray | None = None,
        dataset_sample_index: np.ndarray | None = None,
    ) -> None:
        if len(datasets) == 0:
            raise ValueError("BlendedDataset needs at least one dataset")
        w = _check_weights(weights)
        if w.shape[0] != len(datasets):
            raise ValueError(f"{len(datasets)} datasets but {w.shape[0]} weights")
        if (dataset_index is None) != (dataset_sample_index is None):
            raise ValueError("give both dataset_index and dataset_sample_index, or neither")
        if dataset_index is None:
            dataset_index, dataset_sample_index = blend_indices(w, size)
        if dataset_index.shape != (size,) or dataset_sample_index.shape != (size,):
            raise ValueError(
                f"blending indices have shapes {dataset_index.shape} and "
                f"{dataset_sample_index.shape}, expected ({size},)"
            )
        self.datasets = list(datasets)
        self.weights = w
        self.size = int(size)
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index
        if size:
            # Each dataset's samples are used in order 0, 1, 2, ... (as blend_indices makes
            # them), so a dataset needs as many samples as it appears; bincount is the cheap
            # way to know that for 10^8 positions.
            needed = np.bincount(dataset_index.astype(np.int64), minlength=len(datasets))
            if needed.shape[0] > len(datasets):
                raise ValueError(f"dataset_index refers to dataset {needed.shape[0] - 1}")
            for i, (ds, n) in enumerate(zip(self.datasets, needed)):
                if len(ds) < n:
                    raise ValueError(
                        f"blended dataset {i} ({getattr(ds, 'name', type(ds).__name__)}) has "
                        f"{len(ds)} samples but the blend of {size} uses {int(n)}"
                    )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        i = check_index(idx, self.size, "blended sample")
        sample = self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
        if isinstance(sample, dict) and "index" in sample:
            sample["index"] = i
        return sample

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["dataset_index"] = array_state(self.dataset_index)
        state["dataset_sample_index"] = array_state(self.dataset_sample_index)
        return state

    def __setstate__(self, state: dict) -> None:
        state["dataset_index"] = array_from_state(state["dataset_index"])
        state["dataset_sample_index"] = array_from_state(state["dataset_sample_index"])
        self.__dict__.update(state)


def dataset_passes(
    dataset_index: np.ndarray | None, num_samples: int, per_pass: Sequence[int]
) -> list[tuple[int, float]]:
    """(samples, passes) of each dataset in the first ``num_samples`` samples of a blend:
    how many of its samples it contributes and how many passes over its ``per_pass`` samples
    that is. Each dataset's samples are used in order and its sample index concatenates
    separately shuffled passes (samples.py), so 2.4 passes are two whole passes and 40% of a
    third, and 0.6 passes leave 40% of it unused. ``dataset_index`` None: one dataset."""
    if dataset_index is None:
        counts = [int(num_samples)]
    else:
        used = np.asarray(dataset_index[:num_samples], dtype=np.int64)
        counts = np.bincount(used, minlength=len(per_pass)).tolist()
    return [(int(c), c / n if n else float("inf")) for c, n in zip(counts, per_pass)]

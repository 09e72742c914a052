"""Batch sampler over the pretraining sample stream (Megatron's MegatronPretrainingSampler).

The global stream is ``consumed_samples, consumed_samples + 1, ..., total_samples - 1``. It
is cut into chunks of ``micro_batch_size * data_parallel_size``; data-parallel rank ``r``
gets slice ``[r * micro_batch_size, (r + 1) * micro_batch_size)`` of every chunk. Because the
stream depends only on ``consumed_samples``, a run resumed from a checkpoint that consumed
``k`` samples continues exactly where the interrupted one stopped, whatever the global
batch size was split into.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator


def _int(name: str, value, minimum: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # int and numpy integers, not floats
    except TypeError:
        raise TypeError(f"PretrainingSampler: {name} must be an int, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"PretrainingSampler: {name} must be >= {minimum}, got {value}")
    return value


class PretrainingSampler:
    """Yields this data-parallel rank's micro-batches as lists of dataset indices.

    With ``drop_last=False`` the final, incomplete chunk is also split by rank; ranks whose
    slice of it is empty get an empty list, so every rank yields the same number of batches
    and stays in step with the others' collectives.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        self.total_samples = _int("total_samples", total_samples, 1)
        self.consumed_samples = _int("consumed_samples", consumed_samples, 0)
        self.micro_batch_size = _int("micro_batch_size", micro_batch_size, 1)
        self.data_parallel_size = _int("data_parallel_size", data_parallel_size, 1)
        self.data_parallel_rank = _int("data_parallel_rank", data_parallel_rank, 0)
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(
                f"PretrainingSampler: data_parallel_rank {data_parallel_rank} must be < "
                f"data_parallel_size {data_parallel_size}"
            )
        if self.consumed_samples >= self.total_samples:
            raise ValueError(
                f"PretrainingSampler: no samples left: consumed_samples {consumed_samples} >= "
                f"total_samples {total_samples} (the dataset is exhausted; train on more "
                "samples or fewer iterations)"
            )
        self.drop_last = bool(drop_last)
        self._chunk = self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self._chunk)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        offset = self.data_parallel_rank * self.micro_batch_size
        chunk_start = self.consumed_samples
        while chunk_start + self._chunk <= self.total_samples:
            first = chunk_start + offset
            yield list(range(first, first + self.micro_batch_size))
            chunk_start += self._chunk
        if not self.drop_last and chunk_start < self.total_samples:
            first = min(chunk_start + offset, self.total_samples)
            yield list(range(first, min(first + self.micro_batch_size, self.total_samples)))

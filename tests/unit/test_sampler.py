import itertools

import numpy as np
import pytest

from megatron_taco.data.sampler import PretrainingSampler


def batches(total, consumed, mbs, dp, drop_last=True):
    return [list(PretrainingSampler(total, consumed, mbs, r, dp, drop_last)) for r in range(dp)]


@pytest.mark.parametrize("mbs, dp", [(1, 1), (4, 1), (2, 3), (3, 4)])
def test_union_over_ranks_is_the_global_stream(mbs, dp):
    total = 100
    per_rank = batches(total, 0, mbs, dp)
    assert len({len(b) for b in per_rank}) == 1  # ranks stay in step
    stream = []
    for step in zip(*per_rank):
        assert all(len(b) == mbs for b in step)
        stream += list(itertools.chain(*step))  # rank 0's slice, then rank 1's, ...
    chunk = mbs * dp
    assert stream == list(range(total // chunk * chunk))
    assert len(PretrainingSampler(total, 0, mbs, 0, dp)) == total // chunk


@pytest.mark.parametrize("consumed", [0, 6, 12, 30, 42])
def test_resume_is_the_continuation(consumed):
    mbs, dp, total = 3, 2, 61
    full = batches(total, 0, mbs, dp)
    resumed = batches(total, consumed, mbs, dp)
    skipped = consumed // (mbs * dp)
    for r in range(dp):
        assert resumed[r] == full[r][skipped:]


def test_resume_mid_chunk_continues_the_flat_stream():
    # a checkpoint taken with another global batch split still resumes the same stream
    flat = list(itertools.chain(*itertools.chain(*zip(*batches(50, 0, 1, 1)))))
    resumed = list(itertools.chain(*itertools.chain(*zip(*batches(50, 7, 2, 2)))))
    assert resumed == flat[7 : 7 + len(resumed)]


def test_keep_last_partial_chunk():
    per_rank = batches(10, 0, 2, 2, drop_last=False)
    assert per_rank[0] == [[0, 1], [4, 5], [8, 9]]
    assert per_rank[1] == [[2, 3], [6, 7], []]
    assert len(PretrainingSampler(10, 0, 2, 1, 2, drop_last=False)) == 3


def test_numpy_ints_accepted():
    s = PretrainingSampler(np.int64(8), np.int64(0), np.int32(2), 0, 2)
    assert list(s) == [[0, 1], [4, 5]]


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((0, 0, 1, 0, 1), ValueError, "total_samples"),
        ((10, 10, 1, 0, 1), ValueError, "no samples left"),
        ((10, -1, 1, 0, 1), ValueError, "consumed_samples"),
        ((10, 0, 0, 0, 1), ValueError, "micro_batch_size"),
        ((10, 0, 1, 2, 2), ValueError, "data_parallel_rank"),
        ((10, 0, 1, 0, 0), ValueError, "data_parallel_size"),
        ((10.0, 0, 1, 0, 1), TypeError, "total_samples"),
        ((10, 0, True, 0, 1), TypeError, "micro_batch_size"),
    ],
)
def test_bad_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        PretrainingSampler(*args)

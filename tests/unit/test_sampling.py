"""megatron_taco.parallel.sampling in one process (tp=1, group None).

Statistical tests use fixed seeds, so they are deterministic; the thresholds (p > 1e-4 for the
real thing, p < 1e-12 for deliberately broken variants under the same statistic) show that
each statistic has the power to catch the bug it is there for."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_taco.parallel.sampling import (
    _fmix32,
    counter_uniform,
    sample_row_keys,
    vocab_parallel_sample,
)

PASS_P = 1e-4  # a correct implementation fails this once in 10^4 seeds
FAIL_P = 1e-12  # a broken variant must miss by a wide margin, not by luck


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """Goodness of fit of category counts [K] to probabilities [K]. Categories expected fewer
    than ``min_expected`` times are pooled; zero-probability ones must be empty and are
    dropped. Upper-tail p-value of the chi-square statistic (regularised gamma)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "a zero-probability category was drawn"
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs / probs.sum() * counts.sum()
    small = expected < min_expected
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().reshape(1)])
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((counts.numel() - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, stat / 2).item()


def _uniform_bins_pvalue(u: torch.Tensor, bins: int) -> float:
    counts = torch.bincount((u.double().flatten() * bins).long(), minlength=bins)
    return chi_square_pvalue(counts, torch.full((bins,), 1.0 / bins))


def _pairs_pvalue(a: torch.Tensor, b: torch.Tensor, bins: int = 16) -> float:
    """Independence (and uniformity) of paired uniforms: chi-square over a bins x bins grid."""
    cell = (a.double() * bins).long() * bins + (b.double() * bins).long()
    counts = torch.bincount(cell.flatten(), minlength=bins * bins)
    return chi_square_pvalue(counts, torch.full((bins * bins,), 1.0 / bins**2))


# ---------------------------------------------------------------- counter_uniform


def _fmix32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_fmix32_matches_unbounded_integer_reference():
    # Python ints never overflow: equality shows the int64 tensor path never wraps.
    g = torch.Generator().manual_seed(0)
    words = torch.cat(
        [
            torch.randint(0, 2**32, (20000,), generator=g, dtype=torch.int64),
            torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1]),
        ]
    )
    assert torch.equal(_fmix32(words), torch.tensor([_fmix32_reference(int(w)) for w in words]))
    assert _fmix32(0xDEADBEEF) == _fmix32_reference(0xDEADBEEF)  # Python ints work too


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 24), (torch.float64, 53)])
def test_counter_uniform_strictly_inside_unit_interval_on_an_exact_grid(dtype, bits):
    extreme = torch.tensor([0, -1, 2**63 - 1, -(2**63), 2**32, 2**32 - 1], dtype=torch.int64)
    keys = torch.cat([extreme, torch.arange(2000)])
    columns = torch.tensor([0, 1, 2**31, 2**32 - 1] + list(range(500)), dtype=torch.int64)
    u = counter_uniform(keys, columns, seed=3, dtype=dtype)
    assert u.dtype == dtype and u.shape == (keys.numel(), columns.numel())
    assert (u > 0).all() and (u < 1).all()
    # Odd multiples of 2^-bits: exactly representable, symmetric about 1/2, never 0 or 1.
    scaled = u.double() * 2.0**bits
    assert torch.equal(scaled, scaled.round()) and (scaled.long() % 2 == 1).all()
    assert u.min() < 1e-3 and u.max() > 1 - 1e-3


def test_counter_uniform_float32_and_float64_share_their_leading_bits():
    keys, columns = torch.arange(300), torch.arange(200)
    u32 = counter_uniform(keys, columns, seed=1, dtype=torch.float32)
    u64 = counter_uniform(keys, columns, seed=1, dtype=torch.float64)
    assert (u32.double() - u64).abs().max() <= 2.0**-24


def test_counter_uniform_is_deterministic_and_depends_on_every_input():
    keys = torch.arange(-200, 200, dtype=torch.int64) * 7919
    columns = torch.arange(300)
    base = counter_uniform(keys, columns, seed=5)
    assert torch.equal(base, counter_uniform(keys.clone(), columns.clone(), seed=5))

    def differs(u):  # an unrelated draw matches at ~2^-23 of the entries, not at most of them
        return (u != base).float().mean().item() > 0.999

    assert differs(counter_uniform(keys, columns, seed=6))
    assert differs(counter_uniform(keys, columns, seed=5 + 2**32))  # high word of the seed
    assert differs(counter_uniform(keys + 1, columns, seed=5))
    assert differs(counter_uniform(keys + 2**32, columns, seed=5))  # high word of the key
    assert differs(counter_uniform(keys, columns + 300, seed=5))
    assert differs(counter_uniform(keys, columns + 2**31, seed=5))


def test_counter_uniform_is_independent_of_layout():
    # The whole point: the value for (key, column) is the same however rows and columns are
    # sliced, permuted or shaped (this is what makes tp=1 and tp=2 draw the same tokens).
    keys, columns = torch.arange(64) * 31 + 9, torch.arange(512)
    full = counter_uniform(keys, columns, seed=11)
    shard = counter_uniform(keys[10:20], columns[256:], seed=11)
    assert torch.equal(shard, full[10:20, 256:])
    perm_k, perm_c = torch.randperm(64), torch.randperm(512)
    assert torch.equal(counter_uniform(keys[perm_k], columns[perm_c], 11), full[perm_k][:, perm_c])
    per_row = columns.expand(64, 512).flip(-1).contiguous()  # [N, C] columns
    assert torch.equal(counter_uniform(keys, per_row, 11), full.flip(-1))
    assert torch.equal(
        counter_uniform(keys, columns, 11, dtype=torch.float64)[3:5, 7:9],
        counter_uniform(keys[3:5], columns[7:9], 11, dtype=torch.float64),
    )


def test_counter_uniform_marginal_is_uniform_and_a_column_blind_hash_fails():
    keys, columns = torch.arange(400), torch.arange(1000)
    u = counter_uniform(keys, columns, seed=0)
    assert _uniform_bins_pvalue(u, 256) > PASS_P
    assert (
        _uniform_bins_pvalue(counter_uniform(keys, columns, 0, dtype=torch.float64), 256) > PASS_P
    )
    # Broken: the hash ignores the column. Each row is then one value repeated 1000 times;
    # the pooled histogram is still uniform on average but 1000x too noisy, which the same
    # statistic flags.
    blind = counter_uniform(keys, torch.zeros(1, dtype=torch.int64), seed=0).expand(-1, 1000)
    assert _uniform_bins_pvalue(blind, 256) < FAIL_P


def test_counter_uniform_neighbours_are_independent_and_an_unmixed_counter_fails():
    keys, columns = torch.arange(500), torch.arange(400)
    u = counter_uniform(keys, columns, seed=2)
    assert _pairs_pvalue(u[:, :-1], u[:, 1:]) > PASS_P  # adjacent columns (adjacent vocab ids)
    assert _pairs_pvalue(u[:-1], u[1:]) > PASS_P  # adjacent rows (adjacent positions)
    # Broken: a Weyl sequence frac((key * C + column) * golden ratio) has a perfectly uniform
    # marginal but neighbours on a lattice; the pair statistic rejects it.
    counter = (keys.unsqueeze(-1) * 400 + columns).double()
    weyl = torch.frac(counter * 0.6180339887498949)
    assert _uniform_bins_pvalue(weyl, 256) > PASS_P
    assert _pairs_pvalue(weyl[:, :-1], weyl[:, 1:]) < FAIL_P


def test_counter_uniform_rejects_bad_arguments():
    with pytest.raises(TypeError):
        counter_uniform(torch.arange(3).int(), torch.arange(4), 0)
    with pytest.raises(ValueError):
        counter_uniform(torch.arange(3), torch.arange(4), 0, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        counter_uniform(torch.arange(3).reshape(3, 1), torch.arange(4), 0)


# ---------------------------------------------------------------- vocab_parallel_sample, tp=1

VOCAB = 50
ROWS = 100_000


def _skewed_logits(dtype=torch.float32) -> torch.Tensor:
    # Zipf-like: p_j ∝ (j+1)^-1.2 in shuffled order, so the mass is uneven and not monotone.
    ranks = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4)) + 1
    return (-1.2 * ranks.double().log()).to(dtype)  # [V]


def _draw_counts(logits_row, temperature, sampler=vocab_parallel_sample, **kwargs):
    """Draw ROWS samples from the same logits (different keys) -> counts [V]."""
    logits = logits_row.expand(ROWS, -1)
    ids = sampler(
        logits,
        None,
        vocab_size=VOCAB,
        row_keys=torch.arange(ROWS),
        seed=123,
        temperature=temperature,
        **kwargs,
    )
    return torch.bincount(ids, minlength=VOCAB)


def _softmax(logits_row, temperature):
    return torch.softmax(logits_row.double() / temperature, dim=-1)


@pytest.mark.parametrize(
    "dtype,temperature",
    [(torch.float32, 1.0), (torch.float32, 0.5), (torch.float64, 1.0), (torch.bfloat16, 1.0)],
)
def test_sample_follows_tempered_softmax(dtype, temperature):
    logits = _skewed_logits(dtype)
    counts = _draw_counts(logits, temperature)
    assert chi_square_pvalue(counts, _softmax(logits, temperature)) > PASS_P


def test_sample_mutations_fail_the_same_statistic():
    logits = _skewed_logits()
    expected = _softmax(logits, 0.5)
    # Temperature ignored: draws from softmax(logits) instead of softmax(logits / 0.5).
    assert chi_square_pvalue(_draw_counts(logits, 1.0), expected) < FAIL_P

    # Inverse CDF of the wrong weights (linear in the logits instead of exponential).
    def linear_weights_sampler(logits, group, *, vocab_size, row_keys, seed, temperature):
        u = counter_uniform(row_keys, torch.zeros(1, dtype=torch.long), seed).squeeze(1)
        weights = (logits / temperature - logits.min(-1, keepdim=True).values).double()
        cum = weights.cumsum(-1)
        picked = torch.searchsorted(cum, (u.double() * cum[:, -1])[:, None]).squeeze(1)
        return picked.clamp(max=logits.shape[-1] - 1)

    counts = _draw_counts(logits, 0.5, sampler=linear_weights_sampler)
    assert chi_square_pvalue(counts, expected) < FAIL_P


def test_float32_weights_draw_what_float64_weights_draw():
    """The same uniforms through float32 and float64 weights (float32 and float64 logits of the
    same values): a row differs only when u falls within float32's rounding (~1e-7) of a CDF
    boundary, so almost never (0 of 10^5 measured); the draws are then as exact as float64's.
    The statistic has power: logits rounded to bfloat16 (2^-8 relative) move 2.4% of them."""
    logits = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)) * 3).expand(ROWS, -1)
    kwargs = dict(vocab_size=VOCAB, row_keys=torch.arange(ROWS), seed=11, temperature=0.8)
    ids32 = vocab_parallel_sample(logits.contiguous(), None, **kwargs)
    ids64 = vocab_parallel_sample(logits.double(), None, **kwargs)
    assert (ids32 != ids64).sum().item() <= 5
    coarse = vocab_parallel_sample(logits.bfloat16().double(), None, **kwargs)
    assert (coarse != ids64).sum().item() > 1000


class FloatCumsum(TorchDispatchMode):
    """Records cumulative sums over floating-point tensors: CUDA refuses them (RuntimeError)
    under torch.use_deterministic_algorithms(True), i.e. with --deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cumsum = func.overloadpacket in (torch.ops.aten.cumsum, torch.ops.aten.cumsum_)
        if cumsum and out.is_floating_point():
            self.found.append(out.dtype)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sampler_has_no_floating_point_cumsum(dtype):
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(0)).to(dtype)
    with FloatCumsum() as recorder:
        vocab_parallel_sample(logits, None, vocab_size=37, row_keys=torch.arange(64), seed=1)
    assert recorder.found == []
    with FloatCumsum() as recorder:  # the recorder sees one
        logits.float().cumsum(-1)
    assert recorder.found == [torch.float32]


def test_excluded_and_padding_columns_are_never_drawn():
    padded, exclude = 64, torch.tensor([0, 7, 49])
    logits = torch.zeros(20_000, padded)
    logits[:, exclude] = 30.0  # would win almost every draw if allowed
    logits[:, VOCAB:] = 30.0  # padding
    ids = vocab_parallel_sample(
        logits,
        None,
        vocab_size=VOCAB,
        row_keys=torch.arange(20_000),
        seed=0,
        exclude_ids=exclude,
    )
    assert ids.min() >= 0 and ids.max() < VOCAB
    assert not torch.isin(ids, exclude).any()
    # The rest stays uniform over the 47 allowed ids.
    probs = torch.ones(VOCAB)
    probs[exclude] = 0
    assert chi_square_pvalue(torch.bincount(ids, minlength=VOCAB), probs) > PASS_P


def test_row_with_nothing_drawable_gets_minus_one():
    logits = torch.randn(3, 8)
    logits[1] = float("-inf")
    ids = vocab_parallel_sample(
        logits,
        None,
        vocab_size=6,
        row_keys=torch.arange(3),
        seed=0,
        exclude_ids=torch.tensor([0, 1, 2]),
    )
    assert ids[1] == -1 and 3 <= ids[0] < 6 and 3 <= ids[2] < 6
    all_out = vocab_parallel_sample(
        logits,
        None,
        vocab_size=6,
        row_keys=torch.arange(3),
        seed=0,
        exclude_ids=torch.arange(6),
    )
    assert torch.equal(all_out, torch.full((3,), -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_extreme_logits_and_temperatures_still_draw(dtype):
    """What float32 weights must survive: logit / T beyond float32's range (a tiny T draws the
    argmax, as float64 does), +inf logits (they take the row's mass), NaN logits (never drawn,
    the rest of the row still is). Each of these drew nothing (-1) before."""
    rows, kwargs = 4000, dict(vocab_size=6, row_keys=torch.arange(4000), seed=2)
    logits = torch.tensor([1.0, 40.0, 39.0, -3.0, 0.0, 2.0]).to(dtype).expand(rows, -1)
    greedy = vocab_parallel_sample(logits, None, temperature=1e-37, **kwargs)
    assert torch.equal(greedy, torch.full((rows,), 1))
    inf = logits.clone()
    inf[:, [2, 4]] = float("inf")
    drawn = vocab_parallel_sample(inf, None, **kwargs)
    assert set(drawn.tolist()) == {2, 4} and 0.45 < (drawn == 2).double().mean() < 0.55
    nan = torch.tensor([0.0, float("nan"), 0.0, 0.0, float("nan"), 0.0]).to(dtype)
    counts = torch.bincount(
        vocab_parallel_sample(nan.expand(rows, -1), None, **kwargs), minlength=6
    )
    assert chi_square_pvalue(counts, torch.tensor([1.0, 0, 1, 1, 0, 1]) / 4) > PASS_P
    for temperature in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            vocab_parallel_sample(logits, None, temperature=temperature, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sample_output_dtype_shape_and_determinism(dtype):
    logits = torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(0)).to(dtype)
    keys = sample_row_keys(torch.tensor([3, 9]), torch.arange(5).expand(2, 5), epoch=1)
    ids = vocab_parallel_sample(logits, None, vocab_size=37, row_keys=keys, seed=7)
    assert ids.dtype == torch.int64 and ids.shape == (2, 5) and ids.device == logits.device
    assert ids.min() >= 0 and ids.max() < 37
    again = vocab_parallel_sample(logits.clone(), None, vocab_size=37, row_keys=keys, seed=7)
    assert torch.equal(ids, again)
    other_seed = vocab_parallel_sample(logits, None, vocab_size=37, row_keys=keys, seed=8)
    assert not torch.equal(ids, other_seed)


def test_sample_is_independent_of_chunking_row_order_and_padding():
    g = torch.Generator().manual_seed(1)
    logits, keys = torch.randn(300, 128, generator=g) * 2, torch.arange(300) * 13
    kwargs = dict(vocab_size=100, seed=3, temperature=0.7, exclude_ids=torch.tensor([5]))
    ids = vocab_parallel_sample(logits, None, row_keys=keys, **kwargs)
    for chunk in (1, 128 * 7, 1 << 30):
        assert torch.equal(
            vocab_parallel_sample(logits, None, row_keys=keys, chunk_elements=chunk, **kwargs), ids
        )
    perm = torch.randperm(300, generator=g)
    assert torch.equal(
        vocab_parallel_sample(logits[perm], None, row_keys=keys[perm], **kwargs), ids[perm]
    )
    # Padding width does not matter: the unpadded logits draw the same ids.
    unpadded = vocab_parallel_sample(logits[:, :100].contiguous(), None, row_keys=keys, **kwargs)
    assert torch.equal(unpadded, ids)


def test_sample_rejects_bad_arguments():
    logits, keys = torch.randn(4, 10), torch.arange(4)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_sample(logits, None, vocab_size=10, row_keys=keys, seed=0, temperature=0)
    with pytest.raises(ValueError, match="row_keys"):
        vocab_parallel_sample(logits, None, vocab_size=10, row_keys=keys[:3], seed=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_match_cpu_bit_for_bit():
    keys, columns = torch.arange(-500, 500) * 104729, torch.arange(3000)
    for dtype in (torch.float32, torch.float64):
        cpu = counter_uniform(keys, columns, 9, dtype=dtype)
        gpu = counter_uniform(keys.cuda(), columns.cuda(), 9, dtype=dtype)
        assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
    logits = torch.randn(1000, 3000, dtype=torch.float64)
    kwargs = dict(vocab_size=2900, row_keys=keys, seed=9, exclude_ids=torch.tensor([1, 2]))
    ids = vocab_parallel_sample(logits.cuda(), None, **kwargs)
    assert ids.is_cuda and ids.dtype == torch.int64
    assert torch.equal(ids.cpu(), vocab_parallel_sample(logits, None, **kwargs))


# ---------------------------------------------------------------- sample_row_keys


def test_row_keys_are_distinct_non_negative_and_depend_on_every_input():
    instances, positions = torch.arange(50) * 1_000_003, torch.arange(512).expand(50, 512)
    keys = sample_row_keys(instances, positions, epoch=0)
    assert keys.dtype == torch.int64 and keys.shape == (50, 512) and (keys >= 0).all()
    assert keys.unique().numel() == keys.numel()
    assert torch.equal(keys, sample_row_keys(instances.clone(), positions.clone(), 0))
    # Flat form: one instance id per position gives the same keys.
    flat = sample_row_keys(instances.repeat_interleave(512), positions.reshape(-1), 0)
    assert torch.equal(flat, keys.reshape(-1))
    for other in (
        sample_row_keys(instances, positions, epoch=1),
        sample_row_keys(instances + 1, positions, epoch=0),
        sample_row_keys(instances + 2**32, positions, epoch=0),
        sample_row_keys(instances, positions + 512, epoch=0),  # disjoint positions
    ):
        assert not torch.isin(other, keys).any()
    # Only the (instance, position, epoch) triple matters, not where it sits in the batch.
    assert torch.equal(sample_row_keys(instances[7:9], positions[7:9, 100:], 0), keys[7:9, 100:])

"""Exact sampling from softmax(logits / T) over a vocabulary split across TP ranks.

SAS self-augmentation replaces masked tokens with draws from the model's own MLM head. The
vocabulary is split like VocabParallelEmbedding (rank r holds global columns [r*Vp, (r+1)*Vp),
columns >= vocab_size are padding), and nothing of size [N, padded_vocab] is ever gathered.

Inverse CDF over the shards, in integers: each column's weight exp((logit - global max) / T) in
(0, 1] is scaled to an integer, w = round(w * 2^K) with K chosen from the vocabulary size so
that a row's total stays below 2^62. Each rank sums its shard's weights; the per-shard sums are
all-gathered ([tp, N], small), every rank finds which shard holds u's column, and only that
shard searches its own cumulative sum. Integer sums are associative, so they are exact and
deterministic on every device (CUDA's floating-point cumsum is refused under
torch.use_deterministic_algorithms, which --deterministic turns on). The draw has the law
w / sum(w): softmax(logits / T) over the allowed columns up to the rounding of each weight
(2^-K absolute, K >= 44 for vocabularies up to 2^18) and of exp. (Gumbel-max would need one
random number per vocabulary entry: ~10x the cost of the exp + cumsum on CPU.)

The exp runs in float32 for float32, bfloat16 and float16 logits (float64 for float64 ones):
its relative error, ~1e-7 per weight, moves a draw only when u falls within that of a CDF
boundary (tests/unit/test_sampling.py measures it against float64), while float64 arithmetic
runs at a fraction of float32's rate on most GPUs.

The uniform is counter-based: u for (row key, seed) is a pure function of those integers, so
the draws do not depend on the TP size, the row chunking or the device layout (up to exp's
last-bit rounding on another device), and a resumed run redraws them exactly.
"""

from __future__ import annotations

import math

import torch

from megatron_taco.parallel import comm
from megatron_taco.parallel.mappings import group_rank, group_size

_M32 = 0xFFFFFFFF
# Distinct starting states for the independent 32-bit hash lanes (digits of pi).
_LANE_INIT = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
_COLUMN_INIT = 0xA4093822
_ROW_KEY_INIT = (0x299F31D0, 0x082EFA98)


# Integer hashing on int64 tensors (or Python ints). Every value is kept in [0, 2^32) and every
# product below 2^63, so nothing relies on signed-overflow wrap-around and CPU and CUDA agree.


def _mul32(x, c: int):
    """(x * c) mod 2^32 for 0 <= x < 2^32 and any 32-bit constant c."""
    y = x * (c & 0x7FFFFFFF)  # < 2^32 * 2^31 = 2^63
    if c >> 31:
        # x * 2^31 mod 2^32 keeps only x's lowest bit; y + 2^31 still stays below 2^63.
        y = y + ((x & 1) << 31)
    return y & _M32


def _fmix32(x):
    # murmur3's finaliser: a bijection of 32-bit words in which every input bit flips every
    # output bit with probability ~1/2.
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _absorb(h, x):
    """Fold both 32-bit words of the int64 ``x`` (two's complement) into the 32-bit state h."""
    h = _fmix32((x & _M32) ^ h)
    return _fmix32(((x >> 32) & _M32) ^ h)


def _stream(row_lane_a, row_lane_b, column_hash):
    # For a fixed row this is a bijection of the column hash, so a row's columns never share a
    # value; two 32-bit row lanes make rows with identical noise a ~2^-64 event.
    return _fmix32(_fmix32(column_hash ^ row_lane_a) ^ row_lane_b)


def counter_uniform(
    keys: torch.Tensor, columns: torch.Tensor, seed: int, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Stateless uniforms strictly inside (0, 1): out[n, c] is a pure function of
    (keys[n], columns[c] or columns[n, c], seed). keys: int64 [N] (any value); columns: int64
    [C] or [N, C] in [0, 2^32). float32 gives odd multiples of 2^-24 (23 random bits, every
    one exactly representable), float64 odd multiples of 2^-53 (52 bits from two lanes)."""
    if keys.dtype != torch.int64 or columns.dtype != torch.int64:
        raise TypeError(f"keys and columns must be int64, got {keys.dtype} and {columns.dtype}")
    if keys.dim() != 1 or columns.dim() not in (1, 2):
        raise ValueError(
            f"expected keys [N] and columns [C] or [N, C], got "
            f"{tuple(keys.shape)} and {tuple(columns.shape)}"
        )
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    lanes = [_absorb(init, seed) for init in _LANE_INIT]  # Python ints
    rows = keys.unsqueeze(-1)  # [N, 1]
    col_hash = _absorb(_COLUMN_INIT, columns if columns.dim() == 2 else columns.unsqueeze(0))
    hi = _stream(_absorb(lanes[0], rows), _absorb(lanes[1], rows), col_hash)  # [N, C]
    if dtype == torch.float32:
        k = hi >> 9  # 23 bits: 2k+1 < 2^24 is exact in float32's 24-bit significand
        return ((k << 1) | 1).to(torch.float32).mul_(2.0**-24)
    lo = _stream(_absorb(lanes[2], rows), _absorb(lanes[3], rows), col_hash)
    k = (hi << 20) | (lo >> 12)  # 52 bits
    return ((k << 1) | 1).to(torch.float64).mul_(2.0**-53)


def sample_row_keys(
    instance_ids: torch.Tensor, positions: torch.Tensor, epoch: int
) -> torch.Tensor:
    """One non-negative int64 key per (instance, position, epoch), for counter_uniform.
    instance_ids [B] with positions [B, W] (a row of positions per instance), or both of the
    same (broadcastable) shape. Keys are 63-bit hashes, so distinct triples collide with
    probability ~2^-63 per pair; the seed is mixed in later, by counter_uniform."""
    instance_ids, positions = instance_ids.long(), positions.long()
    if positions.dim() == instance_ids.dim() + 1:
        instance_ids = instance_ids.unsqueeze(-1)  # [B, 1] against [B, W]
    lanes = []
    for init in _ROW_KEY_INIT:
        h = _absorb(_absorb(init, instance_ids), positions)
        lanes.append(_absorb(h, epoch))
    return ((lanes[0] & 0x7FFFFFFF) << 32) | lanes[1]


def _banned_columns(columns: torch.Tensor, vocab_size: int, exclude_ids) -> torch.Tensor:
    """[Vp] bool: padding columns and this shard's excluded ids. No host sync, so no
    boolean indexing: out-of-shard ids are sent to a spare slot Vp that is dropped."""
    banned = columns >= vocab_size
    if exclude_ids is None:
        return banned
    local_vocab = columns.numel()
    local = exclude_ids.to(columns.device, torch.int64).reshape(-1) - columns[0]
    outside = (local < 0) | (local >= local_vocab)
    local = local.masked_fill(outside, local_vocab)
    hit = torch.zeros(local_vocab + 1, dtype=torch.bool, device=columns.device)
    hit.index_fill_(0, local, True)  # not hit[local] = True: a host->device copy of True
    return banned | hit[:local_vocab]


def weight_bits(vocab_size: int) -> int:
    """K of the integer weights: vocab_size weights of at most 2^K sum below 2^62."""
    return 62 - max(1, vocab_size - 1).bit_length()


@torch.no_grad()
def vocab_parallel_sample(
    local_logits: torch.Tensor,
    group,
    *,
    vocab_size: int,
    row_keys: torch.Tensor,
    seed: int,
    temperature: float = 1.0,
    exclude_ids: torch.Tensor | None = None,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """Global token ids [...] drawn from softmax(logits / temperature) over the real vocabulary
    minus ``exclude_ids``, identical on every rank of ``group``. local_logits [..., Vp] (this
    rank's slice), row_keys int64 [...] (see sample_row_keys). A row with no drawable id gets
    -1; a NaN logit is not drawable, a +inf one takes the row's mass (with any other +inf). The draw depends only on (seed, row key, the logits, temperature); rows go
    ~chunk_elements logits at a time (None: 2^16 on CPU, where staying in cache pays, else
    2^24), which bounds the temporaries and does not change the draws."""
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if row_keys.shape != local_logits.shape[:-1]:
        raise ValueError(
            f"row_keys {tuple(row_keys.shape)} must match logits "
            f"{tuple(local_logits.shape)} without the vocabulary dimension"
        )
    local_vocab = local_logits.shape[-1]
    rank, world = group_rank(group), group_size(group)
    start = rank * local_vocab
    logits = local_logits.reshape(-1, local_vocab)  # [N, Vp]
    n = logits.shape[0]
    keys = row_keys.reshape(-1).to(logits.device, torch.int64)
    columns = torch.arange(start, start + local_vocab, device=logits.device)  # global ids
    banned = _banned_columns(columns, vocab_size, exclude_ids)  # [Vp]
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scale = float(2 ** weight_bits(vocab_size))
    if chunk_elements is None:
        chunk_elements = 1 << 24 if logits.is_cuda else 1 << 16
    step = max(1, chunk_elements // local_vocab)

    def finite(rows: slice) -> torch.Tensor:
        """The logits in ``dtype``, out of place (they must not change): a NaN carries no
        mass (-inf) and +inf counts as the largest finite value, so no NaN reaches exp and the
        integer weights (whose conversion of NaN differs between CPU and CUDA)."""
        top = torch.finfo(dtype).max
        return logits[rows].to(dtype).nan_to_num(float("-inf"), top, float("-inf"))

    def weights(rows: slice) -> torch.Tensor:
        """Integer weights [rows, Vp]; banned columns are exactly 0. The max is subtracted
        before dividing by T: logit / T overflows float32 for a small T (-> inf - inf = NaN),
        (logit - max) / T only underflows to -inf, a weight of 0."""
        scaled = finite(rows).sub_(finite_peak[rows, None]).div_(temperature)
        return scaled.exp_().mul_(scale).round_().masked_fill_(banned, 0.0).long()

    # 1. The global max per row (for a stable exp), then each shard's sum of weights.
    peak = torch.full((n,), float("-inf"), dtype=dtype, device=logits.device)
    for lo in range(0, n, step):
        rows = slice(lo, lo + step)
        peak[rows] = finite(rows).masked_fill_(banned, float("-inf")).max(dim=-1).values
    if world > 1:
        comm.all_reduce(peak, group, "max")
    finite_peak = peak.masked_fill(peak == float("-inf"), 0.0)
    local_sum = torch.empty(n, dtype=torch.int64, device=logits.device)
    for lo in range(0, n, step):
        rows = slice(lo, lo + step)
        local_sum[rows] = weights(rows).sum(-1)
    sums = _all_gather_rows(local_sum, group)  # [tp, N]
    # 2. Which shard holds u's column: the last nonempty one whose preceding mass is <= target.
    before = sums.cumsum(0) - sums  # [tp, N] mass of the shards before each
    total = sums.sum(0)  # [N]
    u = counter_uniform(
        keys, torch.zeros(1, dtype=torch.int64, device=keys.device), seed, dtype=torch.float64
    ).squeeze(1)
    # floor(u * total) in [0, total): u < 1 - 2^-54 keeps the float64 product below total.
    target = torch.minimum((u * total.double()).long(), (total - 1).clamp(min=0))
    owner = ((before <= target) & (sums > 0)).long().cumsum(0).argmax(0)
    # 3. The owner finds the first column whose cumulative weight exceeds target - before (its
    # weight is > 0, and it exists since target < before + the shard's sum); others propose -1.
    ids = torch.full((n,), -1, dtype=torch.int64, device=logits.device)
    offset = target - before[rank]
    for lo in range(0, n, step):
        rows = slice(lo, lo + step)
        cum = weights(rows).cumsum_(-1)
        found = torch.searchsorted(cum, offset[rows, None], right=True).squeeze(1)
        ids[rows] = found.clamp_(max=local_vocab - 1) + start
    ids = ids.masked_fill((owner != rank) | (total <= 0), -1)
    if world > 1:
        comm.all_reduce(ids, group, "max")
    return ids.reshape(row_keys.shape)


def _all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x.unsqueeze(0)
    return torch.stack(comm.all_gather(x, group))

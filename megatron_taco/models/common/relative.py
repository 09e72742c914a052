"""Relative-position attention pieces shared by TACO and SAS^DA (DeBERTa's disentangled attention).

Both models score each (query i, key j) pair against a table of relative-position rows:

    c2p[i, j] = q_i . K_R[c2p_index[i, j]]        (content to position)
    p2c[i, j] = k_j . Q_R[p2c_index[i, j]]        (position to content)

where K_R / Q_R are the relative rows projected per head. The models differ only in how a
pair maps to a row (``c2p_index`` / ``p2c_index``):

* TACO: r_ij = clip(p_j - p_i, -k, k) + k from the example's position ids, a separate
  bucket for pairs involving a masked position, c2p at r_ij and p2c at r_ji (the transpose);
* DeBERTa-v2 (transformers' semantics): delta = i - j, optionally log-bucketed, row
  clamp(delta + span, 0, 2 span - 1) for both c2p and p2c.

Shapes: h heads (local to the tp rank), b rows, s tokens, d head size, n table rows.
The products never materialise [h, b, s, s, d]: each query is scored against all n rows
([h, b*s, n], one GEMM) and the row of each pair is gathered; the backward scatters the
pair gradients back into the n rows and is again one GEMM.
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------
# TACO's buckets: from position ids, with a mask bucket and a compact range


def position_stats(position_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """(hi_pos, lo_pos, has_padding): the largest and smallest unmasked position id (-1 and
    the dtype's maximum when every position is masked) and whether any key is padding, in one
    device->host read. Called on the CPU batch by the collate wrapper (models/common/host.py),
    so a training forward reads nothing back from the device."""
    valid = position_ids >= 0
    big = torch.iinfo(position_ids.dtype).max
    stats = [
        position_ids.masked_fill(~valid, -1).max(),
        position_ids.masked_fill(~valid, big).min(),
    ]
    if attention_mask is not None:
        stats.append((~attention_mask.bool()).any().to(position_ids.dtype))
    values = torch.stack(stats).tolist()
    return values[0], values[1], attention_mask is not None and bool(values[2])


def bucket_range(hi_pos: int, lo_pos: int, k: int) -> tuple[int, int]:
    """The range [lo, hi] of clipped-distance buckets that positions lo_pos..hi_pos can use.

    Only buckets k-span .. k+span occur when the (unmasked) positions span ``span``;
    projecting and multiplying only those rows instead of all 2k+1 saves a factor
    (2k+1)/(2 span+1) on the c2p/p2c products (4x for seq 128 with k=511). All tp ranks see
    the same batch, so they agree on the range.
    """
    if hi_pos < 0:  # every position masked: only the mask bucket occurs
        return k, k
    span = min(int(hi_pos - lo_pos), k)
    return k - span, k + span


def batch_layout(position_ids: torch.Tensor, attention_mask: torch.Tensor | None, k: int):
    """(lo, hi, has_padding) of a batch: ``bucket_range`` and whether any key is padding,
    with a single device->host transfer."""
    hi_pos, lo_pos, has_padding = position_stats(position_ids, attention_mask)
    return (*bucket_range(hi_pos, lo_pos, k), has_padding)


def relative_bucket_range(position_ids: torch.Tensor, k: int) -> tuple[int, int]:
    lo, hi, _ = batch_layout(position_ids, None, k)
    return lo, hi


def relative_position_index(position_ids: torch.Tensor, k: int, lo: int, hi: int) -> torch.Tensor:
    """Bucket of every (query i, key j) pair, from the example's position ids (never from
    the physical column, so permuting tokens with their positions permutes the result).

    r_ij = clip(p_j - p_i, -k, k) + k, and 2k+1 when p_i or p_j is the mask position (-1).
    Returned relative to the compact table used by the forward: bucket - lo for real
    distances, and the last slot (hi - lo + 1) for the mask bucket; with lo=0, hi=2k this is
    exactly the canonical bucket. position_ids [b, s] -> [b, s, s] int64.
    """
    p = position_ids.long()
    dist = p.unsqueeze(1) - p.unsqueeze(2)  # [b, s(i), s(j)] = p_j - p_i
    r = dist.clamp(-k, k) + (k - lo)
    masked = p < 0
    pair_masked = masked.unsqueeze(1) | masked.unsqueeze(2)
    return r.masked_fill(pair_masked, hi - lo + 1)


def relative_table_rows(lo: int, hi: int, mask_bucket: int, device) -> torch.Tensor:
    """Rows of the relative table used by the compact index: lo..hi, then the mask bucket."""
    rows = torch.arange(lo, hi + 2, device=device)
    rows[-1:].fill_(mask_bucket)  # not rows[-1] = ...: a host->device copy of the number
    return rows


# ---------------------------------------------------------------------------------------
# DeBERTa-v2's buckets


def log_bucket_position(relative_pos: torch.Tensor, bucket_size: int, max_position: int):
    """DeBERTa-v2's log buckets: distances inside +-bucket_size/2 are kept, larger ones are
    compressed logarithmically so that max_position maps to +-(bucket_size/2 - 1) + mid."""
    sign = torch.sign(relative_pos)
    mid = bucket_size // 2
    inside = (relative_pos < mid) & (relative_pos > -mid)
    abs_pos = torch.where(inside, torch.full_like(relative_pos, mid - 1), relative_pos.abs())
    # float32 like transformers: the ceil of a float64 log can land in another bucket.
    ratio = torch.log(torch.tensor((max_position - 1) / mid, dtype=torch.float32))
    log_pos = torch.ceil(torch.log(abs_pos.float() / mid) / ratio * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, relative_pos.float(), log_pos * sign).long()


def deberta_relative_index(
    seq_length: int, span: int, position_buckets: int, max_relative_positions: int, device=None
) -> torch.Tensor:
    """[1, s, s] int64: the table row of every (i, j) pair, for both c2p and p2c, as in
    transformers' DeBERTa-v2 (delta = i - j, log-bucketed when position_buckets > 0, then
    clamp(delta + span, 0, 2 span - 1)); ``span`` is the table's half size."""
    ids = torch.arange(seq_length, device=device)
    delta = ids[:, None] - ids[None, :]  # [s(i), s(j)] = i - j
    if position_buckets > 0 and max_relative_positions > 0:
        delta = log_bucket_position(delta, position_buckets, max_relative_positions)
    return (delta + span).clamp(0, 2 * span - 1).unsqueeze(0)


# ---------------------------------------------------------------------------------------
# The c2p / p2c products (forward and hand-written backward)


def c2p_scores(q, k_r, index, scale: float, out=None):
    """c2p[h, b, i, j] = scale * q[h, b, i] . k_r[h, index[b, i, j]].
    q [h, b, s, d], k_r [h, n, d], index [b, s, s] (may be expanded) -> [h, b, s, s]."""
    h, b, s, d = q.shape
    n = k_r.shape[1]
    # Score each query against every row (scale on the small [h, n, d] side), pick r_ij.
    scores = torch.bmm(q.reshape(h, b * s, d), (k_r * scale).transpose(1, 2))  # [h, b*s, n]
    idx = index.unsqueeze(0).expand(h, b, s, s)
    return torch.gather(scores.view(h, b, s, n), -1, idx, out=out)


def p2c_scores(k, q_r, index_t, scale: float, out=None):
    """p2c[h, b, i, j] = scale * k[h, b, j] . q_r[h, index[b, i, j]], given the key-major
    index_t [b, s, s] (index_t[b, j, i] = index[b, i, j]).
    k [h, b, s, d], q_r [h, n, d] -> [h, b, s, s] (written into ``out`` if given, else a
    transposed view)."""
    h, b, s, d = k.shape
    n = q_r.shape[1]
    # Key-major scores [h, b, s(j), n] (the same one GEMM as c2p), gathered along their last
    # dim straight into the transpose of the output: ~25% faster than scoring row-major
    # [h, b, n, s(j)] (a broadcast matmul) and gathering along the row dim.
    scores = torch.bmm(k.reshape(h, b * s, d), (q_r * scale).transpose(1, 2)).view(h, b, s, n)
    idx_t = index_t.unsqueeze(0).expand(h, b, s, s)
    if out is None:  # a transposed view
        return torch.gather(scores, -1, idx_t).transpose(-1, -2)
    torch.gather(scores, -1, idx_t, out=out.transpose(-1, -2))
    return out


def _scatter_rows(grad, idx, n: int) -> torch.Tensor:
    """[h, b, s, n]: out[..., i, r] = sum over j with idx[..., i, j] == r of grad[..., i, j].
    Up to s terms land in one entry (all of a row's far pairs share the clipped bucket), so
    half-precision gradients are summed in float32 and rounded once: bf16 sums of ~100
    terms of one sign lose whole units (its spacing at 128 is 1). On a GPU the sum is an
    atomic add, which float32 also makes far less order-dependent."""
    acc = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    h, b, s, _ = grad.shape
    out = torch.zeros(h, b, s, n, dtype=acc, device=grad.device)
    return out.scatter_add_(-1, idx, grad.to(acc)).to(grad.dtype)


def c2p_backward(grad, q, k_r, index, grad_q):
    """Unscaled gradients of c2p_scores: adds d/dq into ``grad_q`` [h, b*s, d] in place and
    returns d/dk_r [h, n, d]. grad [h, b, s, s]."""
    h, b, s, d = q.shape
    n = k_r.shape[1]
    idx = index.unsqueeze(0).expand(h, b, s, s)
    # Sum the gradient of each (i, j) into its row; then it is a plain product.
    g_scores = _scatter_rows(grad, idx, n).view(h, b * s, n)
    grad_q.baddbmm_(g_scores, k_r)
    return torch.bmm(g_scores.transpose(1, 2), q.reshape(h, b * s, d))


def p2c_backward(grad, k, q_r, index_t, grad_k):
    """Unscaled gradients of p2c_scores: adds d/dk into ``grad_k`` [h, b*s, d] in place and
    returns d/dq_r [h, n, d]. ``index_t`` is the forward's key-major index."""
    h, b, s, d = k.shape
    n = q_r.shape[1]
    idx_t = index_t.unsqueeze(0).expand(h, b, s, s)
    # The gradient of (i, j) belongs to key j: scatter the transposed gradient into a
    # key-major [h, b, s(j), n] layout (a last-dim scatter, ~2x faster than scattering
    # along the row dim of the forward's layout).
    g_scores = _scatter_rows(grad.transpose(-1, -2), idx_t, n).view(h, b * s, n)
    grad_k.baddbmm_(g_scores, q_r)
    return torch.bmm(g_scores.transpose(1, 2), k.reshape(h, b * s, d))

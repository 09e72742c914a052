"""Cross entropy and argmax over logits whose vocabulary dimension is split across TP ranks.

Rank r holds columns [r*Vp, (r+1)*Vp) of the padded vocabulary (Vp = padded_vocab / tp), in
the VocabParallelEmbedding layout. Nothing of size [.., padded_vocab] is ever gathered:
three all-reduces of [..] sized tensors (max, target logit, sum of exp) suffice.
Columns >= ``vocab_size`` (padding) are treated as -inf, so the loss and its gradient equal
an unpadded softmax over the real vocabulary for any tp.
"""

from __future__ import annotations

import torch

from megatron_taco.parallel import comm
from megatron_taco.parallel.mappings import group_rank, group_size


def _vocab_range(local_vocab: int, group) -> tuple[int, int]:
    start = group_rank(group) * local_vocab
    return start, start + local_vocab


def _mask_padding(logits: torch.Tensor, start: int, vocab_size: int | None) -> torch.Tensor:
    local_vocab = logits.shape[-1]
    if vocab_size is None or start + local_vocab <= vocab_size:
        return logits
    col = torch.arange(start, start + local_vocab, device=logits.device)
    return logits.masked_fill(col >= vocab_size, float("-inf"))


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Losses and softmax sums in float32 for half-precision logits; float64 stays float64
    (exact comparisons in tests run the whole model in float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _all_reduce(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    if group_size(group) > 1:
        comm.all_reduce(x, group, op)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, target, group, vocab_size, ignore_index):
        # Compute in float32 whatever the input dtype (bf16 exp/log sums lose too much).
        logits = at_least_float32(local_logits)
        start, end = _vocab_range(logits.shape[-1], group)
        logits = _mask_padding(logits, start, vocab_size)

        # Subtract the global max for a stable exp. A rank whose slice is all padding has
        # local max -inf; the global max is finite as long as vocab_size > 0.
        logits_max = logits.max(dim=-1).values  # [...]
        _all_reduce(logits_max, group, "max")
        logits = logits - logits_max.unsqueeze(-1)

        # Logit of the target: only its owner rank contributes, the others add 0.
        ignored = target == ignore_index
        not_local = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(not_local, 0)
        predicted = torch.gather(logits, -1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(not_local, 0.0)
        _all_reduce(predicted, group)

        exp_logits = logits.exp()  # padded columns -> 0
        sum_exp = exp_logits.sum(dim=-1)
        _all_reduce(sum_exp, group)

        loss = (sum_exp.log() - predicted).masked_fill(ignored, 0.0)  # [...]

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))  # [..., Vp], reuses the exp buffer
        ctx.save_for_backward(softmax, not_local, local_target, ignored)
        ctx.input_dtype = local_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, not_local, local_target, ignored = ctx.saved_tensors
        # d loss / d logit_j = softmax_j - [j == target]; 0 for ignored tokens.
        grad = softmax.clone()
        one_hot_sub = (~not_local).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -one_hot_sub)
        scale = grad_loss.to(softmax.dtype).masked_fill(ignored, 0.0).unsqueeze(-1)
        grad.mul_(scale)
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    group,
    vocab_size: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross entropy. local_logits [..., Vp] (this rank's vocabulary slice), target
    [...] global ids -> float32 loss [...] (0 where target == ignore_index). ``vocab_size``:
    the real vocabulary; columns at or beyond it are excluded. A target that is not a real id
    (>= vocab_size, other than ignore_index) gives an infinite loss rather than an error,
    because checking would cost a synchronisation."""
    if local_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(local_logits.shape)} and target {tuple(target.shape)} disagree "
            "(expected logits [..., V/tp] and target [...])"
        )
    return _VocabParallelCrossEntropy.apply(local_logits, target, group, vocab_size, ignore_index)


@torch.no_grad()
def vocab_parallel_argmax(
    local_logits: torch.Tensor, group, vocab_size: int | None = None
) -> torch.Tensor:
    """Global argmax ids [...] over the split vocabulary (padding excluded). Ties resolve to
    the smallest id, like torch.argmax on the full logits."""
    start, _ = _vocab_range(local_logits.shape[-1], group)
    logits = _mask_padding(at_least_float32(local_logits), start, vocab_size)
    local_max, local_idx = logits.max(dim=-1)
    if group_size(group) == 1:
        return local_idx
    global_max = _all_reduce(local_max.clone(), group, "max")
    # Ranks not holding the maximum propose an id larger than any real one; MIN picks the
    # first rank (smallest ids) that holds it.
    sentinel = torch.iinfo(torch.int64).max
    candidate = torch.where(local_max == global_max, local_idx + start, sentinel)
    return _all_reduce(candidate, group, "min")

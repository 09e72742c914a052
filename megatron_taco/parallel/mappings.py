"""Autograd-aware collectives over a tensor-parallel group (Megatron's mappings).

Each op is the adjoint pair of a collective: the backward of a forward all-reduce is the
identity and vice versa; split <-> all-gather; reduce-scatter <-> all-gather. All of them
take the group explicitly and are the identity when it is None or has one rank.
Splits and gathers are along ``dim`` in equal chunks, so that dimension must be divisible
by the group size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_taco.parallel import comm


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _check_divisible(x: torch.Tensor, dim: int, world: int) -> int:
    dim = dim % x.dim()
    if x.shape[dim] % world != 0:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) is not divisible "
            f"by the tensor-parallel size {world}"
        )
    return dim


def _all_reduce(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    # all_reduce is in place; never modify a tensor autograd may have saved.
    x = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(x, group)
    return x


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    dim = _check_divisible(x, dim, world)
    # contiguous() so the chunk can be sent by a later collective / saved without aliasing.
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    return torch.cat(comm.all_gather(x, group), dim=dim)


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum over the group, keep this rank's chunk along ``dim``: [.., n, ..] -> [.., n/world, ..]."""
    world = group_size(group)
    if world == 1:
        return x
    dim = _check_divisible(x, dim, world)
    # reduce_scatter_tensor hands rank r the sum of block r (dim 0) of its input: chunk r
    # along ``dim`` goes to slot r of a new leading dim. NCCL and gloo take the same call
    # (gloo as an all-reduce inside torch), so the CPU tests run the collective GPUs run.
    stacked = torch.stack(x.chunk(world, dim=dim), dim=0)  # [world, .., n/world, ..]
    out = torch.empty_like(stacked[0])
    return comm.reduce_scatter_tensor(out, stacked, group)


def _identity(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return x


def _adjoint(forward, backward, name: str) -> type[torch.autograd.Function]:
    """An autograd op that runs ``forward`` and has ``backward`` as its gradient; both take
    (x, group, dim), the all-reduces and the identity ignoring ``dim``."""

    def fwd(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return forward(x, group, dim)

    def bwd(ctx, grad):
        return backward(grad, ctx.group, ctx.dim), None, None

    methods = {"forward": staticmethod(fwd), "backward": staticmethod(bwd)}
    return type(name, (torch.autograd.Function,), methods)


_CopyToTP = _adjoint(_identity, _all_reduce, "_CopyToTP")
_ReduceFromTP = _adjoint(_all_reduce, _identity, "_ReduceFromTP")
_ScatterToTP = _adjoint(_split, _gather, "_ScatterToTP")
_GatherFromTP = _adjoint(_gather, _split, "_GatherFromTP")
_ReduceScatterToTP = _adjoint(_reduce_scatter, _gather, "_ReduceScatterToTP")
_AllGatherToTP = _adjoint(_gather, _reduce_scatter, "_AllGatherToTP")


def _apply(op: type[torch.autograd.Function], x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return x if group_size(group) == 1 else op.apply(x, group, dim)


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward identity; backward all-reduce (sum) of the gradient (input of a column-parallel op)."""
    return _apply(_CopyToTP, x, group, 0)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward all-reduce (sum); backward identity (output of a row-parallel op)."""
    return _apply(_ReduceFromTP, x, group, 0)


def scatter_to_tp_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Forward: keep this rank's chunk along dim; backward: all-gather the gradient."""
    return _apply(_ScatterToTP, x, group, dim)


def gather_from_tp_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Forward: all-gather along dim; backward: keep this rank's chunk of the gradient."""
    return _apply(_GatherFromTP, x, group, dim)


def reduce_scatter_to_tp_region(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Forward: sum over ranks and keep this rank's chunk along dim; backward: all-gather."""
    return _apply(_ReduceScatterToTP, x, group, dim)


def all_gather_to_tp_region(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Forward: all-gather along dim; backward: reduce-scatter (sum) the gradient.

    Differs from gather_from_tp_region in the backward: use it when every rank's copy of the
    gathered output feeds a *different* computation (sequence parallelism), so the gradient
    contributions must be summed, not just sliced.
    """
    return _apply(_AllGatherToTP, x, group, dim)

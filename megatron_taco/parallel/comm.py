"""Every torch.distributed collective of the package, in one place (a test fails if any other
module calls one directly: tests/unit/test_comm.py).

Why one place: NCCL accepts only CUDA tensors of the current device, gloo CPU (and some
CUDA) tensors, and CPU tests run gloo only, so a CPU tensor handed to a collective works in
every test and stops the first GPU run. Here a tensor goes to the device its group's backend
needs (``backend_device``) and the result comes back to the tensor's own device: callers
build their tensors where convenient (on the model's device, to avoid copies) and stay
correct either way. ``group=None`` is the default (world) group.

Reductions take ``op`` as a name ("sum", "max", "min"), so callers need no torch.distributed
import for them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def backend_device_type(backend: str) -> str | None:
    """The device type a backend's collectives need their tensors on: "cuda" for NCCL alone;
    None for gloo, MPI or a mixed "cpu:gloo,cuda:nccl" group (each tensor's own device)."""
    names = {part.rpartition(":")[2] for part in str(backend).lower().split(",")}
    return "cuda" if names == {"nccl"} else None


def backend_device(group=None) -> torch.device | None:
    """The device collectives over ``group`` need (NCCL: the current CUDA device, which the
    driver set from LOCAL_RANK before the process group existed); None: any."""
    if backend_device_type(dist.get_backend(group)) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _staged(tensor: torch.Tensor, group) -> torch.Tensor:
    device = backend_device(group)
    if device is None or tensor.device == device:
        return tensor
    return tensor.to(device)


def all_reduce(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """In place over ``group`` (the reduced values land in ``tensor`` itself); returns it."""
    staged = _staged(tensor, group)
    dist.all_reduce(staged, op=_OPS[op], group=group)
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), in group-rank order, on the
    tensor's own device."""
    staged = _staged(tensor.contiguous(), group)
    parts = [torch.empty_like(staged) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, staged, group=group)
    return [p.to(tensor.device) for p in parts]


def reduce_scatter_tensor(output: torch.Tensor, stacked: torch.Tensor, group=None) -> torch.Tensor:
    """``output`` = the sum over ranks of ``stacked[r]`` on rank r; ``stacked`` is
    [world, *output.shape]. Returns ``output``."""
    # gloo checks that the input's dim 0 is world x the output's (NCCL only counts
    # elements): fold the rank dim into the next one.
    flat = _staged(stacked.flatten(0, 1) if output.dim() else stacked, group)
    staged = _staged(output, group)
    # torch 2.13 renamed it (the old name warns on every rank); older torch has only the old.
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(staged, flat, group=group)
    if staged is not output:
        output.copy_(staged)
    return output


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In place from global rank ``src``; returns ``tensor``."""
    staged = _staged(tensor, group)
    dist.broadcast(staged, src=src, group=group)
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor


def barrier(group=None) -> None:
    if not dist.is_initialized():  # one process without a group (tools, tests)
        return
    device = backend_device(group)
    if device is not None:
        # NCCL's barrier is an all-reduce on some device: name ours, or torch guesses one.
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's picklable ``obj`` in group-rank order (torch stages the bytes on the
    current CUDA device under NCCL itself); ``[obj]`` without a process group."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Global rank ``src``'s picklable ``obj`` on every rank (``obj`` without a group)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]

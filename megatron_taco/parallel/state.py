"""Process-group layout for tensor x data parallelism, and DeepSpeed's ``mpu`` interface.

Layout (Megatron, no pipeline parallelism): with world size W and tensor-parallel size T,
tensor-parallel groups are contiguous blocks [0..T-1], [T..2T-1], ... (so a TP group sits
on one node's fast interconnect), and data-parallel groups are strided: {r, r+T, r+2T, ...}.
W=4, T=2: TP {0,1} {2,3}; DP {0,2} {1,3}.

A ``ParallelState`` is passed explicitly everywhere (there are no module-global groups). It is
also handed to ``deepspeed.initialize(mpu=...)``: DeepSpeed then reduces gradients and shards
ZeRO state over ``get_data_parallel_group()`` only, and sums gradient-norm contributions over
``get_model_parallel_group()`` (the TP group) using the ``tensor_model_parallel`` attribute
the layers set on split parameters.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_taco.errors import ConfigError
from megatron_taco.parallel import comm
from megatron_taco.parallel.config import check_world_size

# The file group's timeout unless the driver gives one (--filesystem-timeout-minutes).
DEFAULT_FILE_TIMEOUT = timedelta(minutes=60)


def tp_group_ranks(world_size: int, tp_size: int) -> list[list[int]]:
    check_world_size(world_size, tp_size)
    return [list(range(start, start + tp_size)) for start in range(0, world_size, tp_size)]


def dp_group_ranks(world_size: int, tp_size: int) -> list[list[int]]:
    check_world_size(world_size, tp_size)
    return [list(range(tp_rank, world_size, tp_size)) for tp_rank in range(tp_size)]


class ParallelState:
    """Ranks and groups of this process. ``tp_group``/``dp_group`` are None only in a single
    process built without torch.distributed; every collective in parallel/ treats a None
    group as "no parallelism", and the mpu ``get_*_group()`` methods return the world group
    for it once torch.distributed is up (DeepSpeed needs a registered group)."""

    def __init__(
        self,
        *,
        world_size: int,
        rank: int,
        tp_size: int,
        tp_group: dist.ProcessGroup | None,
        dp_group: dist.ProcessGroup | None,
        file_group: dist.ProcessGroup | None = None,
        host_group: dist.ProcessGroup | None = None,
    ) -> None:
        check_world_size(world_size, tp_size)
        self.world_size = world_size
        self.rank = rank
        self.tp_size = tp_size
        self.tp_rank = rank % tp_size
        self.dp_size = world_size // tp_size
        self.dp_rank = rank // tp_size
        self.tp_group = tp_group
        self.dp_group = dp_group
        # Every rank, on gloo, with a timeout of its own: see file_barrier.
        self.file_group = file_group
        # Host values (CPU tensors) over the world: a gloo group beside an NCCL world, so
        # that agreeing on them never waits for the GPU; None where the world group is
        # gloo already (or there is no world).
        self.host_group = host_group
        self.tp_ranks = tp_group_ranks(world_size, tp_size)[self.dp_rank]
        self.dp_ranks = dp_group_ranks(world_size, tp_size)[self.tp_rank]

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
            f"dp={self.dp_rank}/{self.dp_size})"
        )

    def file_barrier(self) -> None:
        """Where the other ranks wait for file-system work one rank does alone (removing
        old checkpoints, scanning the SAS store): a barrier of the file group, whose timeout
        (--filesystem-timeout-minutes) is not the collectives' (--distributed-timeout-minutes),
        so a slow file system is not taken for a hung rank. Collective (a state built
        without the group, e.g. around a process group made elsewhere: the default one's)."""
        if dist.is_initialized():
            comm.barrier(self.file_group)

    def destroy(self) -> None:
        """Destroy the subgroups this state created (not the default group)."""
        if dist.is_initialized():
            groups = (self.tp_group, self.dp_group, self.file_group, self.host_group)
            for group in {id(g): g for g in groups if g is not None}.values():
                dist.destroy_process_group(group)
        self.tp_group = self.dp_group = self.file_group = self.host_group = None

    # --- DeepSpeed / Megatron mpu interface ----------------------------------------------
    # Model parallel == tensor parallel here (no pipeline stages).
    def _registered(self, group):
        # A single-process state (groups None) may be handed to DeepSpeed, which initialises
        # torch.distributed itself and then needs registered groups (it calls e.g.
        # get_global_rank(group, 0)). With one process the TP and DP groups are the world.
        if group is None and dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise RuntimeError(
                    f"{self!r} was built without torch.distributed, which now has world size "
                    f"{dist.get_world_size()}; call init_parallel() after initialising it"
                )
            return dist.group.WORLD
        return group

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_group(self):
        return self._registered(self.tp_group)

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_group(self):
        return self._registered(self.tp_group)

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of tp_rank 0 in this rank's TP group (broadcast source)."""
        return self.tp_ranks[0]

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self):
        return self._registered(self.dp_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_ranks)

    # No pipeline parallelism. There is deliberately no get_pipeline_model_parallel_group:
    # DeepSpeed only asks for it when the pipeline world size is > 1.
    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    # No sequence parallelism (Ulysses). DeepSpeed reads these sizes; with size 1 its
    # "sequence x data" group is the data-parallel group. We must NOT define
    # ``initialize_sequence_parallel``: DeepSpeed takes its presence to mean "ignore this
    # mpu's data-parallel group", which would make ZeRO shard over the whole world.
    def get_sequence_parallel_rank(self) -> int:
        return 0

    def get_sequence_parallel_world_size(self) -> int:
        return 1

    def get_sequence_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_sequence_data_parallel_group(self):
        return self._registered(self.dp_group)


def cuda_device_index(local_rank: int, device_count: int, local_world_size: int | None) -> int:
    """This rank's CUDA device: LOCAL_RANK % the visible device count. Every GPU of the node
    visible to every rank (deepspeed, torchrun, srun --gpus-per-node): device LOCAL_RANK; one
    GPU per task (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank): device 0. Any
    other count would put two ranks on one GPU, or none on a visible one: one line instead."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    where = f"this process sees {device_count} GPU(s) (CUDA_VISIBLE_DEVICES={visible})"
    if device_count < 1:
        raise ConfigError(f"CUDA is the accelerator but {where}")
    too_many = local_world_size is not None and local_world_size > device_count
    if device_count > 1 and (local_rank >= device_count or too_many):
        ranks = f"{local_world_size} ranks" if too_many else f"LOCAL_RANK {local_rank}"
        raise ConfigError(
            f"{ranks} on this node but {where}: start one rank per GPU, each seeing every GPU "
            "of the node or exactly one"
        )
    return local_rank % device_count


def set_cuda_device() -> int:
    """torch.cuda.set_device(cuda_device_index(...)) from the launcher's environment; before
    the process group (NCCL binds its communicators to the current device)."""
    # torchrun's name, then the deepspeed launcher's.
    local_size = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    index = cuda_device_index(
        int(os.environ.get("LOCAL_RANK", "0")),
        torch.cuda.device_count(),
        int(local_size) if local_size else None,
    )
    torch.cuda.set_device(index)
    return index


def single_process_state(tp_size: int = 1) -> ParallelState:
    return ParallelState(world_size=1, rank=0, tp_size=tp_size, tp_group=None, dp_group=None)


def init_parallel(
    tp_size: int = 1, backend: str | None = None, file_timeout: timedelta = DEFAULT_FILE_TIMEOUT
) -> ParallelState:
    """Build the TP/DP groups and the file group (ParallelState.file_barrier: every rank,
    gloo, ``file_timeout``), initialising torch.distributed from env:// if needed.

    torch.distributed is initialised here only when it is not yet and WORLD_SIZE > 1 (set by
    torchrun and the deepspeed launcher). A single process without WORLD_SIZE gets groups None.
    Every rank must call this (``new_group`` is collective over the world).
    """
    if not dist.is_initialized():
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if env_world > 1:
            check_world_size(env_world, tp_size)  # fail before any rendezvous
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                # One GPU per process; nccl needs the device chosen before the first collective.
                set_cuda_device()
            dist.init_process_group(backend=backend, init_method="env://")
    if not dist.is_initialized():
        check_world_size(1, tp_size)
        return single_process_state(tp_size)

    world_size = dist.get_world_size()
    rank = dist.get_rank()
    check_world_size(world_size, tp_size)
    tp_group = dp_group = None
    # new_group is collective: every rank creates every group, in the same order, and
    # keeps the one it belongs to.
    for ranks in dp_group_ranks(world_size, tp_size):
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    for ranks in tp_group_ranks(world_size, tp_size):
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    # gloo whatever the default backend: a barrier of CPU sockets, with its own timeout.
    file_group = dist.new_group(backend="gloo", timeout=file_timeout)
    host_group = None
    if world_size > 1 and dist.get_backend() != "gloo":
        host_group = dist.new_group(backend="gloo")
    return ParallelState(
        world_size=world_size,
        rank=rank,
        tp_size=tp_size,
        tp_group=tp_group,
        dp_group=dp_group,
        file_group=file_group,
        host_group=host_group,
    )

"""Process groups and the DeepSpeed engine, for any model whose ``forward(batch)`` returns a
dict with a scalar ``"loss"`` (and other scalars to log).

The default process group is always initialised here, also for a single process started
with plain ``python``: the tensor/data-parallel groups are then real (size 1) groups and
every code path (DeepSpeed's mpu, barriers, all-reduces of logged values) is the same as in
a multi-rank run.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_taco.parallel import comm
from megatron_taco.parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron_taco.parallel.state import (
    DEFAULT_FILE_TIMEOUT,
    ParallelState,
    init_parallel,
    set_cuda_device,
)
from megatron_taco.runtime.launcher import RENDEZVOUS_ENV, mpi_world_size_env
from megatron_taco.training.config import TrainingConfig
from megatron_taco.training.deepspeed_config import DeepSpeedSettings
from megatron_taco.training.optim import (
    AnnealingLR,
    build_optimizer,
    build_scheduler,
    optimizer_implementation,
)
from megatron_taco.training.resilience.peers import nccl_environment


def accelerator_name() -> str:
    """'cuda', 'cpu', ... as DeepSpeed's accelerator sees it (no process-group work)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


# cuBLAS picks its reduction order by workspace; a fixed configuration makes its GEMMs
# repeatable. Read when the first cuBLAS handle is created: before any matmul of the process.
CUBLAS_DETERMINISTIC = ":4096:8"


def apply_numerics(training: TrainingConfig) -> None:
    """--tf32 and --deterministic, for this process, before the run builds anything: every
    run of a sweep sets both again (they are process-wide)."""
    # CUDA's flags only: torch.set_float32_matmul_precision would also let oneDNN round
    # float32 GEMMs on CPUs that support it, changing CPU results.
    torch.backends.cuda.matmul.allow_tf32 = training.tf32
    torch.backends.cudnn.allow_tf32 = training.tf32
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if training.deterministic and workspace not in (CUBLAS_DETERMINISTIC, ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC
    # Not warn_only: an op without a deterministic kernel must stop the run, not quietly
    # break the bitwise promise.
    torch.use_deterministic_algorithms(training.deterministic)
    torch.backends.cudnn.deterministic = training.deterministic
    torch.backends.cudnn.benchmark = False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mpi_discovery() -> None:
    """Ranks started by mpirun (``mpirun -np 2 python pretrain_taco.py``, or ``deepspeed
    --launcher openmpi``, which sets nothing else) get RANK, WORLD_SIZE, LOCAL_RANK and
    MASTER_ADDR (rank 0's first ``hostname -I`` address) from DeepSpeed's MPI discovery
    over mpi4py. MASTER_ADDR/MASTER_PORT passed through mpirun (-x, -genv) win."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(
            f"started by an MPI launcher ({mpi_world_size_env()[0]} is set) but mpi4py is not "
            "installed: pip install mpi4py (requirements/cpu.txt pins it)"
        ) from None
    from deepspeed.comm.comm import mpi_discovery

    master_addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if port is None:
        # DeepSpeed's fixed default (29500) collides with any other job on the node: rank 0,
        # which hosts the rendezvous store, picks a free port and tells the others.
        comm = MPI.COMM_WORLD
        port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None, root=0)
    mpi_discovery(distributed_port=int(port), verbose=False)
    if master_addr is not None:
        os.environ["MASTER_ADDR"] = master_addr


def init_distributed(
    tp_size: int, timeout: timedelta | None = None, file_timeout: timedelta | None = None
) -> ParallelState:
    """Initialise torch.distributed (env://, as set by the launchers) and the TP/DP groups;
    ``timeout`` bounds the rendezvous and every collective of every group but the file
    group's (``file_timeout``: ParallelState.file_barrier)."""
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ and mpi_world_size_env() is not None:
            _mpi_discovery()
        if "WORLD_SIZE" not in os.environ:
            # Plain `python pretrain_taco.py`: a one-process world on a free local port.
            os.environ.update(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()),
            )
        missing = [k for k in RENDEZVOUS_ENV if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"WORLD_SIZE is set but {', '.join(missing)} is not: start with the deepspeed "
                "or torchrun launcher, mpirun, or plain python for one process"
            )
        backend = "gloo"
        if accelerator_name() == "cuda":
            # One GPU per process; nccl needs it chosen before the first collective.
            set_cuda_device()
            backend = "nccl"
            # A dead or hung peer must raise into Python (and our one line), not abort.
            os.environ.update(nccl_environment())
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    parallel = init_parallel(tp_size, file_timeout=file_timeout or DEFAULT_FILE_TIMEOUT)
    if timeout is not None:
        # new_group() gives subgroups torch's global default (30 min for gloo), not the
        # default group's timeout.
        for group in (parallel.tp_group, parallel.dp_group, parallel.host_group):
            if group is not None:
                dist.distributed_c10d._set_pg_timeout(timeout, group)
    return parallel


def destroy_distributed(parallel: ParallelState | None) -> None:
    """Subgroups first, then the default group: leaving them to interpreter shutdown can
    abort the process ("terminate called without an active exception") after the run."""
    if parallel is not None:
        parallel.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


def count_parameters(model: nn.Module, parallel: ParallelState) -> int:
    """Parameters of the whole model (all tensor-parallel shards, replicated ones once).
    Call before deepspeed.initialize: ZeRO-3 partitions the parameters."""
    local = sum(
        p.numel() for p in model.parameters() if param_is_not_tensor_parallel_duplicate(p, parallel)
    )
    total = torch.tensor([local], dtype=torch.int64)
    if dist.is_initialized() and parallel.tp_size > 1:
        comm.all_reduce(total, parallel.get_tensor_model_parallel_group())
    return int(total.item())


def gradient_norm(model: nn.Module, parallel: ParallelState) -> torch.Tensor:
    """Global 2-norm of the gradients, tensor-parallel shards included and replicated
    parameters counted once (what DeepSpeed clips): a 0-dim tensor on the gradients' device,
    read by the loop with its other end-of-step values in one transfer."""
    squares = [
        p.grad.detach().float().pow(2).sum()
        for p in model.parameters()
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p, parallel)
    ]
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if dist.is_initialized() and parallel.tp_size > 1:
        comm.all_reduce(total, parallel.get_tensor_model_parallel_group())
    return total.sqrt()


def reports_grad_norm(optimizer) -> bool:
    """Whether DeepSpeed reports the step's gradient norm (``get_global_grad_norm``): its own
    optimizer wrappers do; around a plain torch optimizer (ZeRO-0 fp32) it computes the norm
    to clip and discards it. Told by class: BF16_Optimizer (zero1_bf16) sets
    ``_global_grad_norm`` only in its first step (DeepSpeed 0.19 bf16_optimizer.py:400), not
    at construction as the other wrappers do, and its parameters' ``.grad`` holds only this
    rank's last micro-batch (the sum and the data-parallel average are in its fp32 buffers),
    so a norm of ``.grad`` there is not the step's."""
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

    return isinstance(optimizer, DeepSpeedOptimizer)


def unscaled_grad_norm(optimizer, norm: float | None, loss_scale: float) -> float | None:
    """The gradient norm to log, from DeepSpeed's report and the loss scale of the step's
    backward. DeepSpeed's FP16_UnfusedOptimizer (fp16 at ZeRO-0 around an optimizer it does not
    count as fused: torch's AdamW, fused or not, i.e. every GPU node without apex) reports the
    norm of the gradients still multiplied by the loss scale (2^16 at the start; its clipping
    divides by the scale itself); every other wrapper reports the unscaled norm."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if norm is None or not isinstance(optimizer, FP16_UnfusedOptimizer):
        return norm
    return norm / loss_scale


def norm_implementations(model: nn.Module) -> list[str]:
    """The classes of the normalisation modules the model actually contains."""
    names = {
        f"{type(m).__module__}.{type(m).__name__}"
        for m in model.modules()
        if "Norm" in type(m).__name__
    }
    return sorted(names)


@dataclass
class Engine:
    model_engine: Any  # deepspeed.DeepSpeedEngine (DeepSpeed's name for it)
    optimizer_impl: str
    scheduler: AnnealingLR
    settings: DeepSpeedSettings

    @property
    def device(self) -> torch.device:
        return self.model_engine.device


def disable_deepspeed_shm_comm() -> None:
    """Keep DeepSpeed's CPU backend from JIT-building and starting its shared-memory
    all-reduce. That op serves only DeepSpeed's inference all-reduce (training reduces through
    torch.distributed), and it lives in /dev/shm segments named by master address, port and
    rank that a killed run leaves behind: a later run that draws the same port attaches to the
    stale flags and hangs, and the segments hold RAM. Call before deepspeed.initialize."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def agree_on_optimizer(mine: str) -> None:
    """Collective: every rank builds the same Adam (apex's or torch's: whether apex imports
    is a property of each node's install), or all stop with one line naming who differs."""
    from megatron_taco.checkpoint.rendezvous import describe_disagreement
    from megatron_taco.errors import ConfigError

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    problem = describe_disagreement(
        comm.all_gather_object((socket.gethostname(), mine)), "the Adam implementation"
    )
    if problem is not None:
        raise ConfigError(
            f"{problem} (apex with its CUDA extensions imports on some nodes only): install it "
            "on every node or on none"
        )


def accelerator_device_index() -> int:
    """The index of the device this rank chose (set_cuda_device, before the process group):
    the one DeepSpeed must use too."""
    from deepspeed.accelerator import get_accelerator

    return int(get_accelerator().current_device())


# Where DeepSpeed reads the device ordinal from the environment: its engine takes LOCAL_RANK
# unless given args.device_rank, ZeRO-3's zero.Init (built inside deepspeed.initialize) has no
# such argument, and the engine asserts Open MPI's local rank equals LOCAL_RANK.
_DEVICE_RANK_ENV = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


@contextlib.contextmanager
def deepspeed_device_env(index: int) -> Iterator[None]:
    """LOCAL_RANK (and Open MPI's copy) read as the device ``index`` while DeepSpeed builds
    its engine. DeepSpeed takes LOCAL_RANK for the device ordinal; with one GPU per task
    (``srun --gpus-per-task=1``) every rank's device is 0 whatever its LOCAL_RANK, and
    cuda:LOCAL_RANK is "invalid device ordinal" on every rank but the first. Restored after:
    the launcher's LOCAL_RANK keeps its meaning for everything else."""
    saved = {key: os.environ.get(key) for key in _DEVICE_RANK_ENV}
    # LOCAL_RANK even where the launcher set none (zero.Init would read it or assume 0);
    # Open MPI's only where it is set. Restored exactly, also when DeepSpeed raises or
    # writes them itself: a variable that was absent is removed again.
    os.environ.update(
        {k: str(index) for k, v in saved.items() if v is not None or k == "LOCAL_RANK"}
    )
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def initialize_engine(
    model: nn.Module,
    training: TrainingConfig,
    settings: DeepSpeedSettings,
    parallel: ParallelState,
) -> Engine:
    import deepspeed

    disable_deepspeed_shm_comm()
    # DeepSpeed's ZeRO calls torch.distributed.all_gather_into_tensor, which torch 2.13
    # deprecates in a FutureWarning on every rank at every run: nothing a user can act on.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
        category=FutureWarning,
    )

    agree_on_optimizer(optimizer_implementation())
    optimizer, impl = build_optimizer(model, training)
    scheduler = build_scheduler(optimizer, training)
    device = accelerator_device_index()
    with deepspeed_device_env(device):
        model_engine, _, _, ds_scheduler = deepspeed.initialize(
            # device_rank: the engine's own device (it ignores LOCAL_RANK then).
            args=SimpleNamespace(device_rank=device),
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            mpu=parallel,
            config=settings.config,
            dist_init_required=False,
        )
    if ds_scheduler is not scheduler:
        raise RuntimeError("DeepSpeed replaced the LR scheduler; remove 'scheduler' from the JSON")
    return Engine(
        model_engine=model_engine, optimizer_impl=impl, scheduler=scheduler, settings=settings
    )


def release_engine(engine: Engine | None) -> None:
    """Undo what ties a run's engine to the process: DeepSpeed's ZeRO-1/2 optimizers register
    a gradient hook on every parameter whose closure holds the optimizer, and through it the
    engine, the model, the fp32 masters and the gradient buckets; nothing else drops them, so
    without this every run of a sweep in one process keeps its predecessors' memory (on a GPU,
    weights, Adam states and buckets). ``release_memory`` then frees them."""
    if engine is not None:
        engine.model_engine.destroy()


def release_memory() -> None:
    """After a run whose engine was released, once the run's frames are gone: collect its
    reference cycles (module <-> hooks) and hand the cached CUDA blocks back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
    }

"""Checkpoints: Megatron's directory layout around DeepSpeed's checkpoint files.

    {save}/latest_checkpointed_iteration.txt   the iteration to resume from (written last)
    {save}/iter_0000300/                       DeepSpeed's files (model, ZeRO optimizer
                                               partitions, LR scheduler, client state)
        metadata.json                          iteration, consumed samples, configs, sizes
        rng_state_rank_00000.pt ...            one per global rank

The tracker is replaced atomically only after a barrier, i.e. once every rank's files are
on disk, so a crash at any point leaves "latest" naming a complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_taco.arguments import ConfigError
from megatron_taco.parallel.random import RNGTracker
from megatron_taco.parallel.state import ParallelState

logger = logging.getLogger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
METADATA_FILENAME = "metadata.json"
FORMAT = "megatron_taco/1"


@dataclass
class TrainingState:
    iteration: int = 0
    consumed_samples: int = 0
    # Each training callback's state_dict(), by callback name (metadata.json "callbacks").
    callback_states: dict[str, Any] = field(default_factory=dict)


def checkpoint_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def tracker_path(directory: str) -> str:
    return os.path.join(directory, TRACKER_FILENAME)


def rng_state_path(iter_dir: str, rank: int) -> str:
    return os.path.join(iter_dir, f"rng_state_rank_{rank:05d}.pt")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_torch_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def get_rng_states(rng_tracker: RNGTracker | None) -> dict[str, Any]:
    # numpy's legacy global state on purpose: it is what third-party code draws from.
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": rng_tracker.get_states() if rng_tracker is not None else None,
    }


def set_rng_states(states: dict[str, Any], rng_tracker: RNGTracker | None) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])  # noqa: NPY002
    torch.set_rng_state(states["torch_cpu"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if rng_tracker is not None and states.get("tracker") is not None:
        rng_tracker.set_states(states["tracker"])


def save_checkpoint(
    engine,
    save_dir: str,
    state: TrainingState,
    parallel: ParallelState,
    rng_tracker: RNGTracker | None = None,
    metadata: dict[str, Any] | None = None,
) -> str:
    """Collective: every rank must call it. Returns the iteration directory."""
    tag = checkpoint_tag(state.iteration)
    iter_dir = os.path.join(save_dir, tag)
    if parallel.rank == 0:
        os.makedirs(iter_dir, exist_ok=True)
    _barrier()
    client_state = {
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "format": FORMAT,
    }
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    _atomic_torch_save(get_rng_states(rng_tracker), rng_state_path(iter_dir, parallel.rank))
    if parallel.rank == 0:
        meta = {
            "format": FORMAT,
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            "world_size": parallel.world_size,
            "tensor_model_parallel_size": parallel.tp_size,
            "data_parallel_size": parallel.dp_size,
            **(metadata or {}),
        }
        _atomic_write_text(
            os.path.join(iter_dir, METADATA_FILENAME), json.dumps(meta, indent=2, default=str)
        )
    # Every rank's files are on disk before "latest" may point at them.
    _barrier()
    if parallel.rank == 0:
        _atomic_write_text(tracker_path(save_dir), f"{state.iteration}\n")
    _barrier()
    return iter_dir


_SIZE_MISMATCH = re.compile(
    r"size mismatch for (\S+): copying a param with shape (torch\.Size\(\[[^\]]*\]\)) from "
    r"checkpoint, the shape in current model is (torch\.Size\(\[[^\]]*\]\))"
)


def _shape_mismatch_error(error: RuntimeError, iter_dir: str) -> Exception:
    """A checkpoint of another architecture: one line naming the first mismatched parameter
    (DeepSpeed re-raises torch's multi-line load_state_dict error) instead of a traceback."""
    found = _SIZE_MISMATCH.findall(str(error))
    if not found:
        return error
    name, saved, current = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return ConfigError(
        f"--load: {iter_dir} was saved by a model of another shape: {name} is {saved} there "
        f"and {current} here{more}. Model flags must match the checkpoint's (its "
        "metadata.json lists them); TACO checkpoints written before the value heads became "
        "d_WE/h_WE and d_PE/h_PE wide load with --we-value-channels and --pe-value-channels "
        "set to their --kv-channels"
    )


def read_tracker(load_dir: str) -> int | None:
    path = tracker_path(load_dir)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise ConfigError(
            f"--load: {path} must hold an iteration number, got {text[:40]!r}"
        ) from None
    if iteration < 0:
        raise ConfigError(f"--load: {path} holds a negative iteration {iteration}")
    return iteration


def load_checkpoint(
    engine,
    load_dir: str,
    parallel: ParallelState,
    rng_tracker: RNGTracker | None = None,
    *,
    ckpt_step: int | None = None,
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
) -> TrainingState | None:
    """Restore model (+ optimizer, scheduler, RNG, data position) from ``load_dir``.

    Returns None (after a warning) when ``load_dir`` has no tracker file and no
    ``ckpt_step`` is given: Megatron then starts from scratch. With ``finetune`` only the
    model weights are loaded and the returned state is iteration 0.
    """
    if ckpt_step is not None:
        iteration = ckpt_step
    else:
        iteration = read_tracker(load_dir)
        if iteration is None:
            if parallel.rank == 0:
                logger.warning(
                    "--load %s: no %s found, training from scratch", load_dir, TRACKER_FILENAME
                )
            return None
    tag = checkpoint_tag(iteration)
    iter_dir = os.path.join(load_dir, tag)
    if not os.path.isdir(iter_dir):
        source = "--ckpt-step" if ckpt_step is not None else tracker_path(load_dir)
        raise ConfigError(
            f"--load: checkpoint directory {iter_dir} (iteration {iteration} from {source}) "
            "does not exist"
        )
    meta_path = os.path.join(iter_dir, METADATA_FILENAME)
    meta: dict[str, Any] = {}
    if os.path.isfile(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    saved_tp = meta.get("tensor_model_parallel_size")
    if saved_tp is not None and saved_tp != parallel.tp_size:
        raise ConfigError(
            f"--tensor-model-parallel-size: {iter_dir} was saved with tensor parallel size "
            f"{saved_tp}, this run uses {parallel.tp_size}"
        )
    restore_optim = load_optim and not finetune
    try:
        load_path, client_state = engine.load_checkpoint(
            load_dir,
            tag=tag,
            load_optimizer_states=restore_optim,
            load_lr_scheduler_states=restore_optim,
            load_module_only=finetune,
        )
    except RuntimeError as e:
        raise _shape_mismatch_error(e, iter_dir) from None
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {iter_dir}")
    scheduler = getattr(engine, "lr_scheduler", None)
    if restore_optim and hasattr(scheduler, "apply"):
        # DeepSpeed restores ZeRO optimizer states (param-group lrs included) after the
        # scheduler; make the lr the schedule's for the restored step.
        scheduler.apply()
    if finetune:
        return TrainingState(0, 0)
    client_state = client_state or {}
    state = TrainingState(
        iteration=int(client_state.get("iteration", iteration)),
        consumed_samples=int(client_state.get("consumed_samples", meta.get("consumed_samples", 0))),
        callback_states=dict(meta.get("callbacks", {})),
    )
    if load_rng:
        path = rng_state_path(iter_dir, parallel.rank)
        if not os.path.isfile(path):
            raise ConfigError(
                f"--load: {path} does not exist (the checkpoint was saved with world size "
                f"{meta.get('world_size', '?')}, this run has {parallel.world_size}); "
                "pass --no-load-rng to resume without the RNG states"
            )
        # Our own file with python/numpy states in it: not loadable with weights_only.
        set_rng_states(torch.load(path, weights_only=False), rng_tracker)
    _barrier()
    return state

"""Loading the checkpoint a ResumePlan names: every rank checks that its model states file fits
the model before DeepSpeed reads anything, then DeepSpeed's files are read with
weights_only=True (through SafeCheckpointEngine), the RNG states restored, and the training
state returned. A checkpoint that verifies but does not fit the model falls back, with
--load-fallback, to the newest older one that fits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from megatron_taco import io
from megatron_taco.checkpoint.deepspeed_files import model_states_name
from megatron_taco.checkpoint.engine import safe_engine
from megatron_taco.checkpoint.errors import CheckpointInvalid, CheckpointMisfit
from megatron_taco.checkpoint.layout import (
    METADATA_FILENAME,
    TrainingState,
    checkpoint_tag,
    rng_state_path,
    tracker_path,
)
from megatron_taco.checkpoint.manifest import read_metadata
from megatron_taco.checkpoint.plan import (
    FALLBACK,
    READ,
    RESUME,
    WEIGHTS,
    Candidate,
    ResumePlan,
    ResumeRequest,
    newest_verified,
)
from megatron_taco.checkpoint.rng import load_rng_file, set_rng_states
from megatron_taco.checkpoint.safe_files import safe_torch_load
from megatron_taco.errors import ConfigError
from megatron_taco.parallel import comm
from megatron_taco.parallel.random import RNGTracker
from megatron_taco.parallel.state import ParallelState

logger = logging.getLogger(__name__)


def _few(names: list[str]) -> str:
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def _shapes_differ_hint(iter_dir: str, wrong: list[tuple[str, Any, Any]]) -> str:
    name, saved, current = wrong[0]
    more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    return (
        f"--load: {iter_dir} was saved by a model of another shape: {name} is {saved} there "
        f"and {current} here{more}. Model flags must match the checkpoint's (its "
        "metadata.json lists them); TACO checkpoints written before the value heads became "
        "d_WE/h_WE and d_PE/h_PE wide load with --we-value-channels and --pe-value-channels "
        "set to their --kv-channels"
    )


def checkpoint_misfit(engine, path: str, iter_dir: str) -> tuple[str, Any] | None:
    """None when the model states file ``path`` (this rank's) holds a tensor of the right
    shape for every entry of the model's state dict and nothing else; else (one line naming
    the first few keys that are missing, unexpected or of another shape, what differs). What
    differs is the same for every checkpoint when it is the model's doing (its flags); a
    damaged file's is its path, never the same."""
    try:
        states = safe_torch_load(path, mmap=True)
    except ConfigError as e:
        return str(e), path
    module = states.get("module") if isinstance(states, dict) else None
    if not isinstance(module, dict):
        found = sorted(map(str, states))[:5] if isinstance(states, dict) else []
        return (
            f"--load: {path} holds no 'module' state dict (found {type(states).__name__} "
            f"{', '.join(found)}): not a model states file"
        ), path
    # ZeRO-3 partitions parameters (and saves them empty): their names are compared only.
    own = {
        k: None if hasattr(v, "ds_shape") else v.shape
        for k, v in engine.module.state_dict(keep_vars=True).items()
    }
    missing = [k for k in own if k not in module]
    unexpected = [k for k in module if k not in own]
    wrong = [
        (k, module[k].shape if torch.is_tensor(module[k]) else type(module[k]).__name__, own[k])
        for k in own
        if k in module
        and own[k] is not None
        and not (torch.is_tensor(module[k]) and module[k].shape == own[k])
    ]
    how = (tuple(missing), tuple(unexpected), tuple(wrong))
    if not (missing or unexpected):
        return (_shapes_differ_hint(iter_dir, wrong), how) if wrong else None
    parts = [f"it lacks {_few(missing)}"] if missing else []
    if unexpected:
        parts.append(f"it has {_few(unexpected)}, which this model does not")
    if wrong:
        verb = "has another shape" if len(wrong) == 1 else "have other shapes"
        parts.append(f"{_few([k for k, _, _ in wrong])} {verb} there")
    return f"--load: {path} does not fit this model: {'; '.join(parts)}", how


def _agree_on_fit(engine, load_dir: str, iteration: int, parallel: ParallelState) -> None:
    """Collective: every rank checks its own model states file before DeepSpeed loads any;
    a misfit on one rank stops every rank with the first rank's line."""
    iter_dir = os.path.join(load_dir, checkpoint_tag(iteration))
    dp_rank = parallel.dp_rank if engine.zero_optimization_partition_weights() else None
    path = os.path.join(iter_dir, model_states_name(parallel.tp_rank, dp_rank))
    problem = checkpoint_misfit(engine, path, iter_dir)
    found = comm.all_gather_object(problem)
    first = next((p for p in found if p is not None), None)
    if first is not None:
        raise CheckpointMisfit(first[0], how=tuple(p and p[1] for p in found))


def _agreed_newest_verified(
    load_dir: str, below: int, parallel: ParallelState, models: tuple[str, ...] | None
) -> tuple[int, str] | None:
    """Collective: newest_verified as global rank 0 finds it (every byte read once, not once
    per rank), the one choice every rank takes; each rank then reads that checkpoint's
    metadata.json, and one that sees another (a stale network-file-system view) or none
    stops every rank with its line, rather than ranks loading different iterations."""
    found: tuple[str, Any] | None = None
    if parallel.rank == 0:
        try:
            value = newest_verified(load_dir, below, tp_size=parallel.tp_size, models=models)
            found = ("choice", value)
        except ConfigError as e:
            found = ("error", str(e))
    parallel.file_barrier()  # rank 0 may read for long: not within a collective's timeout
    kind, value = comm.broadcast_object(found)
    if kind == "error":
        raise ConfigError(value)
    problem = None
    if value is not None:
        iteration, checksum = value
        try:
            seen = read_metadata(os.path.join(load_dir, checkpoint_tag(iteration)))["checksum"]
            if seen != checksum:
                problem = f"its {METADATA_FILENAME} has checksum {seen}, rank 0's {checksum}"
        except ConfigError as e:
            problem = str(e)
    for other, seen in enumerate(comm.all_gather_object(problem)):
        if seen is not None:
            raise ConfigError(
                f"--load-fallback: rank 0 chose iteration {value[0]}, which rank "
                f"{other} sees otherwise ({seen}): the ranks see different files in --load "
                "(a stale network-file-system view?)"
            )
    return value


def load_checkpoint(
    engine,
    load_dir: str,
    iteration: int,
    parallel: ParallelState,
    rng_tracker: RNGTracker | None = None,
    *,
    restore_optimizer: bool = True,
    restore_rng: bool = True,
    weights_only: bool = False,
) -> TrainingState:
    """Collective: restore iteration ``iteration`` of ``load_dir``: the model (+ optimizer and
    scheduler with ``restore_optimizer``, RNG states with ``restore_rng``, the data
    position), or with ``weights_only`` the model weights alone (the state is iteration 0).
    plan_resume verified the checkpoint before any process group existed (and refused one of
    another tensor-parallel size); every file is read with weights_only=True regardless."""
    tag = checkpoint_tag(iteration)
    iter_dir = os.path.join(load_dir, tag)
    meta = read_metadata(iter_dir)
    restore_optimizer = restore_optimizer and not weights_only
    if not restore_optimizer and engine.zero_optimization_partition_weights():
        # DeepSpeed would rebuild the weights through zero_to_fp32's unrestricted torch.load.
        raise ConfigError(
            "--finetune/--no-load-optim: not supported with ZeRO stage 3; load with a ZeRO "
            "stage 0-2 config"
        )
    safe_engine(engine)
    _agree_on_fit(engine, load_dir, iteration, parallel)
    load_path, client_state = engine.load_checkpoint(
        load_dir,
        tag=tag,
        load_optimizer_states=restore_optimizer,
        load_lr_scheduler_states=restore_optimizer,
        load_module_only=weights_only,
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {iter_dir}")
    scheduler = getattr(engine, "lr_scheduler", None)
    if restore_optimizer and hasattr(scheduler, "apply"):
        # DeepSpeed restores ZeRO optimizer states (param-group lrs included) after the
        # scheduler; make the lr the schedule's for the restored step.
        scheduler.apply()
    if weights_only:
        return TrainingState(0, 0)
    client_state = client_state or {}
    state = TrainingState(
        iteration=int(client_state.get("iteration", iteration)),
        consumed_samples=int(client_state.get("consumed_samples", meta.get("consumed_samples", 0))),
        callback_states=dict(meta.get("callbacks", {})),
    )
    if restore_rng:
        path = rng_state_path(iter_dir, parallel.rank)
        if not os.path.isfile(path):
            raise ConfigError(
                f"--load: {path} does not exist (the checkpoint was saved with world size "
                f"{meta.get('world_size', '?')}, this run has {parallel.world_size}); "
                "pass --no-load-rng to resume without the RNG states"
            )
        set_rng_states(load_rng_file(path), rng_tracker)
    comm.barrier()
    return state


def execute_plan(
    engine,
    plan: ResumePlan,
    request: ResumeRequest,
    parallel: ParallelState,
    rng_tracker: RNGTracker | None = None,
) -> tuple[TrainingState, ResumePlan]:
    """Collective: load what ``plan`` names; returns the restored state and the plan that
    was carried out. A checkpoint whose tensors do not fit the model is one line naming
    the last complete checkpoint before it that fits, or with --load-fallback that one is
    loaded instead (after ``request.check``), as for a checkpoint that does not verify.
    Every rank takes the same path: the misfit is agreed on, and the ranks see the same
    files (rendezvous.agree_on_load). A fall-back within --save makes the tracker name the
    checkpoint loaded: a requeue before the next save, or a run with nothing left to train,
    then resumes it without --load-fallback."""
    if not plan.loads or plan.action == READ:
        return TrainingState(), plan
    kw = dict(
        restore_optimizer=plan.restore_optimizer,
        restore_rng=plan.restore_rng,
        weights_only=plan.action == WEIGHTS,
    )
    load_dir = plan.load_dir
    try:
        state = load_checkpoint(engine, load_dir, plan.iteration, parallel, rng_tracker, **kw)
    except CheckpointMisfit as misfit:
        older = _older_fitting(engine, load_dir, plan.iteration, misfit, parallel, request.models)
        if not request.checkpoint.load_fallback:
            raise CheckpointInvalid(
                f"{misfit}; the last complete checkpoint there is iteration {older[0]}: pass "
                f"--ckpt-step {older[0]}, or --load-fallback to fall back automatically"
            ) from None
        if parallel.rank == 0:
            logger.warning("%s; --load-fallback: loading iteration %d instead", misfit, older[0])
        meta = read_metadata(os.path.join(load_dir, checkpoint_tag(older[0])))
        request.check(Candidate(load_dir, older[0], meta))
        resumed = f"resumed from {load_dir} at iteration {older[0]} (--load-fallback)"
        state = load_checkpoint(engine, load_dir, older[0], parallel, rng_tracker, **kw)
        plan = dataclasses.replace(
            plan,
            action=FALLBACK if plan.action == RESUME else plan.action,
            iteration=older[0],
            checksum=older[1],
            note=plan.note if plan.action == WEIGHTS else resumed,  # --finetune: iteration 0
            warning=None,  # warned above
        )
    if plan.action == FALLBACK and request.checkpoint.resumes_save:
        if parallel.rank == 0:
            io.atomic_write(tracker_path(load_dir), f"{plan.iteration}\n")
        parallel.file_barrier()
    return state, plan


def _older_fitting(
    engine,
    load_dir: str,
    below: int,
    misfit: CheckpointMisfit,
    parallel: ParallelState,
    models: tuple[str, ...] | None,
) -> tuple[int, str]:
    """Collective: the newest checkpoint before ``below`` that verifies and fits the model.
    One that misfits as ``misfit`` does shows the model is not theirs (its flags differ):
    the walk stops there, before it verifies every byte of every checkpoint to say so."""
    while True:
        older = _agreed_newest_verified(load_dir, below, parallel, models)
        if older is None:
            raise CheckpointInvalid(
                f"{misfit}; no older checkpoint in {load_dir} verifies and fits this model"
            )
        try:
            _agree_on_fit(engine, load_dir, older[0], parallel)
            return older
        except CheckpointMisfit as e:
            if e.how == misfit.how:
                raise ConfigError(
                    f"{misfit}; iteration {older[0]} before it does not fit in the same "
                    "way: this model is not the one these checkpoints were saved from"
                ) from None
        below = older[0]

"""Saving (every rank): all files go to ``iter_0000300.tmp-<token>`` and are fsynced; rank 0
writes metadata.json with the manifest last, renames the directory into place (swapping it
atomically with an existing ``iter_0000300``, e.g. after a --ckpt-step rollback, so the
directory the tracker names is never half-written), fsyncs, and only then replaces the
tracker. A write that fails (a full disk) fails the whole save on every rank: the partial
directory is removed and the tracker keeps naming the previous checkpoint.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
from typing import Any

import torch
import torch.distributed as dist

from megatron_taco import io
from megatron_taco.checkpoint.engine import SafeCheckpointEngine, describe_write_error, safe_engine
from megatron_taco.checkpoint.errors import CheckpointSaveError
from megatron_taco.checkpoint.layout import (
    FORMAT,
    LEFTOVER,
    METADATA_FILENAME,
    TrainingState,
    checkpoint_tag,
    complete_iterations,
    read_tracker_quietly,
    rng_state_path,
    tracker_path,
)
from megatron_taco.checkpoint.manifest import manifest_entry, relative_files, write_metadata
from megatron_taco.checkpoint.rng import get_rng_states
from megatron_taco.checkpoint.safe_files import UnsafeFile
from megatron_taco.parallel import comm
from megatron_taco.parallel.random import RNGTracker
from megatron_taco.parallel.state import ParallelState
from megatron_taco.runtime.faults import hook_point

logger = logging.getLogger(__name__)


_RENAME_EXCHANGE = 2  # linux/fs.h


class _NoExchange(Exception):
    pass


def _exchange(a: str, b: str) -> None:
    """Swap two directories atomically (renameat2 RENAME_EXCHANGE: Linux 3.15+, on ext4,
    xfs, btrfs, tmpfs; not on NFS)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise _NoExchange("the C library has no renameat2")
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
            raise _NoExchange(os.strerror(code))
        raise OSError(code, os.strerror(code), a)


def _publish(save_dir: str, tmp_dir: str, iteration: int, token: str) -> str | None:
    """Move the complete checkpoint in ``tmp_dir`` to its name without a moment in which the
    tracker names a missing or partial directory. Returns a directory left to delete."""
    final = os.path.join(save_dir, checkpoint_tag(iteration))
    if not os.path.lexists(final):
        os.rename(tmp_dir, final)
        return None
    try:
        _exchange(tmp_dir, final)
        return tmp_dir  # now holds the replaced checkpoint
    except _NoExchange as e:
        reason = str(e)
    # Without an atomic swap: while iter_N is briefly absent the tracker must name another
    # complete checkpoint.
    if read_tracker_quietly(save_dir) == iteration:
        others = [i for i in complete_iterations(save_dir) if i != iteration]
        if not others:
            raise CheckpointSaveError(
                f"cannot replace {final} safely: this file system cannot swap directories "
                f"atomically ({reason}) and {save_dir} holds no other complete checkpoint for "
                "the tracker to name meanwhile; save to a new --save directory"
            )
        io.atomic_write(tracker_path(save_dir), f"{others[-1]}\n")
    aside = f"{final}.del-{token}"
    os.rename(final, aside)
    os.rename(tmp_dir, final)
    return aside


def _retire(save_dir: str, keep: int, token: str) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (never the tracker's)."""
    tracked = read_tracker_quietly(save_dir)

    def saved_at(iteration: int) -> tuple[float, int]:
        path = os.path.join(save_dir, checkpoint_tag(iteration), METADATA_FILENAME)
        return os.path.getmtime(path), iteration

    newest_first = sorted(complete_iterations(save_dir), key=saved_at, reverse=True)
    for iteration in newest_first[keep:]:
        if iteration == tracked:
            continue
        path = os.path.join(save_dir, checkpoint_tag(iteration))
        # Renamed first: a directory deleted halfway must not look like a checkpoint.
        aside = f"{path}.del-{token}"
        os.rename(path, aside)
        io.remove(aside)


def _shared_token(device: torch.device) -> str:
    """A random name part, the same on every rank (DeepSpeed checks the tag is)."""
    value = torch.tensor([secrets.randbits(48)], dtype=torch.int64, device=device)
    if dist.is_initialized():
        comm.broadcast(value, src=0)
    return f"{int(value.item()):012x}"


def _start_save(save_dir: str, tmp_dir: str, sweep: bool) -> None:
    os.makedirs(save_dir, exist_ok=True)
    if sweep:
        for name in os.listdir(save_dir):
            if LEFTOVER.match(name):
                io.remove(os.path.join(save_dir, name))
    os.makedirs(tmp_dir)


def _own_manifest(writer: SafeCheckpointEngine, tmp_dir: str) -> dict[str, dict]:
    """Size and CRC-32 of the files this rank wrote (read back from the page cache)."""
    entries = {}
    for path in writer.written:
        name = os.path.relpath(path, tmp_dir).replace(os.sep, "/")
        if not name.startswith("../"):
            writer.attempt(path, lambda p=path, n=name: entries.__setitem__(n, manifest_entry(p)))
    return entries


def _finalize(
    save_dir: str,
    tmp_dir: str,
    meta: dict,
    files: dict,
    token: str,
    retain: int | None,
    clean_up: bool = True,
) -> str | None:
    """Rank 0, once every rank's files are on disk: manifest, rename, tracker, clean-up
    (unless ``clean_up`` is off: the next save's, maybe the next run's, does it).
    Raises (OSError, CheckpointSaveError) while the save can still fail as a whole; once the
    tracker names the new checkpoint the save has succeeded, and a failing clean-up is
    returned as a warning instead."""
    iteration = meta["iteration"]
    for name in sorted(relative_files(tmp_dir) - set(files)):  # written by other means
        path = os.path.join(tmp_dir, *name.split("/"))
        io.fsync_file(path)
        files[name] = manifest_entry(path)
    for root, _dirs, _names in os.walk(tmp_dir, topdown=False):
        io.fsync_dir(root)
    write_metadata(tmp_dir, meta, files)
    io.fsync_dir(tmp_dir)
    hook_point("after_metadata", iteration)
    replaced = _publish(save_dir, tmp_dir, iteration, token)
    io.fsync_dir(save_dir)
    hook_point("after_rename", iteration)
    tmp_tracker = f"{tracker_path(save_dir)}.tmp.{os.getpid()}"
    io.write_durably(tmp_tracker, lambda f: f.write(f"{iteration}\n".encode()))
    os.replace(tmp_tracker, tracker_path(save_dir))
    # Published: from here on nothing may turn the save into a failure.
    try:
        io.fsync_dir(save_dir)
        hook_point("after_tracker", iteration)
        if replaced is not None and clean_up:  # else a leftover, swept by the next save
            io.remove(replaced)
        if retain is not None and clean_up:
            _retire(save_dir, retain, token)
    except OSError as e:
        return (
            f"saved checkpoint iteration {iteration} (latest), but removing older checkpoints "
            f"in {save_dir} failed: {e.filename or save_dir}: {e.strerror or e}; training "
            "goes on (remove them by hand)"
        )
    return None


def save_checkpoint(
    engine,
    save_dir: str,
    state: TrainingState,
    parallel: ParallelState,
    rng_tracker: RNGTracker | None = None,
    metadata: dict[str, Any] | None = None,
    *,
    retain: int | None = None,
    clean_up: bool = True,
) -> str:
    """Collective: every rank must call it. Returns the checkpoint directory; a failed write
    on any rank raises CheckpointSaveError on every rank, the previous checkpoint intact.
    ``clean_up`` off (an exit's save, which must fit in a grace time): no leftovers swept,
    no old checkpoint removed; the next save does it, in this run or the next. The others
    wait for rank 0's file-system work on the file group's barrier (its own timeout)."""
    writer = safe_engine(engine)
    writer.begin()
    iteration = state.iteration
    token = _shared_token(engine.device)
    tmp_dir = os.path.join(save_dir, f"{checkpoint_tag(iteration)}.tmp-{token}")
    if parallel.rank == 0:
        writer.attempt(tmp_dir, _start_save, save_dir, tmp_dir, clean_up)
    parallel.file_barrier()
    client_state = {
        "iteration": iteration,
        "consumed_samples": state.consumed_samples,
        "format": FORMAT,
    }
    tmp_tag = os.path.basename(tmp_dir)
    engine.save_checkpoint(save_dir, tag=tmp_tag, client_state=client_state, save_latest=False)
    hook_point("after_model_files", iteration)
    writer.save(get_rng_states(rng_tracker), rng_state_path(tmp_dir, parallel.rank))
    hook_point("after_rng_files", iteration)
    gathered = comm.all_gather_object((writer.error, _own_manifest(writer, tmp_dir)))
    message = warning = None
    if parallel.rank == 0:
        error = next((err for err, _ in gathered if err is not None), None)
        if error is None:
            meta = {
                "format": FORMAT,
                "iteration": iteration,
                "consumed_samples": state.consumed_samples,
                "world_size": parallel.world_size,
                "tensor_model_parallel_size": parallel.tp_size,
                "data_parallel_size": parallel.dp_size,
                **(metadata or {}),
            }
            files = {name: entry for _, entries in gathered for name, entry in entries.items()}
            error, warning = _attempt_finalize(
                save_dir, tmp_dir, meta, files, token, retain, clean_up
            )
        if error is not None:
            io.remove(tmp_dir)
            message = _save_failure(save_dir, iteration, error)
    parallel.file_barrier()
    message, warning = comm.broadcast_object((message, warning))
    if message is not None:
        raise CheckpointSaveError(message)
    if warning is not None and parallel.rank == 0:
        logger.warning(warning)
    return os.path.join(save_dir, checkpoint_tag(iteration))


def _attempt_finalize(save_dir, tmp_dir, meta, files, token, retain, clean_up):
    """(error that fails the save, warning about a clean-up after it succeeded)."""
    try:
        return None, _finalize(save_dir, tmp_dir, meta, files, token, retain, clean_up)
    except CheckpointSaveError as e:
        return str(e), None
    except OSError as e:
        return describe_write_error(e.filename or tmp_dir, e), None
    except UnsafeFile as e:  # something not a regular file in our own temporary directory
        return str(e), None


def _save_failure(save_dir: str, iteration: int, error: str) -> str:
    tracked = read_tracker_quietly(save_dir)
    still = (
        f"{tracker_path(save_dir)} still names iteration {tracked}"
        if tracked is not None
        else f"{save_dir} holds no earlier checkpoint"
    )
    return (
        f"saving checkpoint iteration {iteration} failed: {error}; the partial checkpoint was "
        f"removed and {still}"
    )

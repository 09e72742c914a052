"""Where a checkpoint's files are, and what the tracker says: Megatron's directory layout around
DeepSpeed's checkpoint files.

    {save}/latest_checkpointed_iteration.txt   the iteration to resume from (written last)
    {save}/iter_0000300/                       DeepSpeed's files (model, ZeRO optimizer
                                               partitions, LR scheduler, client state)
        metadata.json                          iteration, consumed samples, configs, and the
                                               manifest: every other file's size and CRC-32
        rng_state_rank_00000.pt ...            one per global rank (tensors and numbers only)
    {save}/iter_0000300.tmp-<token>            a save in progress or crashed
    {save}/iter_0000300.del-<token>            a replaced or retired checkpoint being deleted
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_taco.checkpoint.errors import CheckpointUnreadable
from megatron_taco.checkpoint.safe_files import UnsafeFile, read_regular
from megatron_taco.errors import ConfigError

logger = logging.getLogger(__name__)


TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


METADATA_FILENAME = "metadata.json"


FORMAT = "megatron_taco/2"  # 2: manifest + metadata checksum, RNG states as tensors


ITER_DIR = re.compile(r"^iter_(\d{7,})$")


# A save in progress or crashed (.tmp-), or a replaced/retired checkpoint being deleted (.del-).
LEFTOVER = re.compile(
    r"^(iter_\d{7,}\.(tmp|del)-[0-9a-f]+|"
    + re.escape(TRACKER_FILENAME)
    + r"\.(tmp\.\d+|[A-Za-z0-9_]{8}\.tmp))$"  # _finalize's, io.atomic_write's
)


# Seconds before each retry of a read that failed with an I/O error (a network file
# system's transient EIO or ESTALE); after the last, CheckpointUnreadable.
IO_RETRY_DELAYS = (1.0, 5.0)


def retried_read(path: str, read: Callable[[], Any]) -> Any:
    """``read()``, retried on I/O errors; a missing file (FileNotFoundError) is raised at
    once: it is proven absent, not unreadable."""
    for delay in (*IO_RETRY_DELAYS, None):
        try:
            return read()
        except FileNotFoundError:
            raise
        except OSError as e:
            if delay is None:
                raise CheckpointUnreadable(
                    f"--load: {e.filename or path} cannot be read ({e.strerror or e}; "
                    f"{len(IO_RETRY_DELAYS) + 1} attempts): an I/O error is not a corrupt "
                    "checkpoint, so no older one is loaded instead; rerun once the file "
                    "system answers, or pass --ckpt-step N to load another on purpose"
                ) from None
            logger.warning("%s: %s; retrying in %g s", path, e.strerror or e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def format_version(name: Any) -> int | None:
    """2 for "megatron_taco/2"; None for anything else."""
    match = re.fullmatch(r"megatron_taco/(\d+)", name) if isinstance(name, str) else None
    return int(match.group(1)) if match else None


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


def complete_iterations(directory: str) -> list[int]:
    """Iterations with a checkpoint directory holding metadata.json (written last, so present
    only in checkpoints that were complete when renamed into place), ascending."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        match = ITER_DIR.match(name)
        if match and os.path.isfile(os.path.join(directory, name, METADATA_FILENAME)):
            found.append(int(match.group(1)))
    return sorted(found)


def read_tracker(load_dir: str) -> int | None:
    path = tracker_path(load_dir)
    if not os.path.lexists(path):
        return None
    try:
        raw = retried_read(path, lambda: read_regular(path, 64))
        text = raw.decode("utf-8").strip()
    except UnsafeFile as e:
        raise ConfigError(f"--load: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--load: cannot read {path}: {e}") from None
    try:
        iteration = int(text)
    except ValueError:
        raise ConfigError(
            f"--load: {path} must hold an iteration number, got {text[:40]!r}"
        ) from None
    if iteration < 0:
        raise ConfigError(f"--load: {path} holds a negative iteration {iteration}")
    return iteration


def read_tracker_quietly(directory: str) -> int | None:
    try:
        return read_tracker(directory)
    except ConfigError:
        return None


def existing_checkpoints(directory: str) -> str | None:
    """What checkpoints ``directory`` already holds ("checkpoints up to iteration 4"), None
    when it holds none: a tracker (even one that cannot be read) or a complete checkpoint."""
    complete = complete_iterations(directory)
    if not complete and not os.path.lexists(tracker_path(directory)):
        return None
    tracked = read_tracker_quietly(directory)
    newest = max([*complete, *([] if tracked is None else [tracked])], default=None)
    return "checkpoints" if newest is None else f"checkpoints up to iteration {newest}"


def last_complete_checkpoint(save_dir: str) -> str:
    """A clause for the line of a rank that abandons a save: what a resume will load."""
    tracked = read_tracker_quietly(save_dir)
    if tracked is None:
        return f"{save_dir} holds no complete checkpoint (no readable {TRACKER_FILENAME})"
    final = os.path.join(save_dir, checkpoint_tag(tracked))
    return f"the last complete checkpoint is {final} ({TRACKER_FILENAME} names it)"

"""Checkpoints: Megatron's directory layout around DeepSpeed's checkpoint files, written so
that no crash leaves "latest" naming a half-written checkpoint, and read so that nothing in a
checkpoint can run code.

    {save}/latest_checkpointed_iteration.txt   the iteration to resume from (written last)
    {save}/iter_0000300/                       DeepSpeed's files (model, ZeRO optimizer
                                               partitions, LR scheduler, client state)
        metadata.json                          iteration, consumed samples, configs, and the
                                               manifest: every other file's size and CRC-32
        rng_state_rank_00000.pt ...            one per global rank (tensors and numbers only)

Saving (every rank): all files go to ``iter_0000300.tmp-<token>`` and are fsynced; rank 0
writes metadata.json with the manifest last, renames the directory into place (swapping it
atomically with an existing ``iter_0000300``, e.g. after a --ckpt-step rollback, so the
directory the tracker names is never half-written), fsyncs, and only then replaces the
tracker. A write that fails (a full disk) fails the whole save on every rank: the partial
directory is removed and the tracker keeps naming the previous checkpoint.

Loading: before any process group exists, every rank verifies the checkpoint it will load
(metadata, manifest sizes and checksums, and that no .pt file pickles anything but tensors,
numbers, strings and DeepSpeed's few bookkeeping classes); the files are then read with
``torch.load(weights_only=True)``, DeepSpeed's through SafeCheckpointEngine.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import logging
import os
import pickle
import random
import re
import secrets
import shutil
import stat
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_taco.arguments import ConfigError, option, require
from megatron_taco.parallel import comm
from megatron_taco.parallel.random import RNGTracker
from megatron_taco.parallel.state import ParallelState
from megatron_taco.training.safe_files import (
    UnsafeFile,
    checksum_regular,
    kind_of,
    read_regular,
    regular_files,
)
from megatron_taco.training.signals import KILL_ENV, PAUSE_ENV, hook_point  # noqa: F401

logger = logging.getLogger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
METADATA_FILENAME = "metadata.json"
FORMAT = "megatron_taco/2"  # 2: manifest + metadata checksum, RNG states as tensors
RNG_FORMAT = 2
# The crash tests' hooks (signals.KILL_ENV, PAUSE_ENV) at the named points of a save, e.g.
# "after_metadata@4" (the save of iteration 4 only). Every rank passes after_model_files
# and after_rng_files; rank 0 alone after_metadata (complete, not yet renamed), after_rename
# (before the tracker) and after_tracker (before replaced or retired checkpoints are deleted).
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
# A save in progress or crashed (.tmp-), or a replaced/retired checkpoint being deleted (.del-).
_LEFTOVER = re.compile(
    r"^(iter_\d{7,}\.(tmp|del)-[0-9a-f]+|" + re.escape(TRACKER_FILENAME) + r"\.tmp\.\d+)$"
)


class RunError(RuntimeError):
    """A run stopped for a reason the user can act on (a full disk, a diverged loss): the
    driver prints the one-line message and exits 1, without a traceback."""


class CheckpointSaveError(RunError):
    pass


class CheckpointInvalid(ConfigError):
    """The checkpoint to load is incomplete or corrupt (an older one may still verify)."""


class CheckpointUnreadable(ConfigError):
    """The checkpoint cannot be read now (an I/O error other than a missing file, after
    retries: EIO, ESTALE...): not proven corrupt, so never fallen back from or skipped."""


class CheckpointTooNew(ConfigError):
    """Written by a newer version of megatron_taco: upgrade, never fall back from it."""


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


class CheckpointMisfit(CheckpointInvalid):
    """A checkpoint that verifies but whose tensors do not fit the model (found after the
    engine exists; --load-fallback falls back from it as from one that does not verify).
    ``how``: what differs, per rank; equal for two checkpoints the model misfits alike."""

    def __init__(self, message: str, how: Any = None) -> None:
        super().__init__(message)
        self.how = how


@dataclass(frozen=True)
class CheckpointConfig:
    save_retain: int | None = option(
        None,
        "Keep only the newest N complete checkpoints in --save (by save time), deleting older "
        "ones after each save; the one latest_checkpointed_iteration.txt names is never "
        "deleted. Default: keep all.",
        flag="--save-retain",
    )
    load_fallback: bool = option(
        False,
        "When the checkpoint --load's tracker names is missing, incomplete or corrupt, load "
        "the newest older checkpoint in --load that verifies instead of stopping.",
        flag="--load-fallback",
    )
    override_existing_checkpoints: bool = option(
        False,
        "Start anew in a --save that holds another run's checkpoints (which a run without "
        "--load naming --save refuses to do): they, and the stores they need (SAS: the "
        "replacement store), are moved aside into --save/superseded-<time>/ before the first "
        "save; nothing is deleted.",
        flag="--override-existing-checkpoints",
    )
    save_lock_flock_local: bool = option(
        False,
        "--save's file system keeps flock locks to each host (NFS with local_lock=flock, "
        "Lustre with -o localflock): a run.lock recorded by another host is then refused "
        "even when its lock is free, instead of taken over as a gone run's.",
        flag="--save-lock-flock-local",
    )

    def __post_init__(self) -> None:
        if self.save_retain is not None:
            require(
                isinstance(self.save_retain, int)
                and not isinstance(self.save_retain, bool)
                and self.save_retain >= 1,
                CheckpointConfig,
                "save_retain",
                f"must be an integer >= 1, got {self.save_retain!r}",
            )
        for name in ("load_fallback", "override_existing_checkpoints", "save_lock_flock_local"):
            value = getattr(self, name)
            require(isinstance(value, bool), CheckpointConfig, name,
                    f"must be true or false, got {value!r}")  # fmt: skip


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
        comm.barrier()


def _kill_point(point: str, iteration: int) -> None:
    hook_point(point, iteration)


# -- files ------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, write: Callable[[Any], None]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    _write_durably(tmp, lambda f: f.write(text.encode("utf-8")))
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def _free_space(path: str) -> str:
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "free space unknown"
    return f"{free / 2**20:.1f} MiB free there"


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind ``error``: torch.save reports a failed write of its zip writer as a
    RuntimeError whose context is the file object's OSError."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError):
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None


def _describe_write_error(path: str, error: OSError) -> str:
    return f"{path}: {error.strerror or error} ({_free_space(os.path.dirname(path) or '.')})"


def complete_iterations(directory: str) -> list[int]:
    """Iterations with a checkpoint directory holding metadata.json (written last, so present
    only in checkpoints that were complete when renamed into place), ascending."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        match = _ITER_DIR.match(name)
        if match and os.path.isfile(os.path.join(directory, name, METADATA_FILENAME)):
            found.append(int(match.group(1)))
    return sorted(found)


# -- RNG states -------------------------------------------------------------------------


def get_rng_states(rng_tracker: RNGTracker | None) -> dict[str, Any]:
    """Every RNG's state as tensors and numbers only, so that the file loads with
    weights_only=True. numpy's legacy global state on purpose: third-party code draws from it."""
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()  # noqa: NPY002
    return {
        "format": RNG_FORMAT,
        "python": {
            "version": version,
            "state": torch.tensor(mt, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(cached),
        },
        "torch_cpu": torch.get_rng_state(),
        # This rank's own device (the current one, set from LOCAL_RANK), not every visible
        # GPU by index: a resume with another ranks-per-node layout restores it there.
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": rng_tracker.get_states() if rng_tracker is not None else None,
    }


def set_rng_states(states: dict[str, Any], rng_tracker: RNGTracker | None) -> None:
    py, npy = states["python"], states["numpy"]
    random.setstate((int(py["version"]), tuple(py["state"].tolist()), py["gauss"]))
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, npy["pos"], npy["has_gauss"], npy["gauss"]))  # noqa: NPY002
    torch.set_rng_state(states["torch_cpu"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(own_cuda_state(states["cuda"], torch.cuda.current_device()))
    if rng_tracker is not None and states.get("tracker") is not None:
        foreign = rng_tracker.load_states(states["tracker"])
        if foreign:
            logger.warning(
                "--load: the RNG stream(s) %s were saved by a generator of another device type "
                "than this run's %s; they restart from their seed (dropout masks of split "
                "activations differ from an uninterrupted run's)",
                ", ".join(foreign),
                rng_tracker.device_type,
            )


def own_cuda_state(saved: Any, current_device: int) -> torch.Tensor:
    """The saved CUDA generator state of this rank's device: one tensor; checkpoints written
    before it was saved so held a list, every visible device's by index, of which this rank's
    was its current one (``current_device``: the same layout resumes it exactly; a device
    index past the list, after a layout change, takes one of them rather than failing)."""
    if torch.is_tensor(saved):
        return saved
    return saved[current_device % len(saved)]


def _load_rng_file(path: str) -> dict[str, Any]:
    states = safe_torch_load(path, hint="; pass --no-load-rng to resume without the RNG states")
    if not isinstance(states, dict) or states.get("format") != RNG_FORMAT:
        found = states.get("format") if isinstance(states, dict) else type(states).__name__
        raise ConfigError(
            f"--load: {path} is not an RNG state file of format {RNG_FORMAT} (found "
            f"{found!r}); pass --no-load-rng to resume without the RNG states"
        )
    return states


# -- safe loading -----------------------------------------------------------------------


def _deepspeed_safe_globals() -> list[type]:
    """The classes DeepSpeed pickles into its ZeRO optimizer files besides tensors and
    containers: plain attribute holders and an enum, harmless to rebuild."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _error_detail(error: BaseException) -> str:
    """The informative line of torch's multi-paragraph weights_only message."""
    noise = ("Weights only load failed", "Check the documentation", "Please file an issue")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(noise)]
    text = (useful or lines or [type(error).__name__])[-1]
    return text if len(text) <= 200 else text[:197] + "..."


def _exception_line(error: BaseException) -> str:
    """'KeyError: 5': a crafted pickle's KeyError or struct.error says little without its
    type."""
    detail = _error_detail(error)
    name = type(error).__name__
    return detail if detail == name else f"{name}: {detail}"


SAFE_TORCH = (2, 6)  # weights_only has a known bypass before (CVE-2025-32434)


def require_safe_torch() -> None:
    """Refuse to read a checkpoint with a torch whose weights_only loading is unsafe."""
    found = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if found < SAFE_TORCH:
        raise ConfigError(
            f"torch {torch.__version__}: loading checkpoints safely needs torch >= "
            f"{'.'.join(map(str, SAFE_TORCH))} (weights_only can be bypassed before); upgrade torch"
        )


def safe_torch_load(
    path: str, map_location: Any = "cpu", *, hint: str = "", mmap: bool = False
) -> Any:
    """torch.load with weights_only=True; any failure is one ConfigError naming the file
    (a crafted pickle can make the unpickler raise KeyError, IndexError, struct.error...)."""
    require_safe_torch()
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise ConfigError(
            f"--load: {path} holds pickled objects other than tensors, numbers and strings "
            f"({_error_detail(e)}); refusing to load it{hint}"
        ) from None
    except Exception as e:
        raise ConfigError(
            f"--load: {path} is not a readable checkpoint file ({_exception_line(e)}){hint}"
        ) from None


def unsafe_globals(path: str) -> list[str]:
    """The globals a torch zip file would import beyond the weights_only defaults and
    DeepSpeed's safe classes, found by reading its pickle's opcodes (nothing is executed)."""
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in _deepspeed_safe_globals()}
    found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    return [name for name in found if name not in allowed]


class SafeCheckpointEngine:
    """Mixed into DeepSpeed's TorchCheckpointEngine (_engine_class; deepspeed is imported only
    once a run starts): loads go through safe_torch_load; each file is fsynced; a write that
    fails (disk full) is recorded instead of raised, so every rank keeps to DeepSpeed's
    sequence of collectives and the save fails as a whole afterwards (save_checkpoint)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.zipfile_serialization = True  # the opcode scan and weights_only need zip files
        self.begin()

    def begin(self) -> None:
        self.written: list[str] = []
        self.error: str | None = None

    def attempt(self, path: str, fn: Callable[..., Any], *args: Any) -> None:
        if self.error is not None:
            return
        try:
            fn(*args)
        except Exception as e:  # re-raised below unless an OSError is behind it
            os_error = _os_error(e)
            if os_error is None:
                raise
            self.error = _describe_write_error(os_error.filename or path, os_error)
            if os.path.isfile(path):
                _remove(path)

    def save(self, state_dict: Any, path: str) -> None:
        def write() -> None:
            _write_durably(path, lambda f: torch.save(state_dict, f))
            self.written.append(path)

        self.attempt(path, write)

    def load(self, path: str, map_location: Any = None) -> Any:
        return safe_torch_load(path, map_location)


@functools.cache
def _engine_class() -> type:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return type("SafeTorchCheckpointEngine", (SafeCheckpointEngine, TorchCheckpointEngine), {})


def _safe_engine(engine) -> SafeCheckpointEngine:
    writer = getattr(engine, "checkpoint_engine", None)
    if isinstance(writer, SafeCheckpointEngine):
        return writer
    writer = _engine_class()()
    engine.checkpoint_engine = writer
    # DeepSpeed's rank 0 copies zero_to_fp32.py into --save with shutil at every ZeRO save;
    # a full disk there must fail the save like any other write, not raise on rank 0 alone.
    copy = getattr(engine, "_copy_recovery_script", None)
    if copy is not None:
        engine._copy_recovery_script = lambda path: writer.attempt(path, copy, path)
    return writer


# -- metadata and manifest --------------------------------------------------------------

_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_MAX_METADATA_BYTES = 64 << 20
# Every field a reader relies on, with its type: the required ones must be present, the
# others are checked where present. Nothing is optional that a check depends on, so that no
# missing key or null skips one.
_REQUIRED_FIELDS: dict[str, type] = {
    "format": str,
    "iteration": int,
    "consumed_samples": int,
    "world_size": int,
    "tensor_model_parallel_size": int,
    "data_parallel_size": int,
    "files": dict,
    "checksum": str,
}
_OPTIONAL_FIELDS: dict[str, type] = {
    "model": str,
    "configs": dict,
    "callbacks": dict,
    "epoch": int,
    "rng_states": bool,
    "converted_from": dict,
    "tokenizer": dict,  # the copy in --save (data/tokenizer.py saved_tokenizer_record)
}


def _metadata_checksum(meta: dict[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(text.encode('utf-8')):08x}"


def _write_metadata(iter_dir: str, meta: dict[str, Any], files: dict[str, dict]) -> None:
    # Round-tripped first so the checksum covers exactly what a reader will parse.
    body = json.loads(json.dumps({**meta, "files": files}, default=str))
    body["checksum"] = _metadata_checksum(body)
    text = json.dumps(body, indent=2)
    _write_durably(os.path.join(iter_dir, METADATA_FILENAME), lambda f: f.write(text.encode()))


def _has_type(value: Any, kind: type) -> bool:
    if kind is int:  # JSON true/false are not counts
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _check_schema(path: str, meta: dict[str, Any]) -> None:
    found = format_version(meta.get("format"))
    if found is not None and found > format_version(FORMAT):
        # Its fields and checks may differ: nothing else about it can be judged here.
        raise CheckpointTooNew(
            f"--load: {path} was written by a newer megatron_taco (format "
            f"{meta['format']!r}, this version reads {FORMAT!r}): upgrade megatron_taco to "
            "load it (no older checkpoint is loaded instead)"
        )
    for key in _REQUIRED_FIELDS:
        if key not in meta:
            raise CheckpointInvalid(f"{path} lacks the field {key!r}")
    for key, kind in {**_REQUIRED_FIELDS, **_OPTIONAL_FIELDS}.items():
        if key in meta and not _has_type(meta[key], kind):
            raise CheckpointInvalid(
                f"{path}: field {key!r} must be {kind.__name__}, got {meta[key]!r:.60}"
            )
    if meta["format"] != FORMAT:
        raise CheckpointInvalid(
            f"{path}: format {meta['format']!r:.40}, this version reads {FORMAT!r}"
        )
    if not _HEX8.match(meta["checksum"]):
        raise CheckpointInvalid(f"{path}: field 'checksum' must be 8 hex digits")
    sizes = [meta[k] for k in ("world_size", "tensor_model_parallel_size", "data_parallel_size")]
    if meta["iteration"] < 0 or meta["consumed_samples"] < 0 or min(sizes) < 1:
        raise CheckpointInvalid(f"{path}: negative iteration or samples, or a size below 1")
    if sizes[0] != sizes[1] * sizes[2]:
        raise CheckpointInvalid(
            f"{path}: world_size {sizes[0]} is not tp {sizes[1]} x dp {sizes[2]}"
        )


def read_metadata(iter_dir: str) -> dict[str, Any]:
    """metadata.json, read without following links, its schema and checksum checked."""
    path = os.path.join(iter_dir, METADATA_FILENAME)
    try:
        raw = retried_read(path, lambda: read_regular(path, _MAX_METADATA_BYTES + 1))
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path} is missing") from None
    except UnsafeFile as e:
        raise CheckpointInvalid(str(e)) from None
    if len(raw) > _MAX_METADATA_BYTES:
        raise CheckpointInvalid(f"{path} is larger than {_MAX_METADATA_BYTES >> 20} MiB")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointInvalid(f"{path} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointInvalid(f"{path} must hold a JSON object, got {type(meta).__name__}")
    _check_schema(path, meta)
    if meta["checksum"] != _metadata_checksum(meta):
        raise CheckpointInvalid(
            f"{path} does not match its checksum (it was changed or is corrupt)"
        )
    return meta


def check_model_kind(meta: dict[str, Any], where: str, accepted: tuple[str, ...]) -> None:
    """A checkpoint of another model (metadata.json's "model" against the names the running
    spec accepts): the first thing to tell the user, before any shape or layout mismatch
    it would otherwise show up as."""
    saved = meta.get("model")
    if saved in accepted:
        return
    what = (
        f"a {saved} checkpoint"
        if saved
        else "a checkpoint that does not name the model that saved it"
    )
    raise ConfigError(
        f"--load: {where} is {what}; this run loads {' or '.join(accepted)} checkpoints: give "
        "--load a checkpoint of that model, or use the script of the model that saved it"
    )


def file_checksum(path: str) -> tuple[int, str]:
    """(size in bytes, CRC-32 as 8 hex digits) of a regular file, streamed."""
    return checksum_regular(path)


def _manifest_entry(path: str) -> dict[str, Any]:
    size, crc = file_checksum(path)
    return {"bytes": size, "crc32": crc}


def _relative_files(iter_dir: str) -> set[str]:
    return set(regular_files(iter_dir)) - {METADATA_FILENAME}


def _check_manifest_entry(iter_dir: str, name: Any, entry: Any) -> str:
    meta_path = os.path.join(iter_dir, METADATA_FILENAME)
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or os.path.isabs(name) or any(p in ("", ".", "..") for p in parts):
        raise CheckpointInvalid(f"{meta_path} lists a file outside the checkpoint: {name!r}")
    valid = (
        isinstance(entry, dict)
        and set(entry) == {"bytes", "crc32"}
        and _has_type(entry["bytes"], int)
        and entry["bytes"] >= 0
        and isinstance(entry["crc32"], str)
        and _HEX8.match(entry["crc32"]) is not None
    )
    if not valid or name == METADATA_FILENAME:
        raise CheckpointInvalid(
            f"{meta_path}: malformed manifest entry of {name!r} (expected "
            '{"bytes": size, "crc32": 8 hex digits})'
        )
    return os.path.join(iter_dir, *parts)


def verify_files(iter_dir: str, meta: dict[str, Any]) -> None:
    """Every file against the manifest (presence, size, CRC-32), nothing unlisted, nothing
    that is not a regular file (links, FIFOs, devices are refused, never opened), and no .pt
    file that pickles anything unsafe or that the unpickler cannot read. Any failure, an
    I/O error included, raises CheckpointInvalid naming the file."""
    manifest = meta["files"]
    paths = {name: _check_manifest_entry(iter_dir, name, entry) for name, entry in manifest.items()}
    try:
        present = retried_read(iter_dir, lambda: _relative_files(iter_dir))
    except UnsafeFile as e:
        raise CheckpointInvalid(str(e)) from None
    except FileNotFoundError as e:
        raise CheckpointInvalid(f"{e.filename or iter_dir} is missing") from None
    for name in sorted(set(manifest) - present):
        raise CheckpointInvalid(f"{paths[name]} is missing")
    for name in sorted(present - set(manifest)):
        raise CheckpointInvalid(
            f"{os.path.join(iter_dir, name)} is not in the manifest of {METADATA_FILENAME}"
        )
    for name in sorted(manifest):
        _verify_file(paths[name], manifest[name])


def _verify_file(path: str, entry: dict[str, Any]) -> None:
    try:
        size, crc = retried_read(path, lambda: checksum_regular(path))
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path} is missing") from None
    except UnsafeFile as e:
        raise CheckpointInvalid(str(e)) from None
    if size != entry["bytes"]:
        raise CheckpointInvalid(
            f"{path} has {size} bytes, the manifest says {entry['bytes']} (truncated "
            "or overwritten)"
        )
    if crc != entry["crc32"]:
        raise CheckpointInvalid(
            f"{path} is corrupt: CRC-32 {crc}, the manifest says {entry['crc32']}"
        )
    if path.endswith(".pt"):
        _check_pickle(path)


def _check_pickle(path: str) -> None:
    """The opcode scan (names unsafe imports, runs nothing), then a weights_only load with
    the file memory-mapped: it parses the whole pickle, so a crafted one that breaks the
    unpickler (KeyError, IndexError, struct.error) fails here, where --load-fallback can
    still act, without reading the tensors' bytes."""
    require_safe_torch()
    try:
        unsafe = unsafe_globals(path)
    except Exception as e:
        raise CheckpointInvalid(
            f"{path} is not a readable torch checkpoint ({_exception_line(e)})"
        ) from None
    if unsafe:
        raise CheckpointInvalid(
            f"{path} holds pickled objects other than tensors, numbers and strings "
            f"({', '.join(unsafe[:3])}); refusing to load it"
        )
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointInvalid(
            f"{path} is not a readable torch checkpoint ({_exception_line(e)})"
        ) from None


def verify_checkpoint(
    load_dir: str,
    iteration: int,
    *,
    tp_size: int | None = None,
    models: tuple[str, ...] | None = None,
) -> dict:
    """Everything a load of ``iteration`` needs, checked without any process group; returns
    its metadata. CheckpointInvalid names the damaged file; a checkpoint of a model not in
    ``models`` (checked first) or of another tensor-parallel size is a ConfigError."""
    iter_dir = os.path.join(load_dir, checkpoint_tag(iteration))
    try:
        mode = retried_read(iter_dir, lambda: os.lstat(iter_dir).st_mode)
    except FileNotFoundError:
        raise CheckpointInvalid(f"checkpoint directory {iter_dir} does not exist") from None
    if not stat.S_ISDIR(mode):
        raise CheckpointInvalid(f"{iter_dir} is {kind_of(mode)}, not a checkpoint directory")
    meta = read_metadata(iter_dir)
    if models is not None:
        check_model_kind(meta, iter_dir, models)
    if meta["iteration"] != iteration:
        raise CheckpointInvalid(
            f"{os.path.join(iter_dir, METADATA_FILENAME)} is of iteration {meta['iteration']}"
        )
    saved_tp = meta["tensor_model_parallel_size"]
    if tp_size is not None and saved_tp != tp_size:
        raise ConfigError(
            f"--tensor-model-parallel-size: {iter_dir} was saved with tensor parallel size "
            f"{saved_tp}, this run uses {tp_size}"
        )
    verify_files(iter_dir, meta)
    return meta


@dataclass(frozen=True)
class LoadChoice:
    """The checkpoint --load restores, as verified: its iteration and metadata checksum
    (what the ranks compare after the rendezvous)."""

    iteration: int
    checksum: str


def newest_verified(
    load_dir: str,
    below: int | None,
    *,
    tp_size: int | None = None,
    models: tuple[str, ...] | None = None,
) -> LoadChoice | None:
    """The newest complete checkpoint in ``load_dir`` older than ``below`` that verifies."""
    for iteration in reversed(complete_iterations(load_dir)):
        if below is not None and iteration >= below:
            continue
        try:
            meta = verify_checkpoint(load_dir, iteration, tp_size=tp_size, models=models)
        except (CheckpointUnreadable, CheckpointTooNew):
            raise  # not proven corrupt: never skipped
        except ConfigError:
            continue
        return LoadChoice(iteration, meta["checksum"])
    return None


def choose_load(
    load_dir: str,
    ckpt_step: int | None,
    *,
    tp_size: int | None = None,
    fallback: bool = False,
    models: tuple[str, ...] | None = None,
) -> LoadChoice | None:
    """The checkpoint --load will restore, verified (None: no tracker, a fresh start)."""
    kw = dict(tp_size=tp_size, models=models)
    try:
        iteration = ckpt_step if ckpt_step is not None else read_tracker(load_dir)
    except CheckpointUnreadable:
        raise
    except ConfigError as e:
        older = newest_verified(load_dir, None, **kw) if fallback else None
        if older is None:
            raise
        logger.warning("%s; --load-fallback: loading iteration %d instead", e, older.iteration)
        return older
    if iteration is None:
        return None
    try:
        meta = verify_checkpoint(load_dir, iteration, **kw)
        return LoadChoice(iteration, meta["checksum"])
    except CheckpointInvalid as e:
        problem = f"--load: checkpoint iteration {iteration} is incomplete or corrupt: {e}"
        older = newest_verified(load_dir, iteration, **kw)
    if older is None:
        raise CheckpointInvalid(f"{problem}; no older checkpoint in {load_dir} verifies either")
    if fallback:
        logger.warning(
            "%s; --load-fallback: loading iteration %d instead", problem, older.iteration
        )
        return older
    raise CheckpointInvalid(
        f"{problem}; the last complete checkpoint there is iteration {older.iteration}: pass "
        f"--ckpt-step {older.iteration}, or --load-fallback to fall back automatically"
    )


def choose_checkpoint(load_dir: str, ckpt_step: int | None, **kw) -> int | None:
    """choose_load's iteration."""
    choice = choose_load(load_dir, ckpt_step, **kw)
    return None if choice is None else choice.iteration


def check_save_dir(save_dir: str) -> None:
    """--save is created and test-written now, so that a wrong path fails before any
    rendezvous instead of at the first save."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ConfigError(f"--save: {save_dir} exists and is not a directory")
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--save: cannot create {save_dir}: {e.strerror or e}") from None
    probe = os.path.join(save_dir, f".write_test.{os.uname().nodename}.{os.getpid()}")
    try:
        _write_durably(probe, lambda f: f.write(b"megatron_taco write test\n"))
    except OSError as e:
        raise ConfigError(
            f"--save: cannot write in {save_dir}: {e.strerror or e} ({_free_space(save_dir)})"
        ) from None
    finally:
        _remove(probe)


def existing_checkpoints(directory: str) -> str | None:
    """What checkpoints ``directory`` already holds ("checkpoints up to iteration 4"), None
    when it holds none: a tracker (even one that cannot be read) or a complete checkpoint."""
    complete = complete_iterations(directory)
    if not complete and not os.path.lexists(tracker_path(directory)):
        return None
    tracked = _read_tracker_quietly(directory)
    newest = max([*complete, *([] if tracked is None else [tracked])], default=None)
    return "checkpoints" if newest is None else f"checkpoints up to iteration {newest}"


def same_directory(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def resumes_save(training) -> bool:
    """Whether the run continues the checkpoints in --save (--load names --save, not as
    --finetune, which restarts at iteration 0): only then may its saves replace or retire
    them."""
    return not training.finetune and same_directory(training.load, training.save)


def check_own_save(training, checkpoint: CheckpointConfig) -> None:
    """A run never removes, replaces or rewinds checkpoints it did not write: its first save
    would rewind the tracker, a save at an old iteration would replace that checkpoint and
    --save-retain would delete the old run's last one. Refused unless it resumes them or
    --override-existing-checkpoints moves them aside (set_aside, by rank 0 under the lock)."""
    save = training.save
    held = existing_checkpoints(save)
    if held is None:
        return
    loads_save = same_directory(training.load, save)
    if checkpoint.override_existing_checkpoints:
        if loads_save and training.finetune:
            # Moved aside before the load, the checkpoint to fine-tune would be gone.
            raise ConfigError(
                f"--override-existing-checkpoints: --finetune loads --load {training.load}, "
                f"which is --save: its {held} would be moved aside before they are loaded; "
                "give --finetune another --save, without the flag"
            )
        if resumes_save(training):
            raise ConfigError(
                f"--override-existing-checkpoints: --load {training.load} is --save, whose "
                f"{held} this run would resume: drop --load to start anew, or the flag to resume"
            )
        return
    if training.finetune:
        # It restarts at iteration 0: "--load --save to resume them" is no way on.
        if loads_save:
            raise ConfigError(
                f"--save: {save} already holds {held}, which --finetune (it restarts at "
                "iteration 0) would replace, rewind or delete: give --finetune another --save, "
                f"and keep --load {training.load} to fine-tune from them"
            )
        raise ConfigError(
            f"--save: {save} already holds {held} of another run, which --finetune (it "
            "restarts at iteration 0) would replace, rewind or delete: give --finetune another "
            "--save, or --override-existing-checkpoints to move them aside"
        )
    if not resumes_save(training):
        raise ConfigError(
            f"--save: {save} already holds {held} of another run, which this run's saves "
            f"would replace, rewind or delete: pass --load {save} to resume them, or "
            "--override-existing-checkpoints to move them aside and start anew"
        )


SUPERSEDED_PREFIX = "superseded-"


def _is_checkpoint_entry(name: str) -> bool:
    return name == TRACKER_FILENAME or bool(_ITER_DIR.match(name) or _LEFTOVER.match(name))


def _new_aside(save_dir: str) -> tuple[str, str]:
    """A new superseded-<time>-<pid>[.N] directory and its name's tag: the name may be
    taken (a requeued container gets the same pid; two overrides within a second), and a
    directory that was there is never reused."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = os.path.join(save_dir, f"{SUPERSEDED_PREFIX}{stamp}-{os.getpid()}")
    aside, n = base, 1
    while True:
        try:
            os.mkdir(aside)
            return aside, os.path.basename(aside)[len(SUPERSEDED_PREFIX) :]
        except FileExistsError:
            n += 1
            aside = f"{base}.{n}"


def set_aside(save_dir: str, stores: tuple[str, ...] = ()) -> str | None:
    """--override-existing-checkpoints: move the checkpoints in ``save_dir`` and the
    non-empty ``stores`` into ``save_dir/superseded-<time>/`` (a store elsewhere: renamed to
    ``<store>.superseded-<time>``), tracker first so that no moment shows a tracker naming
    a moved checkpoint. Rank 0 only, holding the save lock, before any save. Returns the
    directory, None when there was nothing to move."""
    names = sorted(n for n in os.listdir(save_dir) if _is_checkpoint_entry(n))
    stores = tuple(s for s in stores if os.path.isdir(s) and os.listdir(s))
    if not names and not stores:
        return None
    aside, tag = _new_aside(save_dir)
    # The checkpoints name their tokenizer copy relative to their directory's parent: the
    # copies go with them (copied: the new run may share one, and none is ever deleted).
    from megatron_taco.data.tokenizer import TOKENIZER_DIR

    copies = os.path.join(save_dir, TOKENIZER_DIR)
    if names and os.path.isdir(copies):
        shutil.copytree(copies, os.path.join(aside, TOKENIZER_DIR), symlinks=True)
    names.sort(key=lambda n: n != TRACKER_FILENAME)
    for name in names:
        os.rename(os.path.join(save_dir, name), os.path.join(aside, name))
    for store in stores:
        inside = same_directory(os.path.dirname(os.path.abspath(store)), save_dir)
        target = (
            os.path.join(aside, os.path.basename(store))
            if inside
            else f"{store.rstrip(os.sep)}.{SUPERSEDED_PREFIX}{tag}"
        )
        os.rename(store, target)
    _fsync_dir(save_dir)
    return aside


# DeepSpeed checkpoint options that bypass this module's writer or loader.
_UNSUPPORTED_DS_CHECKPOINT_KEYS = {
    "writer": "checkpoints are written by megatron_taco's own writer",
    "use_node_local_storage": "every rank must see the same checkpoint directory",
    "load_universal": "DeepSpeed loads universal checkpoints with unrestricted pickle",
}


def prepare_checkpoints(
    training,
    checkpoint: CheckpointConfig,
    *,
    tp_size: int,
    ds_config: dict,
    zero_stage: int,
    models: tuple[str, ...] | None = None,
    once: Callable[[Callable[[], Any]], Any] | None = None,
) -> LoadChoice | None:
    """The checkpoint checks every rank runs before the rendezvous. Returns the checkpoint
    --load will restore (verified), None when there is nothing to load. ``once(fn)`` runs
    the verification, which reads every byte of the checkpoint, once for the ranks that
    share it (the driver: once per node) and hands every rank the same result."""
    if checkpoint.save_retain is not None:
        require(training.save is not None, CheckpointConfig, "save_retain", "needs --save")
    if checkpoint.override_existing_checkpoints:
        require(training.save is not None, CheckpointConfig, "override_existing_checkpoints",
                "needs --save")  # fmt: skip
    if checkpoint.load_fallback:
        require(training.load is not None, CheckpointConfig, "load_fallback", "needs --load")
        require(
            training.ckpt_step is None,
            CheckpointConfig,
            "load_fallback",
            "cannot be combined with --ckpt-step, which names the one checkpoint to load",
        )
    section = ds_config.get("checkpoint")
    for key, why in _UNSUPPORTED_DS_CHECKPOINT_KEYS.items():
        if isinstance(section, dict) and section.get(key):
            raise ConfigError(f"--deepspeed-config: key 'checkpoint.{key}' is not supported: {why}")
    if training.save is not None:
        check_save_dir(training.save)
        check_own_save(training, checkpoint)
    if training.load is None:
        return None
    if zero_stage == 3 and (training.finetune or training.no_load_optim):
        flag = "--finetune" if training.finetune else "--no-load-optim"
        raise ConfigError(
            f"{flag}: not supported with ZeRO stage 3, where DeepSpeed rebuilds the weights "
            "without the optimizer files through zero_to_fp32, which unpickles them unsafely; "
            "load with a ZeRO stage 0-2 config"
        )

    def choose() -> LoadChoice | None:
        return choose_load(training.load, training.ckpt_step, tp_size=tp_size,
                           fallback=checkpoint.load_fallback, models=models)  # fmt: skip

    return choose() if once is None else once(choose)


# -- saving -----------------------------------------------------------------------------

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
    if _read_tracker_quietly(save_dir) == iteration:
        others = [i for i in complete_iterations(save_dir) if i != iteration]
        if not others:
            raise CheckpointSaveError(
                f"cannot replace {final} safely: this file system cannot swap directories "
                f"atomically ({reason}) and {save_dir} holds no other complete checkpoint for "
                "the tracker to name meanwhile; save to a new --save directory"
            )
        _atomic_write_text(tracker_path(save_dir), f"{others[-1]}\n")
    aside = f"{final}.del-{token}"
    os.rename(final, aside)
    os.rename(tmp_dir, final)
    return aside


def _read_tracker_quietly(directory: str) -> int | None:
    try:
        return read_tracker(directory)
    except ConfigError:
        return None


def _retire(save_dir: str, keep: int, token: str) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (never the tracker's)."""
    tracked = _read_tracker_quietly(save_dir)

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
        _remove(aside)


def _sweep_leftovers(save_dir: str) -> None:
    for name in os.listdir(save_dir):
        if _LEFTOVER.match(name):
            _remove(os.path.join(save_dir, name))


def _shared_token(device: torch.device) -> str:
    """A random name part, the same on every rank (DeepSpeed checks the tag is)."""
    value = torch.tensor([secrets.randbits(48)], dtype=torch.int64, device=device)
    if dist.is_initialized():
        comm.broadcast(value, src=0)
    return f"{int(value.item()):012x}"


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    return comm.all_gather_object(obj)


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    return comm.broadcast_object(obj, src=0)


def _start_save(save_dir: str, tmp_dir: str, sweep: bool) -> None:
    os.makedirs(save_dir, exist_ok=True)
    if sweep:
        _sweep_leftovers(save_dir)
    os.makedirs(tmp_dir)


def _write_rng(path: str, rng_tracker: RNGTracker | None, writer: SafeCheckpointEngine) -> None:
    states = get_rng_states(rng_tracker)
    _write_durably(path, lambda f: torch.save(states, f))
    writer.written.append(path)


def _own_manifest(writer: SafeCheckpointEngine, tmp_dir: str) -> dict[str, dict]:
    """Size and CRC-32 of the files this rank wrote (read back from the page cache)."""
    entries = {}
    for path in writer.written:
        name = os.path.relpath(path, tmp_dir).replace(os.sep, "/")
        if not name.startswith("../"):
            writer.attempt(path, lambda p=path, n=name: entries.__setitem__(n, _manifest_entry(p)))
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
    for name in sorted(_relative_files(tmp_dir) - set(files)):  # written by other means
        path = os.path.join(tmp_dir, *name.split("/"))
        _fsync_file(path)
        files[name] = _manifest_entry(path)
    for root, _dirs, _names in os.walk(tmp_dir, topdown=False):
        _fsync_dir(root)
    _write_metadata(tmp_dir, meta, files)
    _fsync_dir(tmp_dir)
    _kill_point("after_metadata", iteration)
    replaced = _publish(save_dir, tmp_dir, iteration, token)
    _fsync_dir(save_dir)
    _kill_point("after_rename", iteration)
    tmp_tracker = f"{tracker_path(save_dir)}.tmp.{os.getpid()}"
    _write_durably(tmp_tracker, lambda f: f.write(f"{iteration}\n".encode()))
    os.replace(tmp_tracker, tracker_path(save_dir))
    # Published: from here on nothing may turn the save into a failure.
    try:
        _fsync_dir(save_dir)
        _kill_point("after_tracker", iteration)
        if replaced is not None and clean_up:  # else a leftover, swept by the next save
            _remove(replaced)
        if retain is not None and clean_up:
            _retire(save_dir, retain, token)
    except OSError as e:
        return (
            f"saved checkpoint iteration {iteration} (latest), but removing older checkpoints "
            f"in {save_dir} failed: {e.filename or save_dir}: {e.strerror or e}; training "
            "goes on (remove them by hand)"
        )
    return None


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    writer = _safe_engine(engine)
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
    _kill_point("after_model_files", iteration)
    rng_path = rng_state_path(tmp_dir, parallel.rank)
    writer.attempt(rng_path, _write_rng, rng_path, rng_tracker, writer)
    _kill_point("after_rng_files", iteration)
    gathered = _gather((writer.error, _own_manifest(writer, tmp_dir)))
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
            _remove(tmp_dir)
            message = _save_failure(save_dir, iteration, error)
    parallel.file_barrier()
    message, warning = _broadcast((message, warning))
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
        return _describe_write_error(e.filename or tmp_dir, e), None
    except UnsafeFile as e:  # something not a regular file in our own temporary directory
        return str(e), None


def _save_failure(save_dir: str, iteration: int, error: str) -> str:
    tracked = _read_tracker_quietly(save_dir)
    still = (
        f"{tracker_path(save_dir)} still names iteration {tracked}"
        if tracked is not None
        else f"{save_dir} holds no earlier checkpoint"
    )
    return (
        f"saving checkpoint iteration {iteration} failed: {error}; the partial checkpoint was "
        f"removed and {still}"
    )


def last_complete_checkpoint(save_dir: str) -> str:
    """A clause for the line of a rank that abandons a save: what a resume will load."""
    tracked = _read_tracker_quietly(save_dir)
    if tracked is None:
        return f"{save_dir} holds no complete checkpoint (no readable {TRACKER_FILENAME})"
    final = os.path.join(save_dir, checkpoint_tag(tracked))
    return f"the last complete checkpoint is {final} ({TRACKER_FILENAME} names it)"


# -- loading ----------------------------------------------------------------------------


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
    own = {k: None if hasattr(v, "ds_shape") else v.shape
           for k, v in engine.module.state_dict(keep_vars=True).items()}  # fmt: skip
    missing = [k for k in own if k not in module]
    unexpected = [k for k in module if k not in own]
    wrong = [
        (k, module[k].shape if torch.is_tensor(module[k]) else type(module[k]).__name__, own[k])
        for k in own
        if k in module and own[k] is not None
        and not (torch.is_tensor(module[k]) and module[k].shape == own[k])
    ]  # fmt: skip
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


def _agree_on_fit(engine, load_dir: str, tag: str) -> None:
    """Collective: every rank checks its own model states file before DeepSpeed loads any;
    a misfit on one rank stops every rank with the first rank's line."""
    iter_dir = os.path.join(load_dir, tag)
    problem = checkpoint_misfit(engine, engine._get_ckpt_name(load_dir, tag), iter_dir)
    found = _gather(problem)
    first = next((p for p in found if p is not None), None)
    if first is not None:
        raise CheckpointMisfit(first[0], how=tuple(p and p[1] for p in found))


def _agreed_newest_verified(
    load_dir: str, below: int, parallel: ParallelState, **kw
) -> LoadChoice | None:
    """Collective: newest_verified as global rank 0 finds it (every byte read once, not once
    per rank), the one choice every rank takes; each rank then reads that checkpoint's
    metadata.json, and one that sees another (a stale network-file-system view) or none
    stops every rank with its line, rather than ranks loading different iterations."""
    found: tuple[str, Any] | None = None
    if parallel.rank == 0:
        try:
            found = ("choice", newest_verified(load_dir, below, tp_size=parallel.tp_size, **kw))
        except ConfigError as e:
            found = ("error", str(e))
    parallel.file_barrier()  # rank 0 may read for long: not within a collective's timeout
    kind, value = _broadcast(found)
    if kind == "error":
        raise ConfigError(value)
    problem = None
    if value is not None:
        iter_dir = os.path.join(load_dir, checkpoint_tag(value.iteration))
        try:
            seen = read_metadata(iter_dir)["checksum"]
            if seen != value.checksum:
                problem = f"its {METADATA_FILENAME} has checksum {seen}, rank 0's {value.checksum}"
        except ConfigError as e:
            problem = str(e)
    for other, seen in enumerate(_gather(problem)):
        if seen is not None:
            raise ConfigError(
                f"--load-fallback: rank 0 chose iteration {value.iteration}, which rank "
                f"{other} sees otherwise ({seen}): the ranks see different files in --load "
                "(a stale network-file-system view?)"
            )
    return value


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
    model weights are loaded and the returned state is iteration 0. The driver verified the
    checkpoint before any process group existed (prepare_checkpoints); every file is read
    with weights_only=True regardless.
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
    meta = read_metadata(iter_dir)
    saved_tp = meta.get("tensor_model_parallel_size")
    if saved_tp is not None and saved_tp != parallel.tp_size:
        raise ConfigError(
            f"--tensor-model-parallel-size: {iter_dir} was saved with tensor parallel size "
            f"{saved_tp}, this run uses {parallel.tp_size}"
        )
    restore_optim = load_optim and not finetune
    if not restore_optim and engine.zero_optimization_partition_weights():
        # DeepSpeed would rebuild the weights through zero_to_fp32's unrestricted torch.load.
        raise ConfigError(
            "--finetune/--no-load-optim: not supported with ZeRO stage 3; load with a ZeRO "
            "stage 0-2 config"
        )
    _safe_engine(engine)
    _agree_on_fit(engine, load_dir, tag)
    load_path, client_state = engine.load_checkpoint(
        load_dir,
        tag=tag,
        load_optimizer_states=restore_optim,
        load_lr_scheduler_states=restore_optim,
        load_module_only=finetune,
    )
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
        set_rng_states(_load_rng_file(path), rng_tracker)
    _barrier()
    return state


def load_fitting_checkpoint(
    engine,
    load_dir: str,
    parallel: ParallelState,
    rng_tracker: RNGTracker | None = None,
    *,
    ckpt_step: int,
    fallback: bool = False,
    models: tuple[str, ...] | None = None,
    check: Callable[[int], None] = lambda iteration: None,
    **kw: Any,
) -> TrainingState | None:
    """load_checkpoint of ``ckpt_step``; one whose tensors do not fit the model is one line
    naming the last complete checkpoint before it that fits, or with ``fallback``
    (--load-fallback) that one is loaded instead (after ``check(iteration)``, the driver's
    layout check), as for a checkpoint that does not verify. Every rank takes the same path:
    the misfit is agreed on, and the ranks see the same files (agree_on_load)."""
    try:
        return load_checkpoint(engine, load_dir, parallel, rng_tracker, ckpt_step=ckpt_step, **kw)
    except CheckpointMisfit as e:
        misfit = e
    older = _older_fitting(engine, load_dir, ckpt_step, misfit, parallel, models=models)
    if not fallback:
        raise CheckpointInvalid(
            f"{misfit}; the last complete checkpoint there is iteration {older}: pass "
            f"--ckpt-step {older}, or --load-fallback to fall back automatically"
        )
    if parallel.rank == 0:
        logger.warning("%s; --load-fallback: loading iteration %d instead", misfit, older)
    check(older)
    return load_checkpoint(engine, load_dir, parallel, rng_tracker, ckpt_step=older, **kw)


def _older_fitting(
    engine, load_dir: str, below: int, misfit: CheckpointMisfit, parallel: ParallelState, **kw
) -> int:
    """Collective: the newest checkpoint before ``below`` that verifies and fits the model.
    One that misfits as ``misfit`` does shows the model is not theirs (its flags differ):
    the walk stops there, before it verifies every byte of every checkpoint to say so."""
    while True:
        older = _agreed_newest_verified(load_dir, below, parallel, **kw)
        if older is None:
            raise CheckpointInvalid(
                f"{misfit}; no older checkpoint in {load_dir} verifies and fits this model"
            )
        try:
            _agree_on_fit(engine, load_dir, checkpoint_tag(older.iteration))
            return older.iteration
        except CheckpointMisfit as e:
            if e.how == misfit.how:
                raise ConfigError(
                    f"{misfit}; iteration {older.iteration} before it does not fit in the same "
                    "way: this model is not the one these checkpoints were saved from"
                ) from None
        below = older.iteration

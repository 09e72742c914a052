"""On-disk cache of index arrays (sample indices, blending indices), shared by all ranks.

An entry is keyed by the md5 of a JSON *description* of everything that shapes its arrays
(dataset file identity, split, lengths, seed, counts, code version); change any of them and
the key changes, so a stale entry is never reused. Files, in the cache directory::

    {kind}-{hash}-{name}.npy        one per array
    {kind}-{hash}-description.json  the description (for humans) plus build statistics

The description is written last, so its presence means the entry is complete; every file
is written under a temporary name, fsynced and renamed into place (and the directory
fsynced), so a crash or a concurrent reader never sees a half-written file, and a power cut
cannot leave a renamed but empty one. The description records every array file's size,
checked before the entry is used: a file cut short anyway is rebuilt, not trusted.

With torch.distributed initialised, global rank 0 builds and writes while the other ranks
wait at a barrier, then everyone memory-maps the files. Every rank must therefore call
:func:`load_or_build` for the same entries in the same order. The barrier is the caller's
(``barrier=``, e.g. parallel/comm.py's): data/ depends on no other layer of the package. A rank that finds no files
after the barrier (the directory is not writable, or not shared between nodes) builds the
arrays in memory itself, with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_taco import io

logger = logging.getLogger(__name__)

BuildFn = Callable[[], "tuple[dict[str, np.ndarray], dict[str, Any]]"]


@dataclass
class CacheEntry:
    arrays: dict[str, np.ndarray]
    status: str  # "built" (by this rank, saved), "loaded" (from files), "memory" (not saved)
    key: str  # md5 of the description
    info: dict[str, Any] = field(default_factory=dict)  # build statistics
    paths: dict[str, str] = field(default_factory=dict)  # array name -> .npy path (if saved)


def description_key(description: dict[str, Any]) -> str:
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def file_identity(path: str) -> dict[str, Any]:
    """What identifies a data file's contents cheaply: where it is, its size and mtime."""
    st = os.stat(path)
    return {"path": os.path.realpath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _distributed() -> tuple[bool, int]:
    """(several ranks share the cache, this rank)."""
    try:
        import torch.distributed as dist
    except ImportError:  # data tools work without torch.distributed
        return False, 0
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1, dist.get_rank()
    return False, 0


def _paths(cache_dir: str, kind: str, key: str, names) -> tuple[str, dict[str, str]]:
    base = os.path.join(cache_dir, f"{kind}-{key}")
    return base + "-description.json", {n: f"{base}-{n}.npy" for n in names}


def _load(description_path: str, paths: dict[str, str]) -> tuple[dict[str, np.ndarray], dict]:
    with open(description_path, encoding="utf-8") as f:
        meta = json.load(f)
    arrays = {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}
    return arrays, meta.get("info", {})


def _complete(description_path: str, paths: dict[str, str]) -> bool:
    """The description exists and every array file has the size it records (an entry
    written before sizes were recorded, or cut short, is not complete)."""
    try:
        with open(description_path, encoding="utf-8") as f:
            sizes = json.load(f).get("bytes") or {}
        return all(os.path.getsize(p) == sizes.get(n) for n, p in paths.items())
    except (OSError, ValueError, AttributeError):
        return False


def load_or_build(
    kind: str,
    description: dict[str, Any],
    names: tuple[str, ...],
    build: BuildFn,
    cache_dir: str | None,
    barrier: Callable[[], None] | None = None,
) -> CacheEntry:
    """Arrays ``names`` for ``description``: loaded from ``cache_dir`` or built (and saved).

    ``build()`` returns ``(arrays, info)``: the arrays by name and JSON-able statistics kept
    beside them. ``cache_dir=None`` disables the cache (every rank builds in memory).
    ``barrier``: waits for every rank; needed when several ranks share the cache.
    """
    key = description_key(description)
    distributed, rank = _distributed()
    if distributed and cache_dir is not None and barrier is None:
        # A bug, not a user error: without it ranks > 0 would read half-written files.
        raise ValueError(f"load_or_build({kind!r}): several ranks share the cache; pass barrier=")
    if cache_dir is None:
        arrays, info = build()
        return CacheEntry(arrays, "memory", key, info)

    description_path, paths = _paths(cache_dir, kind, key, names)
    entry: CacheEntry | None = None
    error: BaseException | None = None
    if rank == 0 and not _complete(description_path, paths):
        try:
            entry = _build_and_save(
                kind, description, key, build, cache_dir, description_path, paths
            )
        except BaseException as e:
            # The other ranks are (or will be) waiting at the barrier: reach it before failing,
            # so they fail on their own instead of hanging until the process-group timeout.
            error = e
    if distributed:
        barrier()
    if error is not None:
        raise error
    if entry is not None:
        return entry
    if _complete(description_path, paths):
        arrays, info = _load(description_path, paths)
        logger.info("loaded cached %s %s from %s", kind, key, cache_dir)
        return CacheEntry(arrays, "loaded", key, info, paths)
    warnings.warn(
        f"rank {rank}: no cached {kind} {key} in {cache_dir} after rank 0 built it (the "
        "directory is not writable or not shared between nodes); building it in memory "
        "on this rank. Set --data-cache-path to a directory every node can read.",
        stacklevel=2,
    )
    arrays, info = build()
    return CacheEntry(arrays, "memory", key, info)


def _build_and_save(
    kind: str,
    description: dict[str, Any],
    key: str,
    build: BuildFn,
    cache_dir: str,
    description_path: str,
    paths: dict[str, str],
) -> CacheEntry:
    t0 = time.perf_counter()
    arrays, info = build()
    elapsed = time.perf_counter() - t0
    missing = set(paths) ^ set(arrays)
    if missing:
        raise ValueError(
            f"{kind}: build returned arrays {sorted(arrays)}, expected {sorted(paths)}"
        )
    try:
        os.makedirs(cache_dir, exist_ok=True)
        sizes = {}
        for name, path in paths.items():
            arr = np.ascontiguousarray(arrays[name])
            io.atomic_write(path, lambda f, a=arr: np.save(f, a, allow_pickle=False))
            sizes[name] = os.path.getsize(path)
        meta = {"kind": kind, "key": key, "description": description, "info": info, "bytes": sizes}
        text = json.dumps(meta, indent=2, sort_keys=True) + "\n"
        io.atomic_write(description_path, text)
    except OSError as e:
        warnings.warn(
            f"cannot write the {kind} cache in {cache_dir} ({e}); using the index built in "
            "memory (it is rebuilt on every run; set --data-cache-path to a writable directory)",
            stacklevel=3,
        )
        return CacheEntry(arrays, "memory", key, info)
    logger.info("built %s %s in %.2f s and saved it to %s", kind, key, elapsed, cache_dir)
    arrays, info = _load(description_path, paths)
    return CacheEntry(arrays, "built", key, info, paths)


def array_state(arr: np.ndarray) -> tuple:
    """Pickle state for an index array: a memory-mapped cache file travels as its path.

    np.memmap pickles by copying its data, which would push gigabytes through the pipe to
    every spawned DataLoader worker; the path lets the worker map the file itself.
    """
    if isinstance(arr, np.memmap) and arr.filename and arr.flags.c_contiguous:
        with contextlib.suppress(OSError, ValueError):
            whole = np.load(arr.filename, mmap_mode="r", allow_pickle=False)
            # only the whole file, not a slice of it (a slice is still an np.memmap)
            if whole.shape == arr.shape and whole.dtype == arr.dtype:
                return ("npy", arr.filename, tuple(arr.shape))
    return ("array", np.asarray(arr))


def array_from_state(state: tuple) -> np.ndarray:
    if state[0] == "npy":
        arr = np.load(state[1], mmap_mode="r", allow_pickle=False)
        if tuple(arr.shape) != tuple(state[2]):
            raise ValueError(f"{state[1]} changed shape since it was pickled")
        return arr
    return state[1]

"""Writing a generation: shards pre-filled under a temporary name and renamed whole, rows
written at fixed offsets by the one writer that owns their shard (a replayed batch rewrites
identical bytes).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from typing import Any, BinaryIO

import numpy as np

from megatron_taco import io
from megatron_taco.data.replacement_store import layout as store_layout
from megatron_taco.data.replacement_store.layout import (
    LAYOUT_NAME,
    MANIFEST_NAME,
    ReplacementStoreError,
    ShardFiles,
    StoreLayout,
    as_bytes,
    check_generation,
    check_origin,
    check_size,
    checked_ids,
    generation_dir,
    is_int,
    layout_json_bytes,
    pwrite_all,
    read_layout_file,
    row_checksums,
    shard_runs,
)

logger = logging.getLogger(__name__)


def _fill_sentinel(fd: int, nbytes: int, layout: StoreLayout) -> None:
    elems = max(1, store_layout.CHUNK_BYTES // layout.dtype.itemsize)
    pattern = memoryview(np.full(elems, layout.sentinel, dtype=layout.dtype)).cast("B")
    for offset in range(0, nbytes, len(pattern)):
        pwrite_all(fd, pattern[: min(len(pattern), nbytes - offset)], offset)


def _create_shard(path: str, layout: StoreLayout, shard: int) -> None:
    """Pre-fills a temp file and renames it: a shard under its final name is always whole."""
    with io.atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY)
        try:
            _fill_sentinel(fd, layout.shard_bytes(shard), layout)
        finally:
            os.close(fd)


def _remove_stale_temps(directory: str, names: Iterable[str]) -> None:
    # Only temps of shards we own: another writer may be creating its own right now.
    prefixes = tuple(f"{name}." for name in names)
    if not prefixes:
        return
    for entry in os.listdir(directory):
        if entry.startswith(prefixes) and entry.endswith(".tmp"):
            logger.info("removing %s left by an interrupted shard creation", entry)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, entry))


def _prepare_generation_dir(root: str, generation: int, layout: StoreLayout) -> str:
    directory = generation_dir(root, generation)
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
        io.fsync_dir(root)
    path = os.path.join(directory, LAYOUT_NAME)
    if os.path.exists(path):
        stored = read_layout_file(path)
        if stored.sizes() != layout.sizes():
            raise ReplacementStoreError(
                f"{path}: generation {generation} was started with {stored}, not {layout}; "
                f"delete {directory} to start it afresh"
            )
        check_origin(path, stored, layout)
    else:
        io.atomic_write(path, layout_json_bytes(layout))  # racing writers write equal bytes
    return directory


def _uncommit(directory: str) -> None:
    # A resumed run rewrites rows of a generation that may have been committed after the
    # checkpoint it resumes from: the checksums would go stale, so it must be committed anew.
    path = os.path.join(directory, MANIFEST_NAME)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
        logger.info("%s removed: the generation is being written again", path)
        io.fsync_dir(directory)


def _check_owned(owned_shards: Iterable[int], layout: StoreLayout) -> list[int]:
    try:
        given = list(owned_shards)
    except TypeError:
        raise ReplacementStoreError(
            f"owned_shards must be an iterable of shard indices, got {owned_shards!r}"
        ) from None
    bad = [k for k in given if not is_int(k) or not 0 <= k < layout.num_shards]
    if bad:
        raise ReplacementStoreError(
            f"owned_shards: {bad[0]!r} is not a shard index in [0, {layout.num_shards})"
        )
    return sorted({int(k) for k in given})


class GenerationWriter(ShardFiles):
    """Writes the rows of the shards this process owns into generation ``generation``."""

    def __init__(
        self,
        root: str | os.PathLike,
        generation: int,
        layout: StoreLayout,
        owned_shards: Iterable[int],
    ) -> None:
        if not isinstance(layout, StoreLayout):
            raise ReplacementStoreError(f"layout must be a StoreLayout, got {layout!r}")
        owned = _check_owned(owned_shards, layout)
        self.root = os.fspath(root)
        self.generation = check_generation(generation)
        self.layout = layout
        self.directory = _prepare_generation_dir(self.root, self.generation, layout)
        _uncommit(self.directory)
        _remove_stale_temps(self.directory, [layout.shard_file(k) for k in owned])
        self._owned = np.zeros(layout.num_shards, dtype=bool)
        self._owned[owned] = True
        self._files: dict[int, BinaryIO] = {}
        try:
            for k in owned:
                self._files[k] = self._open_shard(k)
        except BaseException:
            self.close()
            raise

    @property
    def owned_shards(self) -> tuple[int, ...]:
        return tuple(sorted(self._files))

    def _open_shard(self, shard: int) -> BinaryIO:
        path = os.path.join(self.directory, self.layout.shard_file(shard))
        if os.path.exists(path):
            check_size(path, self.layout.shard_bytes(shard))  # reopened: never truncate
        else:
            _create_shard(path, self.layout, shard)
        return open(path, "r+b", buffering=0)  # closed by close()

    def _validated_rows(self, ids: np.ndarray, rows: Any) -> np.ndarray:
        rows = np.asarray(rows)
        where = f"{self.directory}: write"
        if rows.shape != (len(ids), self.layout.width):
            raise ReplacementStoreError(
                f"{where}: rows have shape {rows.shape}, expected {(len(ids), self.layout.width)}"
            )
        if rows.size and rows.dtype.kind not in "iu":
            raise ReplacementStoreError(
                f"{where}: rows must hold integer token ids, got {rows.dtype}"
            )
        if rows.size and (rows.min() < 0 or rows.max() >= self.layout.vocab_size):
            bad = np.flatnonzero(((rows < 0) | (rows >= self.layout.vocab_size)).any(axis=1))[0]
            raise ReplacementStoreError(
                f"{where}: instance {ids[bad]} has token id(s) outside "
                f"[0, {self.layout.vocab_size}): {rows[bad].tolist()}"
            )
        return rows.astype(self.layout.dtype, copy=False)

    def write(self, instance_ids: np.ndarray, rows: np.ndarray) -> None:
        """Writes ``rows[i]`` as instance ``instance_ids[i]``'s row (a repeated id: last wins)."""
        ids = checked_ids(instance_ids, self.layout, f"{self.directory}: write")
        rows = self._validated_rows(ids, rows)
        if not len(ids):
            return
        shards = ids // self.layout.rows_per_shard
        foreign = np.flatnonzero(~self._owned[shards])
        if foreign.size:
            k = int(shards[foreign[0]])
            raise ReplacementStoreError(
                f"{self.directory}: instance {ids[foreign[0]]} belongs to "
                f"{self.layout.shard_file(k)}, which this writer does not own "
                f"(owns {list(self.owned_shards)}); route rows to their owner first"
            )
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        records = np.empty(len(ids), dtype=self.layout.record_dtype)
        records["tokens"] = rows[order]
        # Computed from the rows in memory: what reaches the disk is checked against it.
        records["check"] = row_checksums(ids, records["tokens"])
        r = self.layout.rows_per_shard
        for start, stop in shard_runs(ids, r):
            k = int(ids[start]) // r
            offset = (int(ids[start]) - k * r) * self.layout.record_bytes
            pwrite_all(self._files[k].fileno(), as_bytes(records[start:stop]), offset)

    def flush(self) -> None:
        """Makes every row written so far durable (call before recording a checkpoint)."""
        for f in self._files.values():
            os.fsync(f.fileno())

    def __getstate__(self) -> None:
        raise TypeError("GenerationWriter holds open shard files and cannot be pickled")

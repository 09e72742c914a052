"""Reading committed generations with bounded memory (pread, not a memory map), listing and
deleting generations.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable
from typing import Any, BinaryIO

import numpy as np

from megatron_taco import io
from megatron_taco.data.replacement_store.layout import (
    GENERATION_DIR,
    LAYOUT_NAME,
    MANIFEST_NAME,
    ReplacementStoreError,
    ShardFiles,
    check_generation,
    check_size,
    checked_ids,
    generation_dir,
    pread_exact,
    read_layout_file,
    shard_runs,
)
from megatron_taco.data.replacement_store.manifest import (
    Manifest,
    check_records,
    corrupt_row_message,
    read_manifest,
    scan_message,
    scan_shard,
)


class GenerationReader(ShardFiles):
    """Reads rows of a committed generation; knows nothing of who wrote them.

    ``verify`` re-computes every shard's crc32 (a full read of the generation: do it once per
    job, not in every DataLoader worker; pickled copies never re-verify). ``allow_uncommitted``
    is for debugging: with no manifest, it reads whatever rows are on disk, by layout.json.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        generation: int,
        *,
        verify: bool = True,
        allow_uncommitted: bool = False,
    ) -> None:
        self.root = os.fspath(root)
        self.generation = check_generation(generation)
        self.directory = generation_dir(self.root, self.generation)
        self.manifest: Manifest | None = None
        if allow_uncommitted and not os.path.exists(os.path.join(self.directory, MANIFEST_NAME)):
            self.layout = read_layout_file(os.path.join(self.directory, LAYOUT_NAME))
        else:
            self.manifest = read_manifest(self.root, self.generation)
            self.layout = self.manifest.layout
            self._check_shards(verify)
        self._files: dict[int, BinaryIO] = {}

    def _check_shards(self, verify: bool) -> None:
        assert self.manifest is not None
        for k, record in enumerate(self.manifest.shards):
            path = os.path.join(self.directory, record.file)
            check_size(path, record.bytes)
            if verify:
                scan = scan_shard(path, self.layout, k)
                if scan.crc32 != record.crc32:
                    raise ReplacementStoreError(
                        f"{path}: checksum mismatch (crc32 {scan.crc32:08x}, manifest records "
                        f"{record.crc32:08x})"
                    )
                if scan.corrupt:  # not after a commit of this version, which checks them
                    raise ReplacementStoreError(scan_message(path, self.layout, scan))

    def __len__(self) -> int:
        return self.layout.num_instances

    def _file(self, shard: int) -> tuple[BinaryIO, str]:
        path = self._path(shard)
        if shard not in self._files:
            check_size(path, self.layout.shard_bytes(shard))  # also after unpickling
            self._files[shard] = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close())
        return self._files[shard], path

    def read(self, instance_ids: np.ndarray) -> np.ndarray:
        """Rows [B, W] of ``instance_ids`` (any order, repeats allowed) in the layout's dtype."""
        ids = checked_ids(instance_ids, self.layout, f"{self.directory}: read")
        records = np.empty(len(ids), dtype=self.layout.record_dtype)
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        r, record_bytes = self.layout.rows_per_shard, self.layout.record_bytes
        for start, stop in shard_runs(sorted_ids, r):
            k = int(sorted_ids[start]) // r
            f, path = self._file(k)
            offset = (int(sorted_ids[start]) - k * r) * record_bytes
            data = pread_exact(f.fileno(), (stop - start) * record_bytes, offset, path)
            records[order[start:stop]] = np.frombuffer(data, self.layout.record_dtype)
        self._check_records(ids, records)
        return records["tokens"].copy()

    def _check_records(self, ids: np.ndarray, records: np.ndarray) -> None:
        unwritten, corrupt = check_records(records, ids, self.layout)
        if unwritten.size:
            i = int(ids[unwritten[0]])
            k, row = divmod(i, self.layout.rows_per_shard)
            raise ReplacementStoreError(
                f"{self._path(k)}: instance {i} (row {row}) was never written"
            )
        if corrupt.size:
            i = int(ids[corrupt[0]])
            path = self._path(i // self.layout.rows_per_shard)
            tokens = records["tokens"][corrupt[0]]
            raise ReplacementStoreError(corrupt_row_message(path, self.layout, i, tokens))

    def _path(self, shard: int) -> str:
        return os.path.join(self.directory, self.layout.shard_file(shard))

    def __getstate__(self) -> dict[str, Any]:
        # Open files do not travel; the copy reopens (and size-checks) shards on first read.
        state = dict(self.__dict__)
        state["_files"] = {}
        return state


def list_generations(root: str | os.PathLike) -> list[int]:
    """Generation indices with a directory under ``root``, committed or not, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = GENERATION_DIR.fullmatch(name)
        # Only canonical names: gen_000001 would not be where generation 1 is looked for.
        if m and name == f"gen_{int(m.group(1)):05d}" and os.path.isdir(os.path.join(root, name)):
            found.append(int(m.group(1)))
    return sorted(found)


def delete_generations(root: str | os.PathLike, keep: Iterable[int]) -> list[int]:
    """Removes every generation directory not in ``keep``; returns what was removed.

    No process may be reading or writing a removed generation at the time.
    """
    keep_set = {check_generation(g) for g in keep}
    deleted = []
    for generation in list_generations(root):
        if generation in keep_set:
            continue
        directory = generation_dir(root, generation)
        # Manifest first: a deletion cut short must not leave a generation that looks
        # committed but has lost shards.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, MANIFEST_NAME))
            io.fsync_dir(directory)
        shutil.rmtree(directory)
        deleted.append(generation)
    if deleted:
        io.fsync_dir(os.fspath(root))
    return deleted

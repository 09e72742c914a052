"""A generation's manifest: every shard scanned against the checksums written with its rows,
then sizes and CRC-32s sealed (commit_generation, written last); read_manifest checks it.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

import numpy as np

from megatron_taco import io
from megatron_taco.data.replacement_store import layout as store_layout
from megatron_taco.data.replacement_store.layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LAYOUT_NAME,
    MANIFEST_NAME,
    ReplacementStoreError,
    StoreLayout,
    check_generation,
    check_origin,
    check_size,
    generation_dir,
    is_int,
    load_json,
    manifest_path,
    read_layout_file,
    refuse_newer,
    row_checksums,
)


@dataclass(frozen=True)
class ShardScan:
    crc32: int
    unwritten: int  # rows whose slot 0 is still the sentinel
    first_unwritten: int | None  # instance id of the first such row
    corrupt: int = 0  # written rows that changed on disk (check_records)
    first_corrupt: int | None = None  # instance id of the first such row
    first_corrupt_tokens: np.ndarray | None = None  # [W] its token ids as read


def _readinto_exact(f: BinaryIO, view: memoryview, path: str) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ReplacementStoreError(f"{path}: truncated while reading")
        got += n


def scan_shard(path: str, layout: StoreLayout, shard: int) -> ShardScan:
    """crc32 of the whole file, its never-written rows and its written rows that changed on
    disk, streamed in bounded chunks."""
    first, stop = layout.shard_range(shard)
    chunk_rows = max(1, store_layout.CHUNK_BYTES // layout.record_bytes)
    buf = bytearray(chunk_rows * layout.record_bytes)
    crc, unwritten, first_unwritten, corrupt, first_corrupt = 0, 0, None, 0, None
    first_tokens = None
    try:
        with open(path, "rb", buffering=0) as f:
            for row in range(0, stop - first, chunk_rows):
                n = min(chunk_rows, stop - first - row)
                view = memoryview(buf)[: n * layout.record_bytes]
                _readinto_exact(f, view, path)
                crc = zlib.crc32(view, crc)
                ids = np.arange(first + row, first + row + n, dtype=np.int64)
                records = np.frombuffer(view, layout.record_dtype)
                missing, bad = check_records(records, ids, layout)
                if missing.size and first_unwritten is None:
                    first_unwritten = int(ids[missing[0]])
                if bad.size and first_corrupt is None:
                    first_corrupt = int(ids[bad[0]])
                    first_tokens = records["tokens"][bad[0]].copy()
                unwritten += int(missing.size)
                corrupt += int(bad.size)
    except FileNotFoundError:
        raise ReplacementStoreError(f"{path}: missing") from None
    except OSError as e:
        raise ReplacementStoreError(f"{path}: cannot read: {e.strerror}") from None
    return ShardScan(crc, unwritten, first_unwritten, corrupt, first_corrupt, first_tokens)


def check_records(
    records: np.ndarray, ids: np.ndarray, layout: StoreLayout
) -> tuple[np.ndarray, np.ndarray]:
    """(indices of the never-written rows, indices of the written rows that changed on disk)
    of records [B] of instances [B]. A changed row holds a token id >= V, which no writer
    stores, or does not match the checksum written with it. Both are checked: two ids each
    changed by 2^31 keep the checksum (2^31 * (m_j + m_k), an even sum of odd multipliers)."""
    tokens = records["tokens"]  # [B, W]
    missing = tokens[:, 0] == layout.sentinel
    changed = (tokens >= layout.vocab_size).any(axis=1) | (
        records["check"] != row_checksums(ids, tokens)
    )
    return np.flatnonzero(missing), np.flatnonzero(~missing & changed)


def corrupt_row_message(path: str, layout: StoreLayout, instance: int, tokens: np.ndarray) -> str:
    """The line for a changed row of ``instance`` whose ids [W] are ``tokens``."""
    row = instance % layout.rows_per_shard
    invalid = tokens[tokens >= layout.vocab_size]
    what = (
        f"holds token id {int(invalid[0])}, not below the vocabulary size {layout.vocab_size}"
        if invalid.size
        else "does not match the checksum written with it"
    )
    return f"{path}: row {row} (instance {instance}) {what} (the shard changed on disk after the row was written)"


def scan_message(path: str, layout: StoreLayout, scan: ShardScan) -> str:
    return corrupt_row_message(path, layout, scan.first_corrupt, scan.first_corrupt_tokens)


@dataclass(frozen=True)
class ShardRecord:
    file: str
    first_instance: int
    num_instances: int
    bytes: int
    crc32: int

    def __post_init__(self) -> None:
        if not isinstance(self.file, str):
            raise ReplacementStoreError(f"shard file must be a string, got {self.file!r}")
        for name in ("first_instance", "num_instances", "bytes", "crc32"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ReplacementStoreError(
                    f"shard {self.file}: {name} must be an integer >= 0, got {value!r}"
                )
        if self.crc32 >= 2**32:
            raise ReplacementStoreError(f"shard {self.file}: crc32 {self.crc32} exceeds 32 bits")

    def check_against(self, layout: StoreLayout, shard: int) -> None:
        """Raises unless this record is what ``layout`` says shard ``shard`` must be."""
        first, stop = layout.shard_range(shard)
        expected = (layout.shard_file(shard), first, stop - first, layout.shard_bytes(shard))
        actual = (self.file, self.first_instance, self.num_instances, self.bytes)
        for name, want, got in zip(
            ("file", "first_instance", "num_instances", "bytes"), expected, actual
        ):
            if want != got:
                raise ReplacementStoreError(
                    f"shard {shard} records {name} {got!r}, the layout gives {want!r}"
                )


@dataclass(frozen=True)
class Manifest:
    generation: int
    layout: StoreLayout
    shards: tuple[ShardRecord, ...]

    def __post_init__(self) -> None:
        check_generation(self.generation)
        object.__setattr__(self, "shards", tuple(self.shards))
        if len(self.shards) != self.layout.num_shards:
            raise ReplacementStoreError(
                f"lists {len(self.shards)} shards, the layout has {self.layout.num_shards}"
            )
        for k, record in enumerate(self.shards):
            record.check_against(self.layout, k)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "generation": self.generation,
            "complete": True,
            "layout": self.layout.to_json(),
            "shards": [asdict(r) for r in self.shards],
        }

    @classmethod
    def from_json(cls, obj: Any) -> Manifest:
        if not isinstance(obj, dict):
            raise ReplacementStoreError("expected a JSON object")
        if obj.get("format") != FORMAT_NAME:
            raise ReplacementStoreError(
                f"format is {obj.get('format')!r}, expected {FORMAT_NAME!r}"
            )
        refuse_newer(obj.get("version"))
        if obj.get("version") != FORMAT_VERSION:
            raise ReplacementStoreError(
                f"format version {obj.get('version')!r} is not supported (expected {FORMAT_VERSION})"
            )
        if obj.get("complete") is not True:
            raise ReplacementStoreError("generation is not marked complete")
        shards = obj.get("shards")
        if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
            raise ReplacementStoreError("'shards' must be a list of objects")
        fields = ("file", "first_instance", "num_instances", "bytes", "crc32")
        for k, s in enumerate(shards):
            missing = [f for f in fields if f not in s]
            if missing:
                raise ReplacementStoreError(f"shard {k} lacks {', '.join(missing)}")
        records = tuple(ShardRecord(**{f: s[f] for f in fields}) for s in shards)
        return cls(obj.get("generation"), StoreLayout.from_json(obj.get("layout")), records)


def read_manifest(root: str | os.PathLike, generation: int) -> Manifest:
    path = manifest_path(root, generation)
    if not os.path.exists(path):
        raise ReplacementStoreError(
            f"{path}: missing (generation {generation} was never committed)"
        )
    try:
        manifest = Manifest.from_json(load_json(path))
    except ReplacementStoreError as e:
        msg = str(e)
        raise ReplacementStoreError(msg if msg.startswith(path) else f"{path}: {msg}") from None
    if manifest.generation != generation:
        raise ReplacementStoreError(
            f"{path}: records generation {manifest.generation}, found in generation "
            f"{generation}'s directory"
        )
    return manifest


def commit_generation(root: str | os.PathLike, generation: int, layout: StoreLayout) -> Manifest:
    """Checks every shard is whole and fully written, then writes the manifest atomically.

    Call from one process after every writer of the generation has flushed.
    """
    directory = generation_dir(root, generation)
    if not os.path.isdir(directory):
        raise ReplacementStoreError(f"{directory}: generation directory missing")
    stored = read_layout_file(os.path.join(directory, LAYOUT_NAME))
    if stored.sizes() != layout.sizes():
        raise ReplacementStoreError(
            f"{os.path.join(directory, LAYOUT_NAME)}: generation was written with {stored}, "
            f"commit was asked for {layout}"
        )
    check_origin(os.path.join(directory, LAYOUT_NAME), stored, layout)
    records = []
    for k in range(layout.num_shards):
        path = os.path.join(directory, layout.shard_file(k))
        check_size(path, layout.shard_bytes(k))
        scan = scan_shard(path, layout, k)
        first, stop = layout.shard_range(k)
        if scan.unwritten:
            raise ReplacementStoreError(
                f"{path}: {scan.unwritten} of {stop - first} rows never written (first: "
                f"instance {scan.first_unwritten}); refusing to commit generation {generation}"
            )
        if scan.corrupt:
            raise ReplacementStoreError(
                f"{scan_message(path, layout, scan)}; {scan.corrupt} such "
                f"row(s); refusing to commit generation {generation}"
            )
        size = layout.shard_bytes(k)
        records.append(ShardRecord(layout.shard_file(k), first, stop - first, size, scan.crc32))
    manifest = Manifest(check_generation(generation), layout, tuple(records))
    text = json.dumps(manifest.to_json(), indent=1) + "\n"
    io.atomic_write(os.path.join(directory, MANIFEST_NAME), text.encode("utf-8"))
    return manifest

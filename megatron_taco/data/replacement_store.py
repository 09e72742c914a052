"""On-disk store of SAS replacement tokens: one generation per epoch, sharded, flat in memory.

In epoch t every training instance samples one token per replaced slot from the MLM head;
those tokens are what the model reads at the same slots in epoch t+1. Instead of keeping an
[N, W] array in RAM on every rank, the tokens of epoch t go to ``ROOT/gen_{t:05d}/``::

    layout.json          the StoreLayout, written by the first writer (guards resumes)
    shard_{k:05d}.bin    rows of instances [k*R, min((k+1)*R, N)): W little-endian values
                         each, then the row's 32-bit checksum (row_checksums)
    manifest.json        written last by commit_generation: sizes and crc32 of every shard

A shard is written by exactly one GenerationWriter (ownership is the caller's decision),
with positioned writes at fixed row offsets, so replaying a batch rewrites identical bytes.
A generation is readable only once its manifest exists, and the manifest is written only
after every row was written and found to match the checksum written with it (a row changed
on disk before the commit is refused, not sealed into the manifest); reads check it too. Nothing here is O(N) in memory: files are created, scanned and
read in bounded chunks, and reads go through ``pread`` rather than a memory map so that an
epoch of random reads does not grow the process's resident set to the size of the store.
See docs/replacement_store.md for the protocol and the crash-consistency argument.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

import numpy as np

from megatron_taco import io

logger = logging.getLogger(__name__)

FORMAT_NAME = "megatron_taco.replacement_store"
FORMAT_VERSION = 2  # 2: a checksum after every row
MANIFEST_NAME = "manifest.json"
LAYOUT_NAME = "layout.json"
MAX_VOCAB_SIZE = 2**32 - 1  # uint32's max is the sentinel, so ids go up to 2**32 - 2
_UINT16_VOCAB_LIMIT = 65535
CHECK_BYTES = 4
# Bounds the memory of creation and scanning; large enough that syscalls do not dominate.
_CHUNK_BYTES = 1 << 20
_GENERATION_DIR = re.compile(r"gen_(\d{5,})")


class ReplacementStoreError(ValueError):
    """A bad layout or argument, or a missing or corrupt store file (the message names it)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_generation(generation: Any) -> int:
    if not _is_int(generation) or generation < 0:
        raise ReplacementStoreError(f"generation must be an integer >= 0, got {generation!r}")
    return int(generation)


# ---------------------------------------------------------------------------------------
# layout


@dataclass(frozen=True)
class StoreLayout:
    num_instances: int
    width: int  # W: replacement slots per instance (rows shorter than W leave the rest as 0)
    vocab_size: int
    num_shards: int
    # What decided the rows besides the sizes, as (flag, JSON value) pairs the caller records
    # (SAS: seed, replacement rate, data, tokenizer): a resume with another value would read
    # rows onto other positions or instances. Empty: not recorded (stores written before).
    origin: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name, high in (
            ("num_instances", None),
            ("width", None),
            ("vocab_size", MAX_VOCAB_SIZE),
            ("num_shards", None),
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1 or (high is not None and value > high):
                bound = "an integer >= 1" if high is None else f"an integer in [1, {high}]"
                raise ReplacementStoreError(f"StoreLayout.{name}: expected {bound}, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy ints would break JSON and ==
        origin = tuple(tuple(pair) for pair in self.origin)
        if not all(len(p) == 2 and all(isinstance(x, str) for x in p) for p in origin):
            raise ReplacementStoreError(
                f"StoreLayout.origin: expected (flag, JSON) pairs, got {origin!r}"
            )
        object.__setattr__(self, "origin", tuple(sorted(origin)))

    def sizes(self) -> tuple[int, int, int, int]:
        return self.num_instances, self.width, self.vocab_size, self.num_shards

    def describe(self) -> str:
        return (
            f"{self.num_instances} instances x {self.width} slots, vocabulary "
            f"{self.vocab_size}, {self.num_shards} shards"
        )

    def origin_mismatch(self, other: StoreLayout) -> str | None:
        """How this run's ``other`` differs in origin from this (stored) layout, naming the
        flag of the first differing entry; None when they agree. An unrecorded origin (a
        store written before it was recorded) is not compared."""
        if not self.origin or not other.origin:
            return None
        stored, current = dict(self.origin), dict(other.origin)
        for flag in sorted(stored.keys() | current.keys()):
            if stored.get(flag) != current.get(flag):
                return (
                    f"{flag}: the store was written with {flag} {stored.get(flag, '(unset)')}, "
                    f"this run has {current.get(flag, '(unset)')}: its rows would be read onto "
                    f"other positions or instances; resume with the store's {flag}, or start "
                    "anew (--override-existing-checkpoints, without --load)"
                )
        return None

    @property
    def dtype(self) -> np.dtype:
        # Explicit little-endian so a store written on one machine reads the same elsewhere.
        return np.dtype("<u2" if self.vocab_size <= _UINT16_VOCAB_LIMIT else "<u4")

    @property
    def sentinel(self) -> int:
        """The value of a never-written slot: the dtype's max, never a valid token id."""
        return int(np.iinfo(self.dtype).max)

    @property
    def row_bytes(self) -> int:
        """Bytes of a row's token ids."""
        return self.width * self.dtype.itemsize

    @property
    def record_dtype(self) -> np.dtype:
        """A row as stored: its W token ids, then their checksum (packed, little-endian)."""
        return np.dtype([("tokens", self.dtype, (self.width,)), ("check", "<u4")])

    @property
    def record_bytes(self) -> int:
        return self.row_bytes + CHECK_BYTES

    @property
    def rows_per_shard(self) -> int:
        return -(-self.num_instances // self.num_shards)

    def shard_range(self, shard: int) -> tuple[int, int]:
        """[first, stop) instances of ``shard``; empty for trailing shards when R*k >= N."""
        if not _is_int(shard) or not 0 <= shard < self.num_shards:
            raise ReplacementStoreError(
                f"shard {shard!r} out of range [0, {self.num_shards}) for {self}"
            )
        r = self.rows_per_shard
        return min(shard * r, self.num_instances), min((shard + 1) * r, self.num_instances)

    def shard_bytes(self, shard: int) -> int:
        first, stop = self.shard_range(shard)
        return (stop - first) * self.record_bytes

    def shard_file(self, shard: int) -> str:
        self.shard_range(shard)  # validates
        return f"shard_{int(shard):05d}.bin"

    def shard_of(self, instance_ids: np.ndarray) -> np.ndarray:
        """Shard index of each instance: what a caller routes rows to owners by."""
        return _instance_ids(instance_ids, self, "shard_of") // self.rows_per_shard

    def to_json(self) -> dict[str, Any]:
        return {
            "num_instances": self.num_instances,
            "width": self.width,
            "vocab_size": self.vocab_size,
            "num_shards": self.num_shards,
            "dtype": self.dtype.name,
            "version": FORMAT_VERSION,
            **({"origin": dict(self.origin)} if self.origin else {}),
        }

    @classmethod
    def from_json(cls, obj: Any) -> StoreLayout:
        if not isinstance(obj, dict):
            raise ReplacementStoreError(f"layout: expected a JSON object, got {obj!r}")
        keys = ("num_instances", "width", "vocab_size", "num_shards")
        missing = [k for k in (*keys, "dtype") if k not in obj]
        if missing:
            raise ReplacementStoreError(f"layout: missing field(s) {', '.join(missing)}")
        _refuse_newer(obj.get("version"))
        if obj.get("version") != FORMAT_VERSION:
            raise ReplacementStoreError(
                f"layout: format version {obj.get('version', 1)!r}, this version reads "
                f"{FORMAT_VERSION} (rows with checksums); delete the generation to write it anew"
            )
        origin = obj.get("origin", {})
        if not isinstance(origin, dict):
            raise ReplacementStoreError(f"layout: 'origin' must be an object, got {origin!r:.60}")
        layout = cls(**{k: obj[k] for k in keys}, origin=tuple(origin.items()))
        if obj["dtype"] != layout.dtype.name:
            raise ReplacementStoreError(
                f"layout: dtype {obj['dtype']!r} does not match vocab_size {layout.vocab_size} "
                f"(expected {layout.dtype.name!r})"
            )
        return layout


def _refuse_newer(version: Any) -> None:
    # Never "delete it": a newer version's generation is good data this one cannot read.
    if _is_int(version) and version > FORMAT_VERSION:
        raise ReplacementStoreError(
            f"written by a newer megatron_taco (store format version {version}, this version "
            f"reads {FORMAT_VERSION}): upgrade megatron_taco to read it"
        )


def _instance_ids(instance_ids: Any, layout: StoreLayout, where: str) -> np.ndarray:
    ids = np.asarray(instance_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ReplacementStoreError(
            f"{where}: instance ids must be a 1-D integer array, got shape {ids.shape} "
            f"dtype {ids.dtype}"
        )
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (ids.min() < 0 or ids.max() >= layout.num_instances):
        bad = ids[(ids < 0) | (ids >= layout.num_instances)][0]
        raise ReplacementStoreError(
            f"{where}: instance id {bad} out of range [0, {layout.num_instances})"
        )
    return ids


@functools.cache
def _multipliers(width: int) -> np.ndarray:
    """Odd 32-bit multipliers of the instance id and of each of the W slots (fixed forever:
    they are part of the format)."""
    k = np.arange(width + 1, dtype=np.uint64)
    m = ((k * np.uint64(2654435761) + np.uint64(40503)) & np.uint64(0xFFFFFFFF)) | np.uint64(1)
    m.flags.writeable = False  # cached
    return m


def row_checksums(instance_ids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """[B] uint32 checksums of rows [B, W] of instances [B]: (c + id * m_0 + sum_j x_j m_j+1)
    mod 2^32 with odd m, vectorised (a commit checks millions of rows). Any change of one
    token id, or a row written at another instance's place, changes it: delta * m is not 0
    mod 2^32 for an odd m and 0 < |delta| < 2^32."""
    m = _multipliers(tokens.shape[1])
    h = instance_ids.astype(np.uint64) * m[0] + tokens.astype(np.uint64) @ m[1:]
    return ((h + np.uint64(0x5BD1E995)) & np.uint64(0xFFFFFFFF)).astype("<u4")


def _runs(sorted_ids: np.ndarray, rows_per_shard: int) -> Iterator[tuple[int, int]]:
    """[start, stop) slices of consecutive ids within one shard: one syscall per slice."""
    n = len(sorted_ids)
    if n == 0:
        return
    breaks = (np.diff(sorted_ids) != 1) | (sorted_ids[1:] % rows_per_shard == 0)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1)).tolist()
    yield from zip(starts, [*starts[1:], n])


# ---------------------------------------------------------------------------------------
# paths and file primitives


def generation_dir(root: str | os.PathLike, generation: int) -> str:
    return os.path.join(os.fspath(root), f"gen_{_check_generation(generation):05d}")


def manifest_path(root: str | os.PathLike, generation: int) -> str:
    return os.path.join(generation_dir(root, generation), MANIFEST_NAME)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _pread_exact(fd: int, size: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, size, offset)
    while len(data) < size:  # only a file truncated behind our back ends early
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            raise ReplacementStoreError(
                f"{path}: truncated while reading (ends before byte {offset + size})"
            )
        data += more
    return data


def _as_bytes(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array)).cast("B")


def _check_size(path: str, expected: int) -> None:
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise ReplacementStoreError(f"{path}: missing") from None
    except OSError as e:
        raise ReplacementStoreError(f"{path}: cannot stat: {e.strerror}") from None
    if size < expected:
        raise ReplacementStoreError(f"{path}: truncated (size {size} bytes, expected {expected})")
    if size > expected:
        raise ReplacementStoreError(f"{path}: wrong size ({size} bytes, expected {expected})")


def _load_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ReplacementStoreError(f"{path}: missing") from None
    except OSError as e:
        raise ReplacementStoreError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ReplacementStoreError(f"{path}: not valid JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ReplacementStoreError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None


def read_layout_file(path: str) -> StoreLayout:
    obj = _load_json(path)
    try:
        return StoreLayout.from_json(obj)
    except ReplacementStoreError as e:
        raise ReplacementStoreError(f"{path}: {e}") from None


def check_origin(path: str, stored: StoreLayout, layout: StoreLayout) -> None:
    differs = stored.origin_mismatch(layout)
    if differs is not None:
        raise ReplacementStoreError(f"{path}: {differs}")


def _layout_json_bytes(layout: StoreLayout) -> bytes:
    return (json.dumps(layout.to_json(), indent=1) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------
# shard scanning (commit and verification)


@dataclass(frozen=True)
class ShardScan:
    crc32: int
    unwritten: int  # rows whose slot 0 is still the sentinel
    first_unwritten: int | None  # instance id of the first such row
    corrupt: int = 0  # written rows that changed on disk (_check_records)
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
    chunk_rows = max(1, _CHUNK_BYTES // layout.record_bytes)
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
                missing, bad = _check_records(records, ids, layout)
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


def _check_records(
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


def _scan_message(path: str, layout: StoreLayout, scan: ShardScan) -> str:
    return corrupt_row_message(path, layout, scan.first_corrupt, scan.first_corrupt_tokens)


# ---------------------------------------------------------------------------------------
# manifest


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
            if not _is_int(value) or value < 0:
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
        _check_generation(self.generation)
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
        _refuse_newer(obj.get("version"))
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
        manifest = Manifest.from_json(_load_json(path))
    except ReplacementStoreError as e:
        msg = str(e)
        raise ReplacementStoreError(msg if msg.startswith(path) else f"{path}: {msg}") from None
    if manifest.generation != generation:
        raise ReplacementStoreError(
            f"{path}: records generation {manifest.generation}, found in generation "
            f"{generation}'s directory"
        )
    return manifest


# ---------------------------------------------------------------------------------------
# writing


def _fill_sentinel(fd: int, nbytes: int, layout: StoreLayout) -> None:
    elems = max(1, _CHUNK_BYTES // layout.dtype.itemsize)
    pattern = memoryview(np.full(elems, layout.sentinel, dtype=layout.dtype)).cast("B")
    for offset in range(0, nbytes, len(pattern)):
        _pwrite_all(fd, pattern[: min(len(pattern), nbytes - offset)], offset)


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
        io.atomic_write(path, _layout_json_bytes(layout))  # racing writers write equal bytes
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
    bad = [k for k in given if not _is_int(k) or not 0 <= k < layout.num_shards]
    if bad:
        raise ReplacementStoreError(
            f"owned_shards: {bad[0]!r} is not a shard index in [0, {layout.num_shards})"
        )
    return sorted({int(k) for k in given})


class GenerationWriter:
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
        self.generation = _check_generation(generation)
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
            _check_size(path, self.layout.shard_bytes(shard))  # reopened: never truncate
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
        ids = _instance_ids(instance_ids, self.layout, f"{self.directory}: write")
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
        for start, stop in _runs(ids, r):
            k = int(ids[start]) // r
            offset = (int(ids[start]) - k * r) * self.layout.record_bytes
            _pwrite_all(self._files[k].fileno(), _as_bytes(records[start:stop]), offset)

    def flush(self) -> None:
        """Makes every row written so far durable (call before recording a checkpoint)."""
        for f in self._files.values():
            os.fsync(f.fileno())

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def __enter__(self) -> GenerationWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> None:
        raise TypeError("GenerationWriter holds open shard files and cannot be pickled")


# ---------------------------------------------------------------------------------------
# commit


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
        _check_size(path, layout.shard_bytes(k))
        scan = scan_shard(path, layout, k)
        first, stop = layout.shard_range(k)
        if scan.unwritten:
            raise ReplacementStoreError(
                f"{path}: {scan.unwritten} of {stop - first} rows never written (first: "
                f"instance {scan.first_unwritten}); refusing to commit generation {generation}"
            )
        if scan.corrupt:
            raise ReplacementStoreError(
                f"{_scan_message(path, layout, scan)}; {scan.corrupt} such "
                f"row(s); refusing to commit generation {generation}"
            )
        size = layout.shard_bytes(k)
        records.append(ShardRecord(layout.shard_file(k), first, stop - first, size, scan.crc32))
    manifest = Manifest(_check_generation(generation), layout, tuple(records))
    text = json.dumps(manifest.to_json(), indent=1) + "\n"
    io.atomic_write(os.path.join(directory, MANIFEST_NAME), text.encode("utf-8"))
    return manifest


# ---------------------------------------------------------------------------------------
# reading


class GenerationReader:
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
        self.generation = _check_generation(generation)
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
            _check_size(path, record.bytes)
            if verify:
                scan = scan_shard(path, self.layout, k)
                if scan.crc32 != record.crc32:
                    raise ReplacementStoreError(
                        f"{path}: checksum mismatch (crc32 {scan.crc32:08x}, manifest records "
                        f"{record.crc32:08x})"
                    )
                if scan.corrupt:  # not after a commit of this version, which checks them
                    raise ReplacementStoreError(_scan_message(path, self.layout, scan))

    def __len__(self) -> int:
        return self.layout.num_instances

    def _file(self, shard: int) -> tuple[BinaryIO, str]:
        path = os.path.join(self.directory, self.layout.shard_file(shard))
        if shard not in self._files:
            _check_size(path, self.layout.shard_bytes(shard))  # also after unpickling
            self._files[shard] = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close())
        return self._files[shard], path

    def read(self, instance_ids: np.ndarray) -> np.ndarray:
        """Rows [B, W] of ``instance_ids`` (any order, repeats allowed) in the layout's dtype."""
        ids = _instance_ids(instance_ids, self.layout, f"{self.directory}: read")
        records = np.empty(len(ids), dtype=self.layout.record_dtype)
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        r, record_bytes = self.layout.rows_per_shard, self.layout.record_bytes
        for start, stop in _runs(sorted_ids, r):
            k = int(sorted_ids[start]) // r
            f, path = self._file(k)
            offset = (int(sorted_ids[start]) - k * r) * record_bytes
            data = _pread_exact(f.fileno(), (stop - start) * record_bytes, offset, path)
            records[order[start:stop]] = np.frombuffer(data, self.layout.record_dtype)
        self._check_records(ids, records)
        return records["tokens"].copy()

    def _check_records(self, ids: np.ndarray, records: np.ndarray) -> None:
        unwritten, corrupt = _check_records(records, ids, self.layout)
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

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def __enter__(self) -> GenerationReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Open files do not travel; the copy reopens (and size-checks) shards on first read.
        state = dict(self.__dict__)
        state["_files"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


# ---------------------------------------------------------------------------------------
# generations


def list_generations(root: str | os.PathLike) -> list[int]:
    """Generation indices with a directory under ``root``, committed or not, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = _GENERATION_DIR.fullmatch(name)
        # Only canonical names: gen_000001 would not be where generation 1 is looked for.
        if m and name == f"gen_{int(m.group(1)):05d}" and os.path.isdir(os.path.join(root, name)):
            found.append(int(m.group(1)))
    return sorted(found)


def delete_generations(root: str | os.PathLike, keep: Iterable[int]) -> list[int]:
    """Removes every generation directory not in ``keep``; returns what was removed.

    No process may be reading or writing a removed generation at the time.
    """
    keep_set = {_check_generation(g) for g in keep}
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

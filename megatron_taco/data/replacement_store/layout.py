"""The store's layout: its StoreLayout (the shape every writer and reader agrees on, with the
origin of its tokens), row checksums, where a generation's files are, and the positioned,
bounded reads and writes every part uses.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

FORMAT_NAME = "megatron_taco.replacement_store"
FORMAT_VERSION = 2  # 2: a checksum after every row
MANIFEST_NAME = "manifest.json"
LAYOUT_NAME = "layout.json"
MAX_VOCAB_SIZE = 2**32 - 1  # uint32's max is the sentinel, so ids go up to 2**32 - 2
_UINT16_VOCAB_LIMIT = 65535
CHECK_BYTES = 4
# Bounds the memory of creation and scanning; large enough that syscalls do not dominate.
CHUNK_BYTES = 1 << 20
GENERATION_DIR = re.compile(r"gen_(\d{5,})")


class ReplacementStoreError(ValueError):
    """A bad layout or argument, or a missing or corrupt store file (the message names it)."""


class ShardFiles:
    """The shard files a reader or writer holds open; ``close()``, or the end of a ``with``
    block, closes them."""

    _files: dict[int, BinaryIO]

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_generation(generation: Any) -> int:
    if not is_int(generation) or generation < 0:
        raise ReplacementStoreError(f"generation must be an integer >= 0, got {generation!r}")
    return int(generation)


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
            if not is_int(value) or value < 1 or (high is not None and value > high):
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
        if not is_int(shard) or not 0 <= shard < self.num_shards:
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
        return checked_ids(instance_ids, self, "shard_of") // self.rows_per_shard

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
        refuse_newer(obj.get("version"))
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


def refuse_newer(version: Any) -> None:
    # Never "delete it": a newer version's generation is good data this one cannot read.
    if is_int(version) and version > FORMAT_VERSION:
        raise ReplacementStoreError(
            f"written by a newer megatron_taco (store format version {version}, this version "
            f"reads {FORMAT_VERSION}): upgrade megatron_taco to read it"
        )


def checked_ids(instance_ids: Any, layout: StoreLayout, where: str) -> np.ndarray:
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


def shard_runs(sorted_ids: np.ndarray, rows_per_shard: int) -> Iterator[tuple[int, int]]:
    """[start, stop) slices of consecutive ids within one shard: one syscall per slice."""
    n = len(sorted_ids)
    if n == 0:
        return
    breaks = (np.diff(sorted_ids) != 1) | (sorted_ids[1:] % rows_per_shard == 0)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1)).tolist()
    yield from zip(starts, [*starts[1:], n])


def generation_dir(root: str | os.PathLike, generation: int) -> str:
    return os.path.join(os.fspath(root), f"gen_{check_generation(generation):05d}")


def manifest_path(root: str | os.PathLike, generation: int) -> str:
    return os.path.join(generation_dir(root, generation), MANIFEST_NAME)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def pread_exact(fd: int, size: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, size, offset)
    while len(data) < size:  # only a file truncated behind our back ends early
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            raise ReplacementStoreError(
                f"{path}: truncated while reading (ends before byte {offset + size})"
            )
        data += more
    return data


def as_bytes(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array)).cast("B")


def check_size(path: str, expected: int) -> None:
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


def load_json(path: str) -> Any:
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
    obj = load_json(path)
    try:
        return StoreLayout.from_json(obj)
    except ReplacementStoreError as e:
        raise ReplacementStoreError(f"{path}: {e}") from None


def check_origin(path: str, stored: StoreLayout, layout: StoreLayout) -> None:
    differs = stored.origin_mismatch(layout)
    if differs is not None:
        raise ReplacementStoreError(f"{path}: {differs}")


def layout_json_bytes(layout: StoreLayout) -> bytes:
    return (json.dumps(layout.to_json(), indent=1) + "\n").encode("utf-8")

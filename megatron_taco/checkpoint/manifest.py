"""metadata.json and its manifest: the schema a reader relies on, the checksums, and the
verification of every file of a checkpoint before anything of it is loaded: presence, size,
CRC-32, regular files only, and no .pt file that pickles anything but tensors, numbers,
strings and DeepSpeed's few bookkeeping classes.
"""

from __future__ import annotations

import json
import os
import re
import stat
import zlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_taco import io
from megatron_taco.checkpoint.errors import CheckpointInvalid, CheckpointTooNew
from megatron_taco.checkpoint.layout import (
    FORMAT,
    METADATA_FILENAME,
    checkpoint_tag,
    format_version,
    retried_read,
)
from megatron_taco.checkpoint.safe_files import (
    UnsafeFile,
    checksum_regular,
    deepspeed_safe_globals,
    exception_line,
    kind_of,
    read_regular,
    regular_files,
    require_safe_torch,
    unsafe_globals,
)
from megatron_taco.errors import ConfigError

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


def metadata_checksum(meta: dict[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(text.encode('utf-8')):08x}"


def write_metadata(iter_dir: str, meta: dict[str, Any], files: dict[str, dict]) -> None:
    # Round-tripped first so the checksum covers exactly what a reader will parse.
    body = json.loads(json.dumps({**meta, "files": files}, default=str))
    body["checksum"] = metadata_checksum(body)
    text = json.dumps(body, indent=2)
    io.write_durably(os.path.join(iter_dir, METADATA_FILENAME), lambda f: f.write(text.encode()))


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
    raw = _read(path, lambda: read_regular(path, _MAX_METADATA_BYTES + 1))
    if len(raw) > _MAX_METADATA_BYTES:
        raise CheckpointInvalid(f"{path} is larger than {_MAX_METADATA_BYTES >> 20} MiB")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointInvalid(f"{path} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointInvalid(f"{path} must hold a JSON object, got {type(meta).__name__}")
    _check_schema(path, meta)
    if meta["checksum"] != metadata_checksum(meta):
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


def manifest_entry(path: str) -> dict[str, Any]:
    size, crc = checksum_regular(path)
    return {"bytes": size, "crc32": crc}


def relative_files(iter_dir: str) -> set[str]:
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
    present = _read(iter_dir, lambda: relative_files(iter_dir))
    for name in sorted(set(manifest) - present):
        raise CheckpointInvalid(f"{paths[name]} is missing")
    for name in sorted(present - set(manifest)):
        raise CheckpointInvalid(
            f"{os.path.join(iter_dir, name)} is not in the manifest of {METADATA_FILENAME}"
        )
    for name in sorted(manifest):
        _verify_file(paths[name], manifest[name])


def _read(path: str, read: Callable[[], Any]) -> Any:
    """retried_read; a missing file, or one that is not a regular file, is CheckpointInvalid."""
    try:
        return retried_read(path, read)
    except FileNotFoundError as e:
        raise CheckpointInvalid(f"{e.filename or path} is missing") from None
    except UnsafeFile as e:
        raise CheckpointInvalid(str(e)) from None


def _verify_file(path: str, entry: dict[str, Any]) -> None:
    size, crc = _read(path, lambda: checksum_regular(path))
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
        if not unsafe:
            with torch.serialization.safe_globals(deepspeed_safe_globals()):
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointInvalid(
            f"{path} is not a readable torch checkpoint ({exception_line(e)})"
        ) from None
    if unsafe:
        raise CheckpointInvalid(
            f"{path} holds pickled objects other than tensors, numbers and strings "
            f"({', '.join(unsafe[:3])}); refusing to load it"
        )


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

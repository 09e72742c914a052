"""Reading files out of a checkpoint directory that someone else may have written.

A checkpoint is untrusted input: a symbolic link in it may point at a private key or at
``/``, a FIFO or a character device (``/dev/zero``) blocks or never ends a read. Everything
here therefore opens files without following a final symbolic link and without blocking
(``O_NOFOLLOW | O_NONBLOCK``), and accepts only regular files; directories are walked without
following links, and anything in them that is neither a regular file nor a real directory is
refused with a message naming it and what it is. Failures are ``UnsafeFile`` (a ValueError)
or ``OSError`` from the read itself; callers turn both into their own one-line errors.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import stat
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_taco.errors import ConfigError

_CHUNK = 1 << 20


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


_OPEN_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


_DIR_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


class UnsafeFile(ValueError):
    """Not a regular file (a symbolic link, FIFO, device, socket); the message names it."""


def kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: str, mode: int) -> UnsafeFile:
    return UnsafeFile(f"{path} is {kind_of(mode)}, not a regular file; refusing to read it")


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path``; a symbolic link, FIFO or device
    raises UnsafeFile without blocking."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW on a symbolic link
            raise _refuse(path, stat.S_IFLNK) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, limit: int | None = None) -> bytes:
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        return f.read() if limit is None else f.read(limit)


def checksum_fd(fd: int, sink: Callable[[bytes], object] | None = None) -> tuple[int, str]:
    """(size, CRC-32 as 8 hex digits) of what ``fd`` holds from its current offset on;
    every chunk also goes to ``sink`` (a copy) when given."""
    crc, size = 0, 0
    while chunk := os.read(fd, _CHUNK):
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
        if sink is not None:
            sink(chunk)
    return size, f"{crc:08x}"


def checksum_regular(path: str) -> tuple[int, str]:
    with os.fdopen(open_regular(path), "rb") as f:
        return checksum_fd(f.fileno())


def copy_regular(src: str, dst: str) -> tuple[int, str]:
    """Copy the regular file ``src`` to the new file ``dst`` (fsynced); returns the size and
    CRC-32 of the bytes copied, so the caller can check them against a manifest."""
    with os.fdopen(open_regular(src), "rb") as f, open(dst, "xb") as out:
        result = checksum_fd(f.fileno(), out.write)
        out.flush()
        os.fsync(out.fileno())
    return result


def regular_files(directory: str) -> list[str]:
    """Every file under ``directory`` as a '/'-separated relative path, sorted. The walk
    follows no symbolic link (``directory`` itself included) and raises UnsafeFile at the
    first entry that is neither a regular file nor a real directory."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise (
            _refuse(directory, st.st_mode)
            if stat.S_ISLNK(st.st_mode)
            else UnsafeFile(f"{directory} is {kind_of(st.st_mode)}, not a directory")
        )
    fd = os.open(directory, _DIR_FLAGS)
    try:
        return sorted(_walk(fd, directory, ""))
    finally:
        os.close(fd)


def _walk(dir_fd: int, shown: str, prefix: str) -> Iterator[str]:
    for name in sorted(os.listdir(dir_fd)):
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        path = os.path.join(shown, name)
        if stat.S_ISREG(mode):
            yield prefix + name
        elif stat.S_ISDIR(mode):
            sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                yield from _walk(sub, path, f"{prefix}{name}/")
            finally:
                os.close(sub)
        else:
            raise _refuse(path, mode)


def deepspeed_safe_globals() -> list[type]:
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


def exception_line(error: BaseException) -> str:
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
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise ConfigError(
            f"--load: {path} holds pickled objects other than tensors, numbers and strings "
            f"({_error_detail(e)}); refusing to load it{hint}"
        ) from None
    except Exception as e:
        raise ConfigError(
            f"--load: {path} is not a readable checkpoint file ({exception_line(e)}){hint}"
        ) from None


def unsafe_globals(path: str) -> list[str]:
    """The globals a torch zip file would import beyond the weights_only defaults and
    DeepSpeed's safe classes, found by reading its pickle's opcodes (nothing is executed)."""
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in deepspeed_safe_globals()}
    found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    return [name for name in found if name not in allowed]

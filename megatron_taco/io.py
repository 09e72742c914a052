"""Durable writes: whoever reads a path sees its old content or the whole new one, and the
new one survives a crash or power cut once the call returns. Every file this package writes
for another process or a later run goes through here. Imports nothing of ours.

A file is written under a unique temporary name in its own directory (``mkstemp``: two
writers on two nodes never share one), fsynced, renamed over the path and the directory
fsynced. The temporary name is ``<name>.<random>.tmp`` (what the replacement store and
the checkpoint tracker's clean-up recognise as a crash's leftover).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Create ``path`` (replacing it, no rename) with ``write(file)``, fsynced: for files
    inside a directory that is itself published atomically (a checkpoint's)."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def umask_mode(path: str) -> None:
    """Give ``path`` the mode a plain open() would have (0666 less the umask): some writers
    (safetensors, mkstemp) create files 0600, unreadable for the rest of a shared cluster."""
    mask = os.umask(0)
    os.umask(mask)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666 & ~mask)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside ``path`` for a writer that wants a file name (torch.save,
    safetensors, savefig, a copy); on a clean exit it is fsynced, given the umask's mode and
    renamed over ``path``, on an error removed."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        yield tmp
        fsync_file(tmp)
        umask_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[IO[bytes]], Any]) -> None:
    """Replace ``path`` whole with ``data`` (str is written as UTF-8) or what
    ``data(file)`` writes to the binary file."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)


def remove(path: str) -> None:
    """Remove a file or a directory tree, quietly (clean-up that must not fail a caller)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)

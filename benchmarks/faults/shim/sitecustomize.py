"""The fault campaign's shim (benchmarks/bench_faults.py): imported by every Python process of a
job whose PYTHONPATH starts with this folder, it does nothing unless FAULTS_SHIM holds a JSON
spec. No product code changes: it wraps ``open``/``os.pwrite``/``os.write``/``os.fsync``, and
patches functions of megatron_taco modules right after they are imported.

Spec keys (all optional):
  rank     the global rank (env RANK) the I/O and point faults act on; other ranks only count
  io       {"path_re", "after_bytes", "action": "kill_job" | "errno", "errno", "op": "write" |
           "fsync", "sticky_re"}: once this rank has written ``after_bytes`` bytes into files
           matching ``path_re`` (or at its first matching fsync), kill the whole job (SIGSTOP
           every process of it, then SIGKILL) or raise OSError(errno) there; ``sticky_re``: later
           writes to matching files fail too (a disk that stays full)
  point    {"name": "after_metadata@6", "action": "kill_self" | "kill_job"}: at that hook_point
  census   a file to which this rank's byte counts by category are written (reference runs)
  bug      a deliberate bug to plant (see BUGS)
  marker   a file to which one JSON line is appended when a fault fires (time, rank, where)
The job is every process whose environment holds FAULTS_JOB (set by the campaign).
"""

from __future__ import annotations

import builtins
import contextlib
import errno as errno_module
import importlib.abc
import importlib.machinery
import io as io_module
import json
import os
import re
import signal
import sys
import time

_SPEC = json.loads(os.environ.get("FAULTS_SHIM") or "null")
_real_open, _real_pwrite, _real_write, _real_fsync = builtins.open, os.pwrite, os.write, os.fsync
_RANK = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None


def _job_pids() -> list[int]:
    """Every process of this job: they inherit FAULTS_JOB (torchrun puts its workers in
    sessions of their own, and orphans are re-parented, so neither a process group nor the
    tree finds them all)."""
    needle = f"FAULTS_JOB={os.environ.get('FAULTS_JOB', '')}".encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(name))
        except OSError:
            continue
    return pids


def _mark(where: str) -> None:
    path = _SPEC.get("marker")
    if path:
        line = json.dumps({"time": time.time(), "rank": _RANK, "pid": os.getpid(), "where": where})
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _real_write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def kill_job() -> None:
    """Freeze every process of the job, then kill them all (a node lost at one instant)."""
    me = os.getpid()
    pids = [p for p in _job_pids() if p != me]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
    os.kill(me, signal.SIGKILL)


def _fire(where: str, action: str, code: int | None = None, path: str = "") -> None:
    _mark(where)
    if action == "kill_job":
        kill_job()
    elif action == "kill_self":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "errno":
        raise OSError(code, os.strerror(code), path)


# -- byte counting and I/O faults ---------------------------------------------------------

_CENSUS_RE = {
    "ckpt": re.compile(r"/(iter_\d{7})\.tmp-[0-9a-f]+/"),
    "tracker": re.compile(r"latest_checkpointed_iteration\.txt\.(tmp\.|[A-Za-z0-9_]{8}\.tmp)"),
    "store": re.compile(r"/replacement_store/gen_\d{5}/"),
}


class _State:
    written = 0  # bytes this rank wrote into files matching io.path_re
    fired = False
    census: dict[str, int] = {}


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _count_census(path: str, n: int, prefix: str = "") -> None:
    for name, pattern in _CENSUS_RE.items():
        m = pattern.search(path)
        if m:
            key = prefix + (f"{name}:{m.group(1)}" if m.groups() else name)
            _State.census[key] = _State.census.get(key, 0) + n


def _dump_census() -> None:
    path = _SPEC.get("census")
    if path and _RANK is not None:
        with _real_open(f"{path}.rank{_RANK}", "w") as f:
            json.dump(_State.census, f)


def _before_write(path: str, n: int) -> None:
    """Called before ``n`` bytes go to ``path`` on this rank; may raise or kill."""
    if "census" in _SPEC:
        _count_census(path, n)
    io = _SPEC.get("io")
    if io is None or _SPEC.get("rank") != _RANK:
        return
    if _State.fired:
        if io.get("sticky_re") and re.search(io["sticky_re"], path):
            raise OSError(io["errno"], os.strerror(io["errno"]), path)
        return
    if io.get("op", "write") != "write" or not re.search(io["path_re"], path):
        return
    if _State.written + n > io["after_bytes"]:
        _State.fired = True
        where = f"write of {path} at byte {io['after_bytes'] - _State.written} of {n}"
        _fire(where, io["action"], io.get("errno"), path)
    _State.written += n


def _before_fsync(path: str) -> None:
    io = _SPEC.get("io")
    if io is None or _SPEC.get("rank") != _RANK or io.get("op") != "fsync" or _State.fired:
        return
    if re.search(io["path_re"], path):
        if _State.written >= io["after_bytes"]:
            _State.fired = True
            _fire(f"fsync of {path}", io["action"], io.get("errno"), path)
        _State.written += 1  # fsyncs counted: after_bytes is the index of the one that fails


class _Watched:
    """A file object whose writes are counted (and may fail) before they happen."""

    def __init__(self, f, path: str) -> None:
        self._f, self._path = f, path

    def write(self, data):
        _before_write(self._path, len(memoryview(data).cast("B")) if not isinstance(data, str)
                      else len(data.encode()))  # fmt: skip
        return self._f.write(data)

    def close(self):
        try:
            return self._f.close()
        finally:
            _dump_census()

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return self._f.__exit__(*exc)
        finally:
            _dump_census()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _watched(path: str) -> bool:
    """Only files the census or the fault is about are wrapped: every other open returns
    the real file object (some libraries check its type)."""
    io = _SPEC.get("io") or {}
    if "census" in _SPEC and any(p.search(path) for p in _CENSUS_RE.values()):
        return True
    return any(io.get(key) and re.search(io[key], path) for key in ("path_re", "sticky_re"))


def _open(file, mode="r", *args, **kwargs):
    f = _real_open(file, mode, *args, **kwargs)
    if not any(c in mode for c in "wax+"):
        return f
    if isinstance(file, int):  # os.fdopen (a temporary file of the store's manifest)
        path = _fd_path(file)
    elif isinstance(file, (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(file))
    else:
        return f
    return _Watched(f, path) if _watched(path) else f


def _pwrite(fd, data, offset):
    _before_write(_fd_path(fd), len(memoryview(data).cast("B")))
    return _real_pwrite(fd, data, offset)


def _write(fd, data):
    if fd > 2:
        _before_write(_fd_path(fd), len(memoryview(data).cast("B")))
    return _real_write(fd, data)


def _fsync(fd):
    fileno = fd if isinstance(fd, int) else fd.fileno()
    path = _fd_path(fileno)
    if "census" in _SPEC:
        _count_census(path, 1, "fsync:")
    _before_fsync(path)
    result = _real_fsync(fd)
    if "census" in _SPEC and any(p.search(path) for p in _CENSUS_RE.values()):
        _dump_census()
    return result


# -- hook points and planted bugs, patched into modules as they are imported ---------------


def _patch_faults(module) -> None:
    point = _SPEC.get("point")
    if point is None:
        return
    original = module.hook_point

    def hook_point(name: str, qualifier: int) -> None:
        if point["name"] in (name, f"{name}@{qualifier}") and _SPEC.get("rank") == _RANK:
            _fire(f"hook point {name}@{qualifier}", point["action"])
        original(name, qualifier)

    module.hook_point = hook_point


def _bug_tracker_before_metadata(module) -> None:
    """The tracker names the new checkpoint before its metadata.json is written and before
    the directory is renamed into place (the ordering the checkpoint code exists to avoid)."""
    original = module.write_metadata

    def write_metadata(iter_dir, meta, files):
        save_dir = os.path.dirname(iter_dir)
        module.io.atomic_write(module.tracker_path(save_dir), f"{meta['iteration']}\n")
        return original(iter_dir, meta, files)

    module.write_metadata = write_metadata


def _bug_tracker_before_files(module) -> None:
    """The tracker names the new checkpoint as soon as its save starts, before any of its
    files is written (let alone durable)."""
    original = module._start_save

    def _start_save(save_dir, tmp_dir, sweep):
        original(save_dir, tmp_dir, sweep)
        iteration = int(re.search(r"iter_(\d+)\.tmp-", tmp_dir).group(1))
        module.io.atomic_write(module.tracker_path(save_dir), f"{iteration}\n")

    module._start_save = _start_save


def _bug_no_rng_restore(module) -> None:
    """A resume that silently keeps the fresh RNG states instead of the saved ones."""
    module.set_rng_states = lambda states, rng_tracker: None


BUGS = {
    "tracker_before_files": ("megatron_taco.checkpoint.save", _bug_tracker_before_files),
    "tracker_before_metadata": ("megatron_taco.checkpoint.save", _bug_tracker_before_metadata),
    "no_rng_restore": ("megatron_taco.checkpoint.load", _bug_no_rng_restore),
}


def _patches() -> dict[str, list]:
    out: dict[str, list] = {"megatron_taco.runtime.faults": [_patch_faults]}
    bug = _SPEC.get("bug")
    if bug:
        name, patch = BUGS[bug]
        out.setdefault(name, []).append(patch)
    return out


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict[str, list]) -> None:
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, patches = spec.loader, self.patches[fullname]
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            for patch in patches:
                patch(module)

        loader.exec_module = exec_and_patch
        return spec


def _install() -> None:
    if _SPEC is None:
        return
    builtins.open = io_module.open = _open
    os.pwrite, os.write, os.fsync = _pwrite, _write, _fsync
    sys.meta_path.insert(0, _PatchingFinder(_patches()))
    if _SPEC.get("io") and _SPEC["io"].get("action") == "errno":
        _SPEC["io"]["errno"] = int(_SPEC["io"].get("errno", errno_module.ENOSPC))


_install()

"""What the ranks settle among themselves around the rendezvous.

Before it (no process group yet): work every rank of a node would repeat on the same files,
above all verifying the checkpoint --load restores (it reads every byte), is done once per
node (``verify_once_per_node``). The ranks a launcher started on one node share a lock file
named after that launch; the first to take the lock does the work and leaves its result (or
its one-line error) beside the lock, and the others read it. A rank that dies while holding
the lock releases it, and the next one does the work itself. Errors stay one line before
any process group exists, on every rank.

After it: every rank states the checkpoint it is about to load, and all of them compare
(``agree_on_load``). Nodes verify on their own, so a stale view of a network file system
or an error on one node could otherwise make ranks load different iterations.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from itertools import groupby
from typing import Any

from megatron_taco import io
from megatron_taco.errors import ConfigError
from megatron_taco.runtime.launcher import launch_id

_STALE_S = 7 * 24 * 3600


def _results_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"megatron_taco-{os.getuid()}")


def _private_dir() -> str:
    """A directory of this user's only (0700, owned by us, not a link): a result file
    planted by another user must not be taken for a rank's verdict."""
    path = _results_dir()
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(
            f"{path} is not a private directory of this user (mode {stat.filemode(st.st_mode)}); "
            "remove it, or set TMPDIR to another directory"
        )
    return path


def _sweep(directory: str) -> None:
    now = time.time()
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if now - os.lstat(path).st_mtime > _STALE_S:
                os.unlink(path)


def verify_once_per_node(choose: Callable[[], Any], name: str = "load") -> Any:
    """plan_resume's ``once``: ``choose()``, the --load verification (which reads every byte),
    on one rank of this node, its result (None or [iteration, checksum, fall-back reason]) on
    all of them; a ConfigError it raises is raised on all of them. Runs ``choose()``
    directly where this process is alone on its node."""
    key = launch_id()
    if key is None:
        return choose()
    directory = _private_dir()
    base = os.path.join(directory, f"{name}-{key}")
    fd = os.open(f"{base}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if the holder dies
        try:
            with open(f"{base}.json", encoding="utf-8") as f:
                result = json.load(f)
        except FileNotFoundError:
            result = None
        if result is None:
            _sweep(directory)
            try:
                result = {"value": choose()}
            except ConfigError as e:
                result = {"error": str(e)}
            io.atomic_write(f"{base}.json", json.dumps(result))
    finally:
        os.close(fd)  # unlocks
    if "error" in result:
        raise ConfigError(result["error"])
    return None if result["value"] is None else tuple(result["value"])


def forget_node_results(name: str) -> None:
    """Remove this launch's result files (after the rendezvous, when every local rank has
    read them)."""
    key = launch_id()
    if key is None:
        return
    base = os.path.join(_results_dir(), f"{name}-{key}")
    for path in (f"{base}.json", f"{base}.lock"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _ranges(ranks: list[int]) -> str:
    """'0-3,6' for ascending ranks: a run of consecutive ones has one rank - index."""
    runs = [[r for _, r in run] for _, run in groupby(enumerate(ranks), lambda p: p[1] - p[0])]
    return ",".join(f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def describe_disagreement(views: list[tuple[str, Any]], what: str) -> str | None:
    """None when every rank's view (host, value) is the same, else one line grouping the
    ranks by what they saw."""
    groups: dict[str, list[int]] = {}
    hosts: dict[str, set[str]] = {}
    for rank, (host, value) in enumerate(views):
        groups.setdefault(str(value), []).append(rank)
        hosts.setdefault(str(value), set()).add(host)
    if len(groups) == 1:
        return None
    parts = [
        f"rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)} on {', '.join(sorted(hosts[v]))}: {v}"
        for v, ranks in groups.items()
    ]
    return f"the ranks disagree on {what}: {'; '.join(parts)}"


def agree_on_load(plan: Any) -> None:
    """Collective: every rank states the checkpoint it is about to load (its ResumePlan's
    iteration and metadata checksum, or a fresh start); any difference stops every rank with
    the same one line."""
    import torch.distributed as dist

    from megatron_taco.parallel import comm

    if plan.load_dir is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    views = comm.all_gather_object((socket.gethostname(), plan.agreement()))
    problem = describe_disagreement(views, f"the checkpoint to load from {plan.load_dir}")
    if problem is not None:
        raise ConfigError(
            f"--load: {problem}. Their nodes see different files there (a stale network file "
            "system view, or a transient read error on one node); retry, or pass --ckpt-step"
        )

"""Peer failures: a rank that died or hung, turned into one line on every other rank.

* A peer that dies makes a collective raise (gloo: "Connection closed by peer"; a hung peer:
  a timeout after ``--distributed-timeout-minutes``). ``describe_peer_failure`` turns that
  into one line naming the dead rank (found by PID on this node) and the collective.
  NCCL reports nothing by itself until its watchdog times out, and then tears the process
  down with a C++ trace: ``nccl_environment`` makes its watchdog abort the communicators
  and leave the process alone (the blocked collective then raises into Python), and a
  ``PeerWatch`` thread aborts them as soon as a rank on this node dies.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import traceback
from dataclasses import dataclass

from megatron_taco.errors import RunError
from megatron_taco.runtime.procfs import proc_stat

logger = logging.getLogger("megatron_taco.resilience")

_FAILURE_MARKERS = ("gloo", "Connection closed", "Connection reset", "Timed out", "NCCL", "nccl")
_C10D = os.path.join("torch", "distributed", "")
_WRAPPERS = (_C10D, os.path.join("deepspeed", "comm", ""))


class PeerFailure(RunError):
    """A rank died or hung; the message is the one line to print."""


@dataclass(frozen=True)
class Peer:
    host: str
    pid: int
    start_ticks: int

    def is_dead(self) -> bool:
        stat = proc_stat(self.pid)
        return stat is None or stat.start_ticks != self.start_ticks or stat.state in "ZXx"


def gather_peers() -> list[Peer]:
    """(host, PID) of every rank, gathered once after the rendezvous."""
    import torch.distributed as dist

    from megatron_taco.parallel import comm

    stat = proc_stat(os.getpid())
    me = Peer(socket.gethostname(), os.getpid(), stat.start_ticks if stat else -1)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [me]
    return comm.all_gather_object(me)


def is_peer_failure(error: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    in_c10d = any(_C10D in f.filename for f in frames)
    return (
        isinstance(error, RuntimeError)
        and in_c10d
        and any(m in str(error) for m in _FAILURE_MARKERS)
    )


def _where(error: BaseException) -> str:
    """'all_reduce (deepspeed/runtime/engine.py:2151)': the collective and its caller."""
    frames = traceback.extract_tb(error.__traceback__)
    inside = [i for i, f in enumerate(frames) if _C10D in f.filename]
    if not inside:
        return "a collective"
    name = frames[inside[-1]].name
    callers = [f for f in frames[: inside[0]] if not any(w in f.filename for w in _WRAPPERS)]
    if not callers:
        return name
    return f"{name} ({_short_path(callers[-1].filename)}:{callers[-1].lineno})"


def _short_path(path: str) -> str:
    package = os.sep + "megatron_taco" + os.sep
    if "site-packages" + os.sep in path:
        return path.rsplit("site-packages" + os.sep, 1)[1]
    if package in path:
        return "megatron_taco" + os.sep + path.rsplit(package, 1)[1]
    return path


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    # NCCL: "NCCL error in: /src/.../ProcessGroupNCCL.cpp:2027, remote process exited ..."
    text = re.sub(r"^NCCL error in: \S+:\d+, ", "NCCL: ", text)
    text = re.sub(r"^\[(PG [^\]]*)?\s*Rank \d+\]\s*", "", text)
    text = text.split(". This is typically")[0]
    return text if len(text) <= 240 else text[:237] + "..."


def describe_peer_failure(
    error: BaseException, rank: int, peers: list[Peer], timeout_minutes: float, wait: float = 2.0
) -> str:
    """One line for a collective that failed because another rank died or hung."""
    where = _where(error)
    me = peers[rank] if rank < len(peers) else None
    local = [r for r, p in enumerate(peers) if r != rank and me is not None and p.host == me.host]
    deadline = time.monotonic() + wait
    while True:  # a killed peer's socket closes a moment before its process is gone
        dead = [r for r in local if peers[r].is_dead()]
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if dead:
        who = ", ".join(f"rank {r} (pid {peers[r].pid})" for r in dead)
        verb = "has" if len(dead) == 1 else "have"
        return f"rank {rank}: {who} {verb} died; {where} failed; exiting"
    if "Timed out" in str(error) or "timeout" in str(error).lower():
        return (
            f"rank {rank}: {where} timed out after --distributed-timeout-minutes "
            f"{timeout_minutes:g}: a rank hung or its node is unreachable ({_short(error)}); "
            "exiting"
        )
    return (
        f"rank {rank}: a rank on another node failed or closed the connection during {where} "
        f"({_short(error)}); exiting"
    )


def nccl_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables to set before an NCCL process group exists, so that a dead or hung
    peer ends in a Python exception (and our one line) rather than a C++ abort; a value the
    user set wins. The timeout itself is init_process_group's (--distributed-timeout-minutes).

    * TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): on an error or timeout the watchdog
      aborts the communicators but does not tear the process down (the default, 3, kills it
      with a C++ trace); the blocked collective, or the next one, raises DistBackendError.
    * TORCH_NCCL_DUMP_ON_TIMEOUT=0: no flight-recorder dump files on a timeout.
    """
    env = os.environ if env is None else env
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    return {key: value for key, value in wanted.items() if key not in env}


class PeerWatch:
    """Watches the other ranks on this node (by PID, from gather_peers) and calls
    ``on_death(dead_ranks)`` once, as soon as one dies. Under NCCL ``on_death`` aborts the
    process groups: the collective this rank is blocked in then raises, and
    describe_peer_failure names the dead rank, within seconds instead of after the
    distributed timeout. (gloo needs none of this: the dead peer's sockets close.)"""

    def __init__(self, peers: list[Peer], rank: int, on_death, interval: float = 1.0) -> None:
        me = peers[rank]
        self.local = [r for r, p in enumerate(peers) if r != rank and p.host == me.host]
        self.peers, self.on_death, self.interval = peers, on_death, interval
        self.dead: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        if self.local:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            dead = [r for r in self.local if self.peers[r].is_dead()]
            if dead:
                self.dead = dead
                try:
                    self.on_death(dead)
                except Exception as e:  # the distributed timeout still applies
                    logger.warning(
                        "could not abort the process groups after rank %s died: %s", dead[0], e
                    )
                return


def abort_process_groups(_dead: list[int]) -> None:
    """PeerWatch's on_death under NCCL: abort every process group of this process."""
    import torch.distributed as dist

    dist.distributed_c10d._abort_process_group()

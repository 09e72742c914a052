"""taco-launch (tools/launch.py): run a launcher command and, when asked to stop, return
only once its ranks have saved their checkpoint and exited.

    taco-launch deepspeed --num_gpus 8 pretrain_taco.py ARGS
    taco-launch torchrun --nproc-per-node 8 pretrain_taco.py ARGS

Why: on SIGTERM the ``deepspeed`` runner exits at once (status 143) while its ranks are
still writing, and its per-node launcher gives the ranks 30 s before SIGKILL (torchrun's
agent does the same); a script, container or batch step that ends when the runner ends can
cut the save short, and so can the 30 s.

What it does: the command runs in a process group of its own (a terminal's Ctrl-C reaches
only this wrapper) with this process as its child subreaper (ranks whose launcher died are
re-parented here and reaped). SIGTERM, SIGINT, SIGUSR1 and SIGHUP are passed to the ranks
only: the processes below that carry a rank variable (RANK, LOCAL_RANK, PMI_RANK,
OMPI_COMM_WORLD_RANK), not the runner or the launcher, whose own timers would then start.
The ranks agree on the request in their next all-reduce (ranks on other nodes too), save
and exit 0, and the launchers then exit 0 by themselves. The wrapper returns when every
process below it has exited (a DataLoader worker left without its rank is killed), with the
command's exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

from megatron_taco.arguments import program_name
from megatron_taco.cli import tool_parser

PROG = "launch.py"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
RANK_ENV = (b"RANK=", b"LOCAL_RANK=", b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=")
_PR_SET_CHILD_SUBREAPER = 36
DATA_WORKER = b"pt_data_worker"


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                text = f.read()
        except OSError:
            continue
        ppid = int(text[text.rindex(b")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append(int(name))
    return tree


def descendants(pid: int) -> dict[int, int]:
    """{descendant: its parent} of every process below ``pid``."""
    tree, out, todo = _children(), {}, [pid]
    while todo:
        parent = todo.pop()
        for child in tree.get(parent, []):
            out[child] = parent
            todo.append(child)
    return out


def is_rank(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return False
    return any(entry.startswith(RANK_ENV) for entry in env)


def is_data_worker(pid: int) -> bool:
    """A torch DataLoader worker (torch names its process so)."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().strip() == DATA_WORKER
    except OSError:
        return False


def ranks_below(pid: int) -> list[int]:
    """The ranks: processes with a rank variable whose parent has none (a rank's DataLoader
    workers inherit its variables, and ignore exit signals anyway; one whose rank died is
    re-parented here and is no rank)."""
    below = descendants(pid)
    with_rank = {p for p in below if is_rank(p)}
    return sorted(p for p in with_rank if below[p] not in with_rank and not is_data_worker(p))


def _end_orphaned_workers(reported: set[int]) -> None:
    """SIGKILL the DataLoader workers re-parented here, once the command has ended: their
    rank is gone, they ignore exit signals, and one that missed its rank's death (forked
    just before it) would otherwise hold this wrapper, and the job, forever."""
    for pid in _children().get(os.getpid(), []):
        if pid not in reported and is_data_worker(pid):
            reported.add(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            print(f"{program_name(PROG)}: a DataLoader worker (pid {pid}) outlived its rank; "
                  "killed it", file=sys.stderr, flush=True)  # fmt: skip


def _forward(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    ranks = ranks_below(os.getpid())
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    print(
        f"{program_name(PROG)}: {name} passed to {len(ranks)} rank(s) on this node; waiting for them "
        "to save and exit",
        file=sys.stderr,
        flush=True,
    )


def launch(command: list[str]) -> int:
    """Start ``command``, then reap every process below (the command and anything
    re-parented here); the command's status."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for signum in FORWARDED:
        signal.signal(signum, _forward)
    try:
        child = subprocess.Popen(command, preexec_fn=os.setpgrp)
    except OSError as e:
        raise SystemExit(
            f"{program_name(PROG)}: error: cannot start {command[0]}: {e.strerror}"
        ) from None
    status, reported = None, set()
    while True:
        try:
            # Once the command ended, what is left (ranks still saving, workers) was
            # re-parented here: poll, to end the workers that have no rank.
            pid, raw = os.waitpid(-1, 0 if status is None else os.WNOHANG)
        except ChildProcessError:
            break
        if pid == child.pid:
            status = os.waitstatus_to_exitcode(raw)
            child.returncode = status
        elif pid > 0:
            reported.discard(pid)  # reaped: its pid may come back as another process
        elif pid == 0:
            _end_orphaned_workers(reported)
            time.sleep(0.2)
    assert status is not None
    return status if status >= 0 else 128 - status


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(
        PROG,
        __doc__,
        usage=f"{program_name(PROG)} COMMAND [ARGS...]   (e.g. {program_name(PROG)} deepspeed --num_gpus 8 pretrain_taco.py ...)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="The launcher command line.")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run, e.g. deepspeed --num_gpus 2 pretrain_taco.py ...")
    return launch(command)


if __name__ == "__main__":
    sys.exit(main())

"""What /proc and the C library say about processes (Linux; elsewhere the answers are
"unknown"): a process's state, parent and start, its program's name, and the parent-death
signal. Imports nothing of ours."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from dataclasses import dataclass

_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2
_IMPORT_TIME = time.time()  # the fallback for the process's start


@dataclass(frozen=True)
class ProcStat:
    state: str
    ppid: int
    start_ticks: int  # since boot: with the PID, identifies a process across PID reuse


def _read(path: str) -> str | None:
    """A /proc file's text (NULs kept), None when it cannot be read (or not on Linux)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def proc_stat(pid: int) -> ProcStat | None:
    """The process's /proc/PID/stat, None when it does not exist (or not on Linux)."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ")".
    fields = text[text.rindex(")") + 2 :].split()
    return ProcStat(state=fields[0], ppid=int(fields[1]), start_ticks=int(fields[19]))


def cmdline(pid: int) -> str:
    return (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ")


def process_start_time() -> float:
    """This process's start as a Unix time (the interpreter's start, before imports)."""
    stat = proc_stat(os.getpid())
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + stat.start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, AttributeError, ValueError):
        return _IMPORT_TIME


def _libc():
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def get_pdeathsig() -> int:
    libc, value = _libc(), ctypes.c_int(0)
    if libc is not None:
        libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


def set_pdeathsig(signum: int) -> bool:
    """Ask the kernel to send ``signum`` when the parent (the thread that started us) dies."""
    libc = _libc()
    return libc is not None and libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0


def process_name(pid: int) -> str:
    """'torchrun', 'deepspeed', 'python': the program a process runs (its script's name when
    an interpreter runs one), for messages."""
    text = _read(f"/proc/{pid}/cmdline")
    if text is None:
        return "?"
    words = [w for w in text.split("\0") if w]
    if not words or not os.path.basename(words[0]).startswith("python"):
        return os.path.basename(words[0]) if words else "?"
    for i, word in enumerate(words[1:], 1):
        if word == "-m" and i + 1 < len(words):
            return words[i + 1]
        if word == "-c":
            break
        if not word.startswith("-"):
            return os.path.basename(word)
    return os.path.basename(words[0])


def init_name() -> str:
    text = _read("/proc/1/comm")
    return "?" if text is None else text.strip()

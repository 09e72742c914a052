"""Putting a planned fault into a running job: signals at a time (a harness thread), the shim's
spec for faults at a code point or a byte (benchmarks/faults/shim/sitecustomize.py), and the
damage done to the files once a job has stopped (a changed byte, a stale lock)."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

from benchmarks.faults.compare import read_tracker
from benchmarks.faults.jobs import Job, MetricsWatch, cmdline
from benchmarks.faults.plan import Fault

DELAY_SCALE_S = 0.5  # a timed fault lands this fraction of it after its iteration is logged
STORE_RE = r"/replacement_store/gen_\d{5}/"
TRACKER_RE = r"latest_checkpointed_iteration\.txt\.tmp\."
# fsyncs a rank makes, where a reference predates counting them (its census has them now)
FSYNCS_PER_SAVE = 3
STORE_FSYNCS = 4


def save_re(iteration: int | None) -> str:
    """The files of the save of ``iteration`` (None: of any save)."""
    it = r"\d{7}" if iteration is None else f"{iteration:07d}"
    return rf"/iter_{it}\.tmp-[0-9a-f]+/"


def _census(ref: dict, rank: int, key: str) -> int:
    return int(ref["census"].get(str(rank), {}).get(key, 0))


def _writer(ref: dict, key: str, rank: int) -> int:
    """``rank``, or the other one if ``rank`` writes nothing of ``key`` (at tp 2 only one
    rank owns the store's shards)."""
    return rank if _census(ref, rank, key) else 1 - rank


def _save_key(ref: dict, iteration: int | None) -> str:
    """The census key of a save (None: the first one, what a restart's first save writes)."""
    if iteration is not None:
        return f"ckpt:iter_{iteration:07d}"
    return min(k for counts in ref["census"].values() for k in counts if k.startswith("ckpt:"))


def _save_rank(ref: dict, iteration: int | None, rank: int) -> int:
    return _writer(ref, _save_key(ref, iteration), rank)


def shim_spec(fault: Fault | None, ref: dict, run_dir: Path, marker: Path,
              bug: str | None) -> dict[str, Any] | None:  # fmt: skip
    """The shim's spec for an attempt: None when the attempt has nothing to inject."""
    spec: dict[str, Any] = {"marker": str(marker)}
    if bug:
        spec["bug"] = bug
    if fault is None or fault.timed:
        return spec if bug else None
    p = fault.params
    if fault.kind == "kill_point":
        spec.update(rank=p["rank"], point={"name": p["point"], "action": p["action"]})
    elif fault.kind == "kill_save":
        rank = _save_rank(ref, p["iteration"], p["rank"])
        total = _census(ref, rank, _save_key(ref, p["iteration"]))
        spec.update(rank=rank, io={"path_re": save_re(p["iteration"]), "action": "kill_job",
                                   "after_bytes": int(p["byte_frac"] * total)})  # fmt: skip
    elif fault.kind == "write_error":
        spec.update(_write_error(fault, ref, run_dir))
    else:
        raise ValueError(f"{fault.kind} is not injected by the shim")
    return spec


def _write_error(fault: Fault, ref: dict, run_dir: Path) -> dict[str, Any]:
    p, target = fault.params, fault.place
    code = getattr(errno, p["errno"])
    io: dict[str, Any] = {"action": "errno", "errno": code, "op": "write"}
    rank = p["rank"]
    if target == "tracker":  # rank 0, at the first byte of this save's tracker
        io.update(path_re=TRACKER_RE, after_bytes=p["tracker_bytes_before"])
    else:
        if target.startswith("ckpt"):
            rank = _save_rank(ref, p["iteration"], rank)
            io["path_re"], key = save_re(p["iteration"]), _save_key(ref, p["iteration"])
        else:
            rank = _writer(ref, "store", rank)
            io["path_re"], key = STORE_RE, "store"
        if target.endswith("_fsync"):  # after_bytes counts fsyncs there
            default = FSYNCS_PER_SAVE if target == "ckpt_fsync" else STORE_FSYNCS
            count = _census(ref, rank, f"fsync:{key}") or default  # (older references)
            io.update(op="fsync", after_bytes=int(p["byte_frac"] * count))
        else:
            io["after_bytes"] = int(p["byte_frac"] * _census(ref, rank, key))
    if code == errno.ENOSPC:  # the disk stays full for this rank: every later write fails
        io["sticky_re"] = re.escape(str(run_dir.resolve()))
    return {"rank": rank, "io": io}


# -- timed faults -------------------------------------------------------------------------


def _wait_for(job: Job, watch: MetricsWatch, after_new: int) -> bool:
    while job.proc.poll() is None:
        if after_new == 0 or len(watch.poll()) >= after_new:
            return True
        time.sleep(0.02)
    return False


def _sleep(job: Job, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if job.proc.poll() is not None:
            return False
        time.sleep(min(0.01, max(deadline - time.monotonic(), 0)))
    return job.proc.poll() is None


def _name(pid: int) -> str:
    words = cmdline(pid)
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words):
            return words[i + 1]
    tail = [w for w in words if not w.startswith("-")]
    return os.path.basename(tail[1] if len(tail) > 1 and "python" in tail[0] else tail[0]) \
        if tail else str(pid)  # fmt: skip


def timed_action(job: Job, watch: MetricsWatch, fault: Fault, ref: dict, attempt) -> None:
    """Runs in a thread beside the job: waits for the fault's time, then acts. Records on
    ``attempt`` whether, when and where it landed."""
    p = fault.params
    if not _wait_for(job, watch, p["after_new"]):
        return
    scale = max(ref["startup_s"], 1.0) if p["after_new"] == 0 else DELAY_SCALE_S
    if not _sleep(job, p["delay"] * scale):
        return
    where = _act(job, fault)
    if where:
        attempt.landed, attempt.fault_time, attempt.fault_where = True, time.time(), where


def _act(job: Job, fault: Fault) -> str | None:
    kind, p = fault.kind, fault.params
    if kind == "kill_rank":
        pid = job.ranks().get(p["rank"])
        if pid is None or not job.signal(pid, signal.SIGKILL):
            return None
        return f"SIGKILL rank {p['rank']} (pid {pid})"
    if kind in ("kill_launcher", "term_launcher"):
        chain = job.launchers()
        pid = chain[-1] if fault.place == "inner" else chain[0]
        sig = signal.SIGKILL if kind == "kill_launcher" else signal.SIGTERM
        name = _name(pid)
        return f"{sig.name} {name} (pid {pid})" if job.signal(pid, sig) else None
    if kind == "term_twice":
        return _term_twice(job, fault)
    if kind in ("stale_lock", "corrupt_ckpt", "corrupt_store"):
        if p.get("stop", "kill_job") == "term_job":
            job.signal_all(signal.SIGTERM)
            return "SIGTERM every process of the job"
        job.kill_all()
        return "SIGKILL every process of the job"
    raise ValueError(kind)


def _term_twice(job: Job, fault: Fault) -> str | None:
    top = job.proc.pid

    def send() -> None:
        if fault.place == "job":
            job.signal_all(signal.SIGTERM)
        else:
            job.signal(top, signal.SIGTERM)

    send()
    landed = time.time()
    if _sleep(job, fault.params["gap"]):
        send()
        return f"SIGTERM to the {fault.place} twice, {time.time() - landed:.2f} s apart"
    return f"SIGTERM to the {fault.place} (it ended before the second)"


# -- damage once the job stopped ----------------------------------------------------------


def apply_after_stop(fault: Fault, run_dir: Path, trial_dir: Path) -> dict[str, Any] | None:
    save = run_dir / "ckpt"
    if fault.kind == "corrupt_ckpt":
        return _corrupt_checkpoint(fault, save)
    if fault.kind == "corrupt_store":
        return _corrupt_store(fault, save / "replacement_store")
    if fault.kind == "stale_lock":
        return _stale_lock(fault, save / "run.lock")
    return None


def flip_byte(path: Path, frac: float, xor: int) -> dict[str, Any]:
    data = bytearray(path.read_bytes())
    offset = min(int(frac * len(data)), len(data) - 1)
    old = data[offset]
    data[offset] ^= xor
    path.write_bytes(bytes(data))
    return {"file": str(path), "offset": offset, "old": old, "new": data[offset]}


def _corrupt_checkpoint(fault: Fault, save: Path) -> dict[str, Any] | None:
    p = fault.params
    tracked = read_tracker(save)
    if tracked is None:
        return {"skipped": "no checkpoint yet"}
    if fault.place == "tracker":
        return {**flip_byte(save / "latest_checkpointed_iteration.txt", p["byte_frac"], p["xor"]),
                "iteration": tracked}  # fmt: skip
    iter_dir = save / f"iter_{tracked:07d}"
    pattern = {"model": "*model_states.pt", "optim": "*optim_states.pt", "rng": "rng_state_*",
               "metadata": "metadata.json"}[fault.place]  # fmt: skip
    files = sorted(iter_dir.glob(pattern))
    if not files:
        return {"skipped": f"no {pattern} in {iter_dir}"}
    target = files[min(int(p["pick"] * len(files)), len(files) - 1)]
    return {**flip_byte(target, p["byte_frac"], p["xor"]), "iteration": tracked}


def _corrupt_store(fault: Fault, store: Path) -> dict[str, Any] | None:
    p = fault.params
    committed = sorted(d for d in store.glob("gen_*") if (d / "manifest.json").is_file())
    if not committed:
        return {"skipped": "no committed generation yet"}
    gen = committed[min(int(p["pick"] * len(committed)), len(committed) - 1)]
    if fault.place == "manifest":
        target = gen / "manifest.json"
    else:
        shards = [s for s in sorted(gen.glob("shard_*.bin")) if s.stat().st_size]
        target = shards[min(int(p["pick"] * len(shards)), len(shards) - 1)]
    return flip_byte(target, p["byte_frac"], p["xor"])


def _stale_lock(fault: Fault, lock: Path) -> dict[str, Any] | None:
    if not lock.is_file():
        return {"skipped": "no run.lock left (killed before rank 0 took it, or after it let go)"}
    if fault.place == "as_left":
        return {"lock": lock.read_text()[:300]}
    if fault.place == "empty":
        lock.write_text("")
        return {"lock": ""}
    try:
        record = json.loads(lock.read_text())
    except ValueError:
        return {"skipped": "run.lock holds no record"}
    if fault.place == "pid_reused":  # a live process of this host holds the PID now
        record["pid"] = os.getpid()
    else:
        record["host"] = f"gone-{socket.gethostname()}"
    lock.write_text(json.dumps(record))
    return {"lock": json.dumps(record)[:300]}

"""Fresh processes for the tests, started warm.

Every rank and helper process the tests start (run_distributed, run_in_process, launch) is
forked from one server process per test session that has imported torch, DeepSpeed and our
models once (multiprocessing's forkserver with a preload). A process so started is still a
new process (its own process group, RNG, globals, signals and exit), but begins in a
fraction of a second instead of paying ~2 CPU seconds of imports per rank. What the
parent's environment and working directory are at the call travels with the job (the
server's are those of its start), and what a rank writes to its stdout and stderr is written
to the test's own (file descriptors 1 and 2, so capfd sees it) when the ranks are done.

The real launchers (deepspeed, torchrun, mpirun, SLURM, plain python) are tested by the
tests of tests/e2e whose subject they are; the others use ``launch``, which runs a script
in forked ranks with the variables torchrun gives its ranks."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "TORCH_EXTENSIONS_DIR": os.environ.get(
        "TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions")
    ),
    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
}
for _var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_var, None)

# Imported once, in the fork server. It holds one thread after them (torch starts its
# thread pools lazily), so forking it is safe.
FORK_PRELOAD = [
    "torch",
    "torch.distributed",
    "deepspeed",
    "megatron_taco.training.driver",
    "megatron_taco.recipes.taco",
    "megatron_taco.recipes.sas",
    "tests.helpers",
]


def process_context():
    """The multiprocessing context of every process the tests start from Python."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_PRELOAD)
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Logs:
    """Per-process stdout/stderr files, replayed to the test's own descriptors."""

    def __init__(self, n: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="ranks-")
        self.paths = [
            (os.path.join(self.dir, f"{r}.out"), os.path.join(self.dir, f"{r}.err"))
            for r in range(n)
        ]

    def read(self, r: int) -> tuple[str, str]:
        out, err = (Path(p).read_bytes() if os.path.exists(p) else b"" for p in self.paths[r])
        return out.decode(errors="replace"), err.decode(errors="replace")

    def replay(self) -> None:
        for r in range(len(self.paths)):
            for fd, text in zip((1, 2), self.read(r)):
                if text:
                    os.write(fd, text.encode())

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _enter(environ: dict, cwd: str, out: str, err: str) -> None:
    """In the forked process: the parent's environment and directory, output to files."""
    os.environ.clear()
    os.environ.update(environ)
    # torch took its thread count from the server's OMP_NUM_THREADS; a fresh process takes
    # the job's. Sums differ in the last bits between thread counts, so a forked run must
    # use the job's to compute as a launched one does (test_sigkill_mid_epoch compares them).
    if environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # A fresh stream on each descriptor: what the server buffered is not written again.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _join(procs: list, grace: float, kill: bool = True) -> None:
    """Waits up to ``grace`` seconds for all of ``procs``, then SIGKILLs what is left."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0.1))
    for p in procs:
        if kill and p.is_alive():
            p.kill()
            p.join()


# ---------------------------------------------------------------------------------------
# run_distributed(fn, world_size): ``fn(rank, world_size, *args)`` in real gloo processes,
# each with a real torch.distributed process group (gloo on 127.0.0.1, a free port per
# call). A failure or exception on any rank fails the call with that rank's traceback;
# return values are collected per rank and returned as a list.


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    queue,
    timeout: float,
    backend: str,
    parent: tuple,
) -> None:
    _enter(*parent)
    # A rank still running shortly before the parent gives up prints where it is stuck.
    faulthandler.dump_traceback_later(max(timeout - 15, 1), exit=False)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank, chosen before the process group
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Pickled here: torch's queue would pass tensors as file descriptors that the parent
        # fetches from this process, which may have exited by then (FileNotFoundError).
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # every failure, even SystemExit, must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            # Tear the group down explicitly: letting gloo's threads die in interpreter
            # shutdown is what aborts with "terminate called without an active exception".
            dist.destroy_process_group()


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 300,
    backend: str = "gloo",
    exit_timeout: float = 30,
) -> list[Any]:
    """``fn`` must be importable (module level) so the ranks can unpickle it.
    ``backend="nccl"``: rank r on GPU r (tests/gpu). ``exit_timeout``: seconds each rank
    has to exit after reporting (more ranks than cores tear down slowly)."""
    ctx = process_context()
    queue = ctx.Queue()
    port = free_port()
    logs = _Logs(world_size)
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                r,
                world_size,
                port,
                fn,
                args,
                queue,
                timeout,
                backend,
                (dict(os.environ), os.getcwd(), *logs.paths[r]),
            ),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        _join(procs, exit_timeout if not errors else 5)
        logs.replay()
        logs.remove()
    if errors:
        raise AssertionError("\n".join(errors))
    bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad}")
    return [results[r] for r in range(world_size)]


def _solo(fn: Callable, args: tuple, queue, parent: tuple) -> None:
    _enter(*parent)
    try:
        queue.put(("ok", fn(*args)))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def run_in_process(fn: Callable, *args: Any, timeout: float = 600) -> Any:
    """``fn(*args)`` in a fresh process without any process group (the driver then sets up
    its own one-rank world, NCCL on a GPU); its return value, or its traceback as the
    failure. ``fn`` must be importable."""
    ctx = process_context()
    queue = ctx.Queue()
    logs = _Logs(1)
    parent = (dict(os.environ), os.getcwd(), *logs.paths[0])
    proc = ctx.Process(target=_solo, args=(fn, args, queue, parent))
    proc.start()
    try:
        status, payload = queue.get(timeout=timeout)
    finally:
        _join([proc], 30)
        logs.replay()
        logs.remove()
    assert status == "ok", payload
    return payload


# ---------------------------------------------------------------------------------------
# launch(script, argv, world): a script run as `torchrun --nproc-per-node world` would run
# it, in forked ranks; for the tests whose subject is not the launcher.


def _script_rank(script: str, argv: list[str], parent: tuple) -> None:
    import atexit
    import runpy

    _enter(*parent)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        # What the interpreter's exit would run (a forked process leaves by os._exit).
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def launch(
    script: str,
    *argv: str,
    world: int = 1,
    env: dict | None = None,
    timeout: float = 240,
    grace: float = 30,
    settle: float = 5,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``script`` (relative to the repository) with ``argv`` in ``world`` forked ranks
    (world 1: as plain ``python script``, no launcher variables; more: RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT as torchrun sets them), ``env`` over
    the test's environment. As a launcher does, the first rank to fail ends the others
    (SIGTERM ``settle`` seconds later, SIGKILL ``grace`` seconds after that) and gives the
    return code. stdout/stderr: every rank's,
    rank 0 first."""
    environ = {**ENV, **(env or {})}
    port = free_port()
    ctx = process_context()
    logs = _Logs(world)
    procs = []
    for r in range(world):
        ranked = dict(environ)
        if world > 1:
            ranked.update(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        parent = (ranked, str(REPO), *logs.paths[r])
        procs.append(ctx.Process(target=_script_rank, args=(script, list(argv), parent)))
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    code = 0
    try:
        while any(p.is_alive() for p in procs):
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                code = failed[0]
                break
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([script, *argv], timeout)
            time.sleep(0.05)
    finally:
        if code:
            # As deepspeed's and torchrun's agents do: SIGTERM, then SIGKILL. After a moment
            # for the others to end on their own: a rank refusing bad input exits a little
            # after the first one, with its own line (the agents poll about once a second).
            _join(procs, settle, kill=False)
            for p in procs:
                if p.is_alive():
                    p.terminate()
        _join(procs, grace if code else 0)
        outputs = [logs.read(r) for r in range(world)]
        logs.remove()
    code = code or next((p.exitcode for p in procs if p.exitcode != 0), 0)
    res = subprocess.CompletedProcess(
        [script, *argv], code, "".join(o for o, _ in outputs), "".join(e for _, e in outputs)
    )
    if check:
        assert code == 0, (
            f"{script} {' '.join(argv)}\n--- stdout\n{res.stdout[-6000:]}\n"
            f"--- stderr\n{res.stderr[-6000:]}"
        )
    return res


def run(cmd: list[str], timeout: int = 240, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    if check:
        assert res.returncode == 0, (
            f"{' '.join(cmd)}\n--- stdout\n{res.stdout[-6000:]}\n--- stderr\n{res.stderr[-6000:]}"
        )
    return res


def deepspeed_command(script: str, *args: str, num_gpus: int = 2) -> list[str]:
    # The launcher script beside the interpreter (a venv), else its module: `make gpu-test`
    # puts DeepSpeed in a private folder on PYTHONPATH, where no script is on PATH.
    script_launcher = BIN / "deepspeed"
    launcher = (
        [str(script_launcher)]
        if script_launcher.is_file()
        else [sys.executable, "-m", "deepspeed.launcher.runner"]
    )
    # A free port: other test runs on this machine may hold DeepSpeed's default 29500.
    return [
        *launcher,
        "--num_gpus",
        str(num_gpus),
        "--master_port",
        str(free_port()),
        script,
        *args,
    ]


def deepspeed(script: str, *args: str, num_gpus: int = 2, timeout: int = 240):
    return run(deepspeed_command(script, *args, num_gpus=num_gpus), timeout=timeout)


def session_members(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue  # exited while we looked
        # Fields after the command name: state, ppid, pgrp, session, ...
        state, _ppid, _pgrp, session = text[text.rindex(")") + 2 :].split()[:4]
        if int(session) == sid and state not in "ZXx":
            members.append(int(entry))
    return members


def reap(proc: subprocess.Popen, *others: int | None) -> None:
    """A test's cleanup: kill and wait for ``proc``, and SIGKILL the other pids (processes it
    left in other sessions or parents: a re-parented worker, a launcher)."""
    proc.kill()
    proc.wait()
    for pid in others:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def kill_session(proc: subprocess.Popen, sig: int = signal.SIGKILL, timeout: float = 60) -> None:
    """Signal every process of ``proc``'s session (it was started with start_new_session:
    launcher, ranks, DataLoader workers) and return once none is left. Waiting for the
    launcher alone is not enough: under load a SIGKILLed rank takes seconds to exit and
    until then holds its --save lock, so a requeue started at once is rightly refused."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    proc.wait()
    deadline = time.monotonic() + timeout
    while (left := session_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes {left} of the killed session outlived it by {timeout} s"


def kill_when(cmd: list[str], ready: Callable[[], bool], timeout: float = 240) -> None:
    """Run ``cmd`` in a session of its own and SIGKILL all of it (a node lost) once
    ``ready()`` holds; returns when every process of it has exited."""
    out = subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None and not ready():
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        kill_session(proc)

"""run_distributed(fn, world_size): run ``fn(rank, world_size, *args)`` in real gloo processes.

Each rank is a spawned process with a real torch.distributed process group (gloo on
127.0.0.1, a free port per call). A failure or exception on any rank fails the call with
that rank's traceback; return values are collected per rank and returned as a list.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
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
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # every failure, even SystemExit, must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            # Tear the group down explicitly: letting gloo's threads die in interpreter
            # shutdown is what aborts with "terminate called without an active exception".
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """``fn`` must be importable (module level) so spawned processes can unpickle it."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=False)
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
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad}")
    return [results[r] for r in range(world_size)]

"""What several test files share: real gloo process groups (run_distributed), free ports,
tiny model configs and batches, and the metric keys each model logs. Test files import
from here, never from each other."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_taco.models.taco.config import TacoConfig
from megatron_taco.models.taco.model import TacoForPretraining
from megatron_taco.parallel.state import single_process_state

TACO_METRIC_KEYS = (
    "loss",
    "mlm_loss",
    "mpm_loss",
    "mlm_acc",
    "mpm_acc",
    "mlm_tokens",
    "mpm_tokens",
)
VOCAB = 97
SEQ = 32

# ---------------------------------------------------------------------------------------
# run_distributed(fn, world_size): run ``fn(rank, world_size, *args)`` in real gloo processes.
# Each rank is a spawned process with a real torch.distributed process group (gloo on
# 127.0.0.1, a free port per call). A failure or exception on any rank fails the call with
# that rank's traceback; return values are collected per rank and returned as a list.


def free_port() -> int:
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
    port = free_port()
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


# ---------------------------------------------------------------------------------------
# TACO


def tiny_config(**overrides) -> TacoConfig:
    return TacoConfig.preset("tiny", vocab_size=VOCAB, **overrides)


def make_batch(
    b: int = 2, s: int = SEQ, seed: int = 0, vocab: int = VOCAB
) -> dict[str, torch.Tensor]:
    """A TACO batch as the collator builds it: rows [0, b) masked tokens + true positions,
    rows [b, 2b) true tokens + masked positions (-1, a shuffled span), some padding."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, vocab, (b, s), generator=g)
    lengths = [s - 3 * i for i in range(b)]
    ids = torch.cat([tokens, tokens]).clone()
    pos = torch.arange(s).repeat(2 * b, 1)
    mask = torch.zeros(2 * b, s, dtype=torch.bool)
    mlm = torch.full((2 * b, s), -100)
    mpm = torch.full((2 * b, s), -100)
    for r in range(b):
        n = lengths[r]
        mask[r, :n] = mask[b + r, :n] = True
        ids[r, n:] = ids[b + r, n:] = 0
        pos[r, n:] = pos[b + r, n:] = 0
        sel = torch.randperm(n - 2, generator=g)[:5] + 1
        mlm[r, sel] = tokens[r, sel]
        ids[r, sel] = 4  # [MASK]
        sel = torch.randperm(n - 2, generator=g)[:6] + 1
        mpm[b + r, sel] = pos[b + r, sel]
        pos[b + r, sel[:4]] = -1  # masked positions
        pos[b + r, sel[4:]] = pos[b + r, sel[4:]].flip(0)  # a shuffled pair
    return dict(
        input_ids=ids, position_ids=pos, attention_mask=mask, mlm_labels=mlm, mpm_labels=mpm
    )


def build(config: TacoConfig, seed: int = 0) -> TacoForPretraining:
    torch.manual_seed(seed)
    return TacoForPretraining(config, single_process_state())

"""Timing, memory and result helpers shared by the step benchmarks (run as scripts:
benchmarks/ is on sys.path)."""

from __future__ import annotations

import json
import statistics
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def gemm_peak(device, dtype=torch.float32, n: int = 2048, iters: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t = time.perf_counter()
        for _ in range(iters):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - t) / iters)
    return 2 * n**3 / best


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, steps: int, device) -> float:
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t) / steps


def interleaved_times(steps: dict, repeats: int, steps_per_repeat: int, device) -> dict:
    """{name: [seconds per step, one per repeat]}, the models timed A B C A B C ... so that
    the load of a shared machine drifts over all of them alike."""
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(time_steps(step, steps_per_repeat, device))
    return times


def spread(ratios: list[float]) -> str:
    """'median [min, max]' of per-repeat ratios."""
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the tensors created inside the block, with or without some of them.

    CPU has no allocator statistics, so every storage an op creates is counted from its
    creation until it is freed (views and in-place results share a storage and count
    once). ``peak(exclude)`` replays that timeline without the storages in ``exclude``
    (e.g. the weight gradients, to get the activations' and temporaries' peak)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (storage key, +bytes | -bytes)
        self.keys: dict[int, int] = {}  # id(storage) -> key while it lives
        self._next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Views and in-place results share an input's storage: not a new allocation.
        inputs = {
            id(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        if id(storage) in self.keys or storage.nbytes() == 0:
            return
        key, self._next = self._next, self._next + 1
        self.keys[id(storage)] = key
        nbytes = storage.nbytes()
        self.events.append((key, nbytes))
        weakref.finalize(storage, self._free, id(storage), key, nbytes)

    def _free(self, storage_id: int, key: int, nbytes: int) -> None:
        self.keys.pop(storage_id, None)
        self.events.append((key, -nbytes))

    def key_of(self, tensor: torch.Tensor) -> int | None:
        return self.keys.get(id(tensor.untyped_storage()))

    def peak(self, exclude: set[int] = frozenset()) -> int:
        live = best = 0
        for key, delta in self.events:
            if key not in exclude:
                live += delta
                best = max(best, live)
        return best


def peak_activation_bytes(forward_backward, params) -> int:
    """Peak bytes allocated while ``forward_backward()`` runs, weight gradients excluded:
    the activations kept for backward plus the temporaries alive beside them."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        p.grad = None
    with PeakMemory() as mem:
        forward_backward()
    grads = {mem.key_of(p.grad) for p in params if p.grad is not None}
    for p in params:
        p.grad = None
    return mem.peak(grads - {None})


def write_results(path: str | None, benchmark: str, rows: list[dict]) -> None:
    """COMMON.md's --results-json: a JSON list of {benchmark, metric, value, goal, op, unit,
    note}; ``op`` says how value compares with goal when the goal is met."""
    if not path:
        return
    out = [
        {
            "benchmark": benchmark,
            "metric": r["metric"],
            "value": float(r["value"]),
            "goal": None if r.get("goal") is None else float(r["goal"]),
            "op": r.get("op", ">="),
            "unit": r.get("unit", "x"),
            "note": r.get("note", ""),
        }
        for r in rows
    ]
    Path(path).write_text(json.dumps(out, indent=1) + "\n")

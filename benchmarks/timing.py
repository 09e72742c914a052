"""Timing helpers shared by the step benchmarks (run as scripts: benchmarks/ is on sys.path)."""

from __future__ import annotations

import time

import torch


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

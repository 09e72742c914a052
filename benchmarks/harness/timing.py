"""Timing, MFU peak and peak memory of the step benchmarks, and their report: every ratio
with its goal, written as results (harness/results.py)."""

from __future__ import annotations

import argparse
import statistics
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.harness.results import Result, write_results
from megatron_taco.training.observability.peaks import gpu_bf16_peak


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


def compute_peak(device, dtype) -> tuple[float, str]:
    """(FLOP/s, where it comes from) that MFU divides by: on a GPU in bf16 the data sheet's
    dense bf16 peak of the detected GPU; else a GEMM measured here."""
    device = torch.device(device)
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        peak = gpu_bf16_peak(name)
        if peak is not None:
            return peak, f"{name}: dense bf16 peak {peak / 1e12:.0f} TFLOP/s (data sheet)"
        peak = gemm_peak(device, torch.bfloat16, n=8192)
        return peak, f"{name}: not in the table, measured bf16 GEMM {peak / 1e12:.0f} TFLOP/s"
    peak = gemm_peak(device, dtype)
    return peak, f"{device.type}: measured {dtype} GEMM {peak / 1e9:.1f} GFLOP/s"


def model_dtype(args, device) -> torch.dtype:
    """--dtype: auto is bf16 on a GPU (what the bf16 configs train in), float32 on CPU."""
    if args.dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def add_common_args(parser, repeats: int, steps: int, warmup: int) -> None:
    """Flags every step benchmark has (timing, threads, memory, profile, results)."""
    parser.add_argument(
        "--repeats", type=int, default=repeats, help="Alternating timing rounds per model."
    )
    parser.add_argument("--steps", type=int, default=steps, help="Training steps per round.")
    parser.add_argument("--warmup", type=int, default=warmup, help="Untimed steps per model.")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU).")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="Weights and activations of every model (auto: bf16 on a GPU, fp32 on CPU); MFU "
        "is against the GPU's dense bf16 peak in bf16.",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time (tokens/s as users see it); cpu: this process's CPU time, "
        "which on a machine shared with other jobs varies far less (use with --threads 1).",
    )
    parser.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Also measure the peak activation memory of one forward + backward per model.",
    )
    parser.add_argument(
        "--profile", metavar="PATH", help="Write torch.profiler tables of one step per model."
    )
    parser.add_argument(
        "--results-json", metavar="PATH", help="Also write the ratios there (harness/results.py)."
    )


def setup(args) -> torch.device:
    if args.threads:
        torch.set_num_threads(args.threads)
    return torch.device(args.device)


def time_steps(step, steps: int, device, clock: str = "wall") -> float:
    now = time.process_time if clock == "cpu" else time.perf_counter
    sync(device)
    t = now()
    for _ in range(steps):
        step()
    sync(device)
    return (now() - t) / steps


def interleaved_times(
    steps: dict, repeats: int, steps_per_repeat: int, device, clock: str = "wall"
) -> dict:
    """{name: [seconds per step, one per repeat]}, the models timed A B C A B C ... so that
    the load of a shared machine drifts over all of them alike."""
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(time_steps(step, steps_per_repeat, device, clock))
    return times


def ratio_row(metric: str, num: list, den: list, goal, op: str, what: str) -> dict:
    """A results row whose value is the median over repeats of num[i] / den[i] (times of
    one interleaved round), with the range of those ratios in the note."""
    ratios = [a / b for a, b in zip(num, den)]
    value = statistics.median(ratios)
    note = f"{what}: median of {len(ratios)} interleaved repeats, range [{min(ratios):.2f}, {max(ratios):.2f}]"
    return dict(metric=metric, value=value, goal=goal, op=op, unit="x", note=note)


def verdict(row: dict) -> str:
    goal, value, op = row.get("goal"), row["value"], row.get("op", ">=")
    if goal is None:
        return "no goal"
    met = value >= goal if op == ">=" else value <= goal
    if met:
        return f"goal {op} {goal:g}: met"
    miss = (goal - value) / goal if op == ">=" else (value - goal) / goal
    return f"goal {op} {goal:g}: MISSED by {miss:.0%}"


def report(args, benchmark: str, rows: list[dict], setting: str) -> None:
    """Print every ratio with its goal (and by how much a missed goal is missed), then write
    them to --results-json."""
    print(f"{benchmark} ({setting}, clock={args.clock}, threads={torch.get_num_threads()}):")
    for row in rows:
        print(f"  {row['metric']}: {row['value']:.2f}{row.get('unit', 'x')} ({verdict(row)})")
        print(f"      {row['note']}")
    machine = f"{args.device}, {torch.get_num_threads()} threads, clock={args.clock}, {setting}"
    results = [
        Result(
            benchmark,
            row["metric"],
            row["value"],
            row.get("goal"),
            row.get("op", ">="),
            row.get("unit", "x"),
            f"{row['note']} [{machine}]",
        )
        for row in rows
    ]
    write_results(args.results_json, results)


def profile_table(path: str, steps: dict, title: str, rows: int = 25) -> None:
    """torch.profiler tables (self CPU time, one step per model after the timed ones) into
    ``path`` as Markdown."""
    from torch.profiler import ProfilerActivity, profile

    parts = [f"# Profile: {title}\n"]
    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        table = prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48
        )
        parts.append(f"## {name}\n\n```\n{table}\n```\n")
    Path(path).write_text("\n".join(parts))
    print(f"profile tables written to {path}")


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

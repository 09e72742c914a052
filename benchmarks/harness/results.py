"""The --results-json convention every benchmark follows (run_all reads it), and the one way
the benchmarks write JSON.

A benchmark given ``--results-json PATH`` writes there a JSON list of objects
{"benchmark": script name, "metric": short name, "value": float or null (not measured),
"goal": float or null, "op": ">=" or "<=" (value op goal is met), "unit": "x" or another
unit, "note": str}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform


@dataclasses.dataclass(frozen=True)
class Result:
    benchmark: str
    metric: str
    value: float | None
    goal: float | None = None
    op: str = ">="
    unit: str = "x"
    note: str = ""

    def met(self) -> bool | None:
        if self.goal is None or self.value is None:
            return None
        return self.value >= self.goal if self.op == ">=" else self.value <= self.goal


def write_json(path: str, data) -> None:
    """``data`` as indented JSON at ``path`` (its folder made), complete or not at all: a run
    stopped mid-write leaves the previous file, never half of one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _number(x) -> float | None:
    # numpy scalars and ints alike: JSON gets plain floats.
    return None if x is None else float(x)


def write_results(path: str | None, results: list[Result]) -> None:
    """The convention's list at ``path`` (nothing when no --results-json was given)."""
    if not path:
        return
    rows = [
        {**dataclasses.asdict(r), "value": _number(r.value), "goal": _number(r.goal)}
        for r in results
    ]
    write_json(path, rows)


def read_results(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def machine() -> str:
    """One line naming the machine the results were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    memory = ""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory = f", {pages * size / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs{memory}{gpu or ', no GPU'}; {platform.platform()}"

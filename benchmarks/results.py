"""The --results-json convention every benchmark follows (run_all.py reads it).

A benchmark given ``--results-json PATH`` writes there a JSON list of objects
{"benchmark": script name, "metric": short name, "value": float or null (not measured),
"goal": float or null, "op": ">=" or "<=" (value op goal is met), "unit": "x" or another
unit, "note": str}.
"""

from __future__ import annotations

import dataclasses
import json
import os


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


def write_results(path: str | None, results: list[Result]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump([dataclasses.asdict(r) for r in results], f, indent=2)
        f.write("\n")

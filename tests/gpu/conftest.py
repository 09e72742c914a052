"""The GPU tier: skipped, with the reason, where CUDA is absent (every CPU run of `make
test`); run by `make gpu-test`, which sets GPU_REPORT_DIR so that this file writes one
report (report.json, report.md) of what ran on which GPU, what passed, what was skipped and
why, and the numbers the tests measured (their record_property values)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import cuda_missing

GPU_TESTS = Path(__file__).resolve().parent
REPORT_ENV = "GPU_REPORT_DIR"
_results: list[dict] = []


def pytest_collection_modifyitems(config, items):
    reason = cuda_missing()
    if reason is None:
        return
    for item in items:
        if GPU_TESTS in Path(item.path).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report):
    if not report.nodeid.startswith("tests/gpu/"):
        return
    if report.when != "call" and not (report.skipped or report.failed):
        return
    entry = {"test": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 2),
             "properties": dict(report.user_properties)}  # fmt: skip
    if report.skipped and isinstance(report.longrepr, tuple):
        entry["reason"] = report.longrepr[2].removeprefix("Skipped: ")
    elif report.failed:
        entry["phase"] = report.when
        entry["error"] = report.longreprtext.strip().splitlines()[-30:]
    _results.append(entry)


def _environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except Exception as e:  # the report must still be written
        env["deepspeed"] = f"not importable: {e}"
    if torch.cuda.is_available():
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["gpus"] = [
            {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
             "capability": f"{p.major}.{p.minor}"}
            for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))
        ]  # fmt: skip
    return env


# helpers.require_gpus's reason: a test this machine has too few GPUs for.
TOO_FEW_GPUS = re.compile(r"^needs \d+ CUDA GPU\(s\), this machine has \d+")


def summary_line(results: list[dict]) -> str:
    """The report's first line: passed / failed / skipped, and how many of the skips were for
    too few GPUs (a one-GPU machine passes without running the two-GPU tests: this says so)."""
    count = {k: sum(r["outcome"] == k for r in results) for k in ("passed", "failed", "skipped")}
    few = sum(bool(TOO_FEW_GPUS.match(r.get("reason", ""))) for r in results)
    return (f"{count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped "
            f"({few} for too few GPUs)")  # fmt: skip


def _markdown(report: dict) -> str:
    env, counts = report["environment"], report["summary"]
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in env.get("gpus", [])) or "none"
    lines = [
        f"GPU tests: {report['summary_line']}",
        "",
        "# GPU test report",
        "",
        f"{env['date']} on {env['host']}: GPUs {gpus}; torch {env['torch']} (CUDA "
        f"{env['cuda']}, NCCL {env.get('nccl')}), DeepSpeed {env['deepspeed']}, "
        f"Python {env['python']}.",
        "",
        "Summary: " + ", ".join(f"{n} {k}" for k, n in counts.items()),
        "",
        "| test | outcome | s | measured / reason |",
        "|---|---|---|---|",
    ]
    for r in report["results"]:
        detail = "; ".join(f"{k}={v}" for k, v in r["properties"].items())
        detail = detail or r.get("reason", "") or (r.get("error") or [""])[-1]
        lines.append(f"| `{r['test']}` | {r['outcome']} | {r['seconds']} | {detail} |")
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session, exitstatus):
    directory = os.environ.get(REPORT_ENV)
    if not directory:
        return
    counts: dict[str, int] = {}
    for r in _results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    report = {"summary_line": summary_line(_results), "environment": _environment(),
              "summary": counts, "results": _results}  # fmt: skip
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(_markdown(report))
    print(f"\nGPU tests: {report['summary_line']}; report: {out / 'report.md'} and report.json",
          file=sys.stderr)  # fmt: skip

"""`make gpu-test` on a machine whose python has torch but not the rest (README's GPU install
alone gives no pytest; no build/gpu_wheels folder copied along): one line naming what is
missing and how to get it, before anything is installed or run, instead of a traceback
halfway. A stub torch package stands in for torch's CUDA build, which this machine lacks."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ENV, REPO


def _make(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_gpu_test_without_the_dependencies_stops_in_one_line(tmp_path):
    (tmp_path / "stub" / "torch").mkdir(parents=True)
    (tmp_path / "stub" / "torch" / "__init__.py").write_text("")
    python = tmp_path / "python"  # imports the stub torch and nothing of site-packages
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "stub"} exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    report = tmp_path / "report"
    res = _make("gpu-test", f"GPU_PYTHON={python}", f"GPU_WHEELS={tmp_path / 'no_wheels'}",
                f"GPU_REPORT={report}")  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("gpu-test:")]
    assert len(lines) == 1, res.stderr
    assert f"{sys.executable} lacks deepspeed, " in lines[0] and ", pytest, " in lines[0]
    assert "torch" not in lines[0].split("lacks")[1].split(":")[0]
    assert "make gpu-wheels" in lines[0]
    assert "pip install" not in res.stdout and not report.exists()  # nothing ran


def test_the_dependency_check_passes_where_every_pin_is_installed():
    check = _make("--eval", "_check: ; @printenv GPU_DEPS_CHECK", "_check").stdout
    assert "requirements/" in check
    res = subprocess.run([sys.executable, "-c", check], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0 and res.stderr == "", res.stderr

"""`make gpu-test` and `make gpu-wheels` (tools/gpu_wheels.py).

* On a machine whose python has torch but not the rest: one line naming what is missing and
  how to get it, before anything runs. A stub torch stands in for torch's CUDA build.
* A wheelhouse built for another Python, a CPU torch, or a CUDA torch that sees no GPU: one
  line, nothing installed.
* The wheelhouse for the lent GPU nodes (Python 3.12, manylinux_2_28_x86_64, the packages of
  requirements/gpu_node_py312.txt installed) is built from PyPI (skipped offline): pip's
  resolver installs it, offline, on top of that list; it stays under the 64 MiB carried.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import packaging
import pytest

from tests.helpers import ENV, REPO


def _make(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=900)  # fmt: skip


def _stub_python(tmp_path: Path, version: str = "2.11.0+cu130", cuda: str = "13.0",
                 gpus: int = 1) -> Path:  # fmt: skip
    """A python that imports a stub torch (``version``, CUDA ``cuda`` or a CPU build for None,
    seeing ``gpus`` GPUs), packaging (gpu_wheels.py's one dependency, on every machine with
    pip) and nothing else of site-packages."""
    stub = tmp_path / "stub"
    (stub / "torch").mkdir(parents=True)
    (stub / "torch" / "__init__.py").write_text(
        f"__version__ = {version!r}\nclass version:\n    cuda = {cuda!r}\n"
        f"class cuda:\n    is_available = staticmethod(lambda: {gpus} > 0)\n"
    )
    shutil.copytree(Path(packaging.__file__).parent, stub / "packaging")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{stub}:$PYTHONPATH" exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    return python


def _gpu_test(tmp_path, python, wheels) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    report = tmp_path / "report"
    res = _make("gpu-test", f"GPU_PYTHON={python}", f"GPU_WHEELS={wheels}",
                f"GPU_SITE={tmp_path / 'site'}", f"GPU_REPORT={report}")  # fmt: skip
    lines = [line for line in res.stderr.splitlines() if line.startswith("gpu-test:")]
    return res, lines, report


def test_gpu_test_without_the_dependencies_stops_in_one_line(tmp_path):
    res, lines, report = _gpu_test(tmp_path, _stub_python(tmp_path), tmp_path / "no_wheels")
    assert res.returncode == 2, res.stdout + res.stderr
    assert len(lines) == 1, res.stderr
    assert f"{sys.executable} lacks deepspeed, " in lines[0] and ", lacks pytest" in lines[0]
    assert "torch" not in lines[0].split(":")[1]
    assert "make gpu-wheels" in lines[0]
    assert not report.exists() and not (tmp_path / "site").exists()  # nothing ran


# A wheelhouse's Python other than the one running the tests (which may be the nodes' 3.12).
OTHER_PYTHON = f"3.{sys.version_info[1] + 1}"


@pytest.mark.parametrize(
    "python_version,torch_version,cuda,gpus,says",
    [
        (OTHER_PYTHON, "2.11.0+cu130", "13.0", 1, f"holds wheels for Python {OTHER_PYTHON}, "),
        (None, "2.5.1+cu124", "12.4", 1, "torch 2.5.1+cu124 is older than 2.6"),
        (None, "2.11.0+cpu", None, 0, "torch 2.11.0+cpu is a CPU build (no CUDA)"),
        # CUDA's build on a machine without a GPU (every test would skip, and "pass").
        (None, "2.11.0+cu130", "13.0", 0, "torch 2.11.0+cu130 (CUDA 13.0) sees no GPU"),
    ],
)
def test_gpu_test_checks_python_and_torch_first(
    tmp_path, python_version, torch_version, cuda, gpus, says
):
    here = "{}.{}".format(*sys.version_info[:2])
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "wheelhouse.json").write_text(json.dumps(
        {"python_version": python_version or here, "platform": "manylinux_2_28_x86_64"}
    ))  # fmt: skip
    python = _stub_python(tmp_path, torch_version, cuda, gpus)
    res, lines, report = _gpu_test(tmp_path, python, wheels)
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert says in lines[0]
    assert not (tmp_path / "site").exists() and not report.exists()


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.network
def test_wheelhouse_for_the_lent_gpu_nodes_installs_offline(tmp_path):
    if not _pypi_reachable():
        pytest.skip("PyPI is not reachable from here: the wheelhouse cannot be downloaded")
    out = tmp_path / "wheels"
    # What `make gpu-wheels` runs (with the venv's python, which make would first build).
    plan = _make("-n", "gpu-wheels", f"GPU_WHEELS={out}", "VENV=/nonexistent").stdout
    assert "tools/gpu_wheels.py build --python-version 3.12" in plan
    assert "--installed requirements/gpu_node_py312.txt" in plan
    res = subprocess.run([sys.executable, "tools/gpu_wheels.py", "build", "--out", str(out)],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    (summary,) = [line for line in res.stdout.splitlines() if line.startswith("gpu-wheels:")]
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    assert size < 64 * 2**20 and f"{size / 2**20:.1f} MiB" in summary
    names = {w.name.split("-")[0].lower() for w in wheels}
    # What the nodes lack (requirements/gpu.txt and their dependencies), and only that.
    assert {"deepspeed", "pydantic", "pydantic_core", "hjson", "blingfire"} <= names
    assert not names & {"torch", "transformers", "numpy", "pytest", "pyarrow", "mpi4py", "mpich"}
    (deepspeed,) = [w for w in wheels if w.name.startswith("deepspeed-")]
    assert deepspeed.name.endswith("-py3-none-any.whl")  # DS_BUILD_OPS=0: no compiled op
    with zipfile.ZipFile(deepspeed) as z:
        assert not [n for n in z.namelist() if n.endswith(".so")]
    for wheel in wheels:  # every binary one is CPython 3.12's (or stable-ABI) for Linux
        tags = wheel.name.removesuffix(".whl").split("-")[-3:]
        assert tags[1] in ("none", "abi3", "cp312") and "linux" in tags[2] or tags[2] == "any"
    # gpu-wheels ran pip's resolver offline against the wheelhouse and the node's list.
    manifest = json.loads((out / "wheelhouse.json").read_text())
    assert manifest["python_version"] == "3.12" and manifest["wheels"] == [w.name for w in wheels]


def test_the_report_counts_skips_for_too_few_gpus():
    from tests.gpu.conftest import summary_line
    from tests.helpers import require_gpus

    with pytest.raises(pytest.skip.Exception) as skip:
        require_gpus(99)
    results = [
        {"outcome": "passed"},
        {"outcome": "skipped", "reason": str(skip.value)},
        {"outcome": "skipped", "reason": "needs apex"},
        {"outcome": "failed"},
    ]
    assert summary_line(results) == "1 passed, 1 failed, 2 skipped (1 for too few GPUs)"


def test_installed_list_reads_every_line_or_names_the_one_it_cannot(tmp_path, capsys):
    from tools.gpu_wheels import main, read_installed

    good = tmp_path / "freeze.txt"
    good.write_text(
        "# pip freeze\n\nNumPy==2.1.0  # comment\ntorch @ file:///wheels/torch-2.11.0%2Bcu130"
        "-cp312-cp312-linux_x86_64.whl\nodd===1.0\nzope.interface==7.0\n"
    )
    assert {k: str(v) for k, v in read_installed(good).items()} == {
        "numpy": "2.1.0", "torch": "2.11.0+cu130", "odd": "1.0", "zope-interface": "7.0",
    }  # fmt: skip
    # Each of these was skipped, so the package counted as missing and was packed.
    for line in ("-e git+https://x/y.git@abc#egg=mine", "mine @ file:///src/mine",
                 "mine==not a version", "mine"):  # fmt: skip
        bad = tmp_path / "bad.txt"
        bad.write_text(f"numpy==2.1.0\n{line}\n")
        assert main(["build", "--installed", str(bad), "--out", str(tmp_path / "w")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{bad} line 2" in err[0] and "pip list --format=freeze" in err[0]


def test_rehearsal_requirements_are_the_nodes_list_and_what_the_tiers_add(tmp_path):
    """`make gpu-rehearsal`: the node's list as PyPI has it (torch's CUDA libraries and
    triton come at torch's own pins), and the CPU tiers' other packages at our pins, less
    what the node or the wheelhouse already holds."""
    from tools.gpu_wheels import main, read_installed, read_requirements

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "ninja-1.13.2-py3-none-manylinux2014_x86_64.whl").write_bytes(b"")
    node_list = REPO / "requirements/gpu_node_py312.txt"
    assert main(["rehearsal", "--installed", str(node_list), "--wheels", str(wheels),
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    node = (tmp_path / "node.txt").read_text().splitlines()
    assert "torch==2.11.0" in node and "transformers==5.17.0" in node
    assert not [n for n in node if n.startswith(("nvidia-", "triton", "cuda-"))]
    assert len(node) == len(read_installed(node_list)) - sum(
        n.startswith(("nvidia-", "triton")) for n in read_installed(node_list)
    )
    extras = {r.name for r in read_requirements(tmp_path / "extras.txt")}
    assert {"nltk", "megatron-core", "zstandard"} <= extras
    # the node's, the wheelhouse's (ninja), requirements/gpu.txt's (deepspeed), and ruff
    assert not extras & {"torch", "numpy", "transformers", "ninja", "deepspeed", "ruff"}

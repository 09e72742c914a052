"""A wheelhouse for a GPU machine that reaches no package registry: a build tool of the
Makefile's gpu-wheels and gpu-test, not part of the installed package.

    python tools/gpu_wheels.py build --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        --installed requirements/gpu_node_py312.txt --out build/gpu_wheels
    python tools/gpu_wheels.py check --wheels build/gpu_wheels     # on the GPU machine

``build`` packs, for the target's Python and platform, what requirements/gpu.txt needs and the
target's installed list (its ``pip list --format=freeze``) lacks or has below the bound, with
their dependencies that it also lacks: wheels only, pinned as this environment resolved them
where it has them; DeepSpeed built here as a pure-Python wheel (DS_BUILD_OPS=0). It then
checks with pip's resolver, offline, that the wheelhouse installs on top of the installed list
(each installed package stood in for by an empty wheel of its name and version) and prints the
size. ``check`` runs on the target before anything is installed: its Python and platform
against the wheelhouse's, torch >= 2.6 with CUDA and a GPU it sees; ``deps`` after the
wheelhouse is on the path: requirements/gpu.txt met. One line and exit status 2 when
something is wrong. ``rehearsal`` writes the requirements of `make gpu-rehearsal`.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path
from urllib.parse import unquote

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
NEEDS = REPO / "requirements" / "gpu.txt"
MANIFEST = "wheelhouse.json"
MIN_TORCH = Version("2.6")
# The launcher's budget for files carried along with the tree.
LIMIT_BYTES = 64 * 2**20


class WheelError(Exception):
    """A problem to report in one line."""


def read_requirements(path: Path) -> list[Requirement]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def read_installed(path: Path) -> dict[str, Version]:
    """name -> version of a ``pip list --format=freeze`` (or ``pip freeze``) file. A line
    this cannot read is an error, not skipped: a package read as missing would be packed
    (torch installed from a local wheel, say: its wheel is far over the 64 MiB carried)."""
    installed = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#")[0].strip() if not raw.lstrip().startswith("-") else raw.strip()
        if not line:
            continue
        # name==version (===: pip's arbitrary equality), or pip freeze's name @ .../file.whl
        pinned = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*===?\s*(\S+)", line)
        wheel = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*@\s*\S+/[^/-]+-([^-/]+)-\S+\.whl",
                             unquote(line))  # fmt: skip
        match = pinned or wheel
        try:
            version = Version(match.group(2)) if match else None
        except InvalidVersion:
            version = None
        if version is None:
            raise WheelError(f"--installed: {path} line {number} ({raw.strip()!r}) has no "
                             "name==version: write the file with pip list --format=freeze")  # fmt: skip
        installed[canonicalize_name(match.group(1))] = version
    return installed


def target_environment(python_version: str, platform: str) -> dict[str, str]:
    """Marker values of the target (Linux CPython)."""
    env = default_environment()
    machine = platform.rsplit("_", 1)[-1] if "x86_64" not in platform else "x86_64"
    env.update(python_version=python_version, python_full_version=f"{python_version}.0",
               sys_platform="linux", platform_system="Linux", os_name="posix",
               platform_machine=machine, implementation_name="cpython",
               platform_python_implementation="CPython")  # fmt: skip
    return env


def _satisfied(req: Requirement, installed: dict[str, Version]) -> bool:
    version = installed.get(canonicalize_name(req.name))
    # A local label (torch 2.11.0+cu130) satisfies the public version's bounds.
    return version is not None and req.specifier.contains(Version(version.public), prereleases=True)


def _pin(req: Requirement) -> str:
    """This environment's version where it satisfies the requirement (what the tests ran
    with), else the requirement as given."""
    try:
        here = Version(metadata.version(req.name))
    except metadata.PackageNotFoundError:
        return f"{req.name}{req.specifier}"
    if req.specifier.contains(here, prereleases=True):
        return f"{req.name}=={here}"
    return f"{req.name}{req.specifier}"


def _wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode("utf-8")
    return [Requirement(v) for k, v in re.findall(r"^(Requires-Dist): (.+)$", text, re.M)]


def _wheel_name(wheel: Path) -> str:
    return canonicalize_name(wheel.name.split("-")[0])


def _platform_args(python_version: str, platform: str) -> list[str]:
    abi = "cp" + python_version.replace(".", "")
    platforms = [platform]
    if platform.startswith("manylinux_2_28_"):  # older manylinux tags install there too
        arch = platform.removeprefix("manylinux_2_28_")
        platforms += [f"manylinux_2_{v}_{arch}" for v in (27, 26, 24, 17)]
        platforms += [f"manylinux2014_{arch}", f"manylinux1_{arch}"]
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation",
            "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]  # fmt: skip
    for p in platforms:
        args += ["--platform", p]
    return args


def _pip(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                         env=env)  # fmt: skip
    if res.returncode:
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        raise WheelError(f"pip {args[0]} failed: {' | '.join(lines[-6:])}")
    return res


def build(python_version: str, platform: str, installed_file: Path, out: Path) -> int:
    installed = read_installed(installed_file)
    env = target_environment(python_version, platform)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    wanted = [r for r in read_requirements(NEEDS) if not r.marker or r.marker.evaluate(env)]
    packed: set[str] = set()
    while wanted:
        missing = {
            canonicalize_name(r.name): r
            for r in wanted
            if not _satisfied(r, installed) and canonicalize_name(r.name) not in packed
        }
        if not missing:
            break
        packed |= set(missing)
        before = set(out.glob("*.whl"))
        if "deepspeed" in missing:
            # An sdist: built here without its CUDA ops (DeepSpeed JIT-builds one on first
            # use, and this project uses none on GPUs), tagged py3-none-any.
            _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out),
                 _pin(missing.pop("deepspeed")), env={**os.environ, "DS_BUILD_OPS": "0"})  # fmt: skip
        if missing:
            _pip("download", "-q", "--no-deps", *_platform_args(python_version, platform),
                 "-d", str(out), *map(_pin, missing.values()))  # fmt: skip
        wanted = []
        for wheel in set(out.glob("*.whl")) - before:
            for req in _wheel_requirements(wheel):
                if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                    wanted.append(req)
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    (out / MANIFEST).write_text(json.dumps({
        "python_version": python_version, "platform": platform,
        "installed": str(installed_file), "wheels": [w.name for w in wheels],
    }, indent=1) + "\n")  # fmt: skip
    check_installs(out, installed, python_version, platform)
    names = ", ".join(_wheel_name(w) for w in wheels)
    print(f"gpu-wheels: {len(wheels)} wheels, {size / 2**20:.1f} MiB, for Python "
          f"{python_version} {platform} on top of {installed_file}: {names}")  # fmt: skip
    if size > LIMIT_BYTES:
        raise WheelError(f"{out} holds {size / 2**20:.1f} MiB, more than the 64 MiB carried")
    return 0


def _stub_wheel(directory: Path, name: str, version: Version) -> None:
    """An empty wheel standing in for an installed distribution in pip's resolver."""
    dist = f"{re.sub(r'[-.]+', '_', name)}-{version}"
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")  # fmt: skip
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")  # fmt: skip
        z.writestr(f"{dist}.dist-info/RECORD", "")


def check_installs(wheels: Path, installed: dict[str, Version], python_version: str,
                   platform: str) -> None:  # fmt: skip
    """pip's resolver, offline: requirements/gpu.txt from the wheelhouse and the installed
    packages (pinned to their versions), nothing from anywhere else, and nothing installed
    replaced."""
    with tempfile.TemporaryDirectory() as tmp:
        stubs, report = Path(tmp) / "stubs", Path(tmp) / "report.json"
        stubs.mkdir()
        pins = Path(tmp) / "installed.txt"
        # Installed packages stay as they are, except those the wheelhouse brings a newer
        # one of (it goes first on PYTHONPATH; the machine's own copy is untouched).
        packed = {_wheel_name(w) for w in wheels.glob("*.whl")}
        pins.write_text("".join(f"{n}=={v}\n" for n, v in installed.items() if n not in packed))
        for name, version in installed.items():
            _stub_wheel(stubs, name, version)
        _pip("install", "--dry-run", "-q", "--ignore-installed", "--no-index",
             "--find-links", str(wheels), "--find-links", str(stubs), "-c", str(pins),
             *_platform_args(python_version, platform), "--target", str(Path(tmp) / "t"),
             "--report", str(report), "-r", str(NEEDS))  # fmt: skip
        chosen = json.loads(report.read_text())["install"]
    from_wheelhouse = {w.name for w in wheels.glob("*.whl")}
    for item in chosen:
        wheel = item["download_info"]["url"].rsplit("/", 1)[-1]
        name = canonicalize_name(item["metadata"]["name"])
        if wheel not in from_wheelhouse and name not in installed:
            raise WheelError(f"pip's resolver took {wheel} from neither {wheels} nor the list")


def check_target(wheels: Path) -> int:
    """On the GPU machine, before anything is installed."""
    problems = []
    manifest = wheels / MANIFEST
    if manifest.is_file():
        want = json.loads(manifest.read_text())
        have = "{}.{}".format(*sys.version_info[:2])
        if want["python_version"] != have:
            problems.append(f"{wheels} holds wheels for Python {want['python_version']}, "
                            f"{sys.executable} is Python {have}")  # fmt: skip
        platform = sysconfig.get_platform().replace("-", "_")  # linux_x86_64
        if platform.split("_", 1)[-1] not in want["platform"]:
            problems.append(f"{wheels} is for {want['platform']}, this machine is {platform}")
    try:
        import torch
    except ImportError:
        problems.append(f"{sys.executable} cannot import torch: install its CUDA build first")
    else:
        version = Version(Version(torch.__version__).public)
        if version < MIN_TORCH:
            problems.append(f"torch {torch.__version__} is older than {MIN_TORCH}")
        if torch.version.cuda is None:
            problems.append(f"torch {torch.__version__} is a CPU build (no CUDA)")
        elif not torch.cuda.is_available():
            # Else every test of the tier skips and the run "passes" having run nothing.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
            problems.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
                            f"(CUDA_VISIBLE_DEVICES={visible})")  # fmt: skip
    if problems:
        print("gpu-test: " + "; ".join(problems) + " (docs/gpus.md)", file=sys.stderr)
        return 2
    return 0


def check_dependencies() -> int:
    """After the wheelhouse is on the path: requirements/gpu.txt is met (one line if not)."""
    missing, old = [], []
    for req in read_requirements(NEEDS):
        try:
            version = Version(metadata.version(req.name))
        except metadata.PackageNotFoundError:
            missing.append(req.name)
            continue
        if not req.specifier.contains(Version(version.public), prereleases=True):
            old.append(f"{req.name} {version} (needs {req.specifier})")
    if missing or old:
        what = ", ".join([*(f"lacks {m}" for m in missing), *(f"has {o}" for o in old)])
        print(f"gpu-test: {sys.executable} {what}: run make gpu-wheels where PyPI is reachable "
              "(GPU_INSTALLED: this machine's pip list --format=freeze) and copy its folder "
              "here, or pip install -r requirements/gpu.txt", file=sys.stderr)  # fmt: skip
        return 2
    return 0


# Come with torch's PyPI wheel, at its own pins, in the rehearsal (and are no test's concern).
_WITH_TORCH = re.compile(r"(nvidia-.*|cuda-.*|triton)")


def rehearsal_requirements(installed_file: Path, wheels: Path, out: Path) -> int:
    """For `make gpu-rehearsal` (docs/gpus.md): ``node.txt``, the target's installed list as
    PyPI has it (torch's public version, which brings its CUDA libraries and triton at its
    own pins), and ``extras.txt``, what the CPU tiers need besides (requirements/cpu.txt and
    dev.txt at their pins) that neither that list nor the wheelhouse ``wheels`` holds."""
    installed = read_installed(installed_file)
    node = [f"{n}=={v.public}" for n, v in installed.items() if not _WITH_TORCH.fullmatch(n)]
    provided = set(installed) | {canonicalize_name(r.name) for r in read_requirements(NEEDS)}
    provided |= {_wheel_name(w) for w in wheels.glob("*.whl")}
    cpu = read_requirements(REPO / "requirements/cpu.txt") + read_requirements(
        REPO / "requirements/dev.txt"
    )
    extras = [str(r) for r in cpu if canonicalize_name(r.name) not in provided | {"ruff"}]
    out.mkdir(parents=True, exist_ok=True)
    (out / "node.txt").write_text("".join(f"{line}\n" for line in node))
    (out / "extras.txt").write_text("".join(f"{line}\n" for line in extras))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="pack the wheelhouse (needs PyPI)")
    b.add_argument("--python-version", default="3.12", help="the target's, e.g. 3.12")
    b.add_argument("--platform", default="manylinux_2_28_x86_64", help="the target's wheel tag")
    b.add_argument("--installed", type=Path, default=REPO / "requirements/gpu_node_py312.txt",
                   help="the target's pip list --format=freeze")  # fmt: skip
    b.add_argument("--out", type=Path, default=REPO / "build/gpu_wheels")
    c = sub.add_parser("check", help="the GPU machine's preconditions")
    c.add_argument("--wheels", type=Path, default=REPO / "build/gpu_wheels")
    sub.add_parser("deps", help="requirements/gpu.txt met (after the wheelhouse is installed)")
    r = sub.add_parser("rehearsal", help="requirements of the CPU rehearsal of the target")
    r.add_argument("--installed", type=Path, default=REPO / "requirements/gpu_node_py312.txt",
                   help="the target's pip list --format=freeze")  # fmt: skip
    r.add_argument("--wheels", type=Path, default=REPO / "build/gpu_wheels")
    r.add_argument("--out", type=Path, required=True, help="folder for node.txt, extras.txt")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            if not args.installed.is_file():
                raise WheelError(f"--installed: {args.installed} does not exist")
            if not re.fullmatch(r"3\.\d+", args.python_version):
                raise WheelError(f"--python-version: {args.python_version!r} is not like 3.12")
            return build(args.python_version, args.platform, args.installed, args.out)
        if args.command == "deps":
            return check_dependencies()
        if args.command == "rehearsal":
            return rehearsal_requirements(args.installed, args.wheels, args.out)
        return check_target(args.wheels)
    except WheelError as e:
        print(f"gpu-wheels: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The package's layers import only downward (docs/architecture.md): runtime/ (facts about
the process and its launcher) and parallel/ at the bottom with data/, which depends on none
of the others; models/ on parallel/; checkpoint/ (the on-disk protocol and the resume plan)
on parallel/, data/ and runtime/; training/ (the generic driver, which knows no model) on
those; preprocessing/ and tasks/ stand apart (they may read data/); recipes/ wires models
and tasks into the driver; evaluation/ reads pretrained models through recipes/; cli/ parses
flags. Inside training/, resilience/ and observability/ are below the loop and the driver.
Every import counts, also those inside functions (the lazy ones that keep --help fast).
Package-level modules (arguments.py, errors.py, io.py, param_groups.py, model_outputs.py)
sit below every subpackage."""

from __future__ import annotations

from pathlib import Path

import pytest

import megatron_taco
from tests.helpers import imported_modules

PACKAGE = Path(megatron_taco.__file__).parent
ROOT = "<root>"  # package-level modules
BELOW_RECIPES = {
    "parallel",
    "models",
    "data",
    "runtime",
    "checkpoint",
    "training",
    "tasks",
}  # recipes/ and above read them
# What each layer may import besides itself and the package-level modules.
ALLOWED = {
    ROOT: set(),
    "runtime": set(),
    "parallel": set(),
    "data": set(),
    "models": {"parallel"},
    "checkpoint": {"parallel", "data", "runtime"},
    "training": {"parallel", "data", "runtime", "checkpoint"},
    "preprocessing": {"data"},
    "tasks": {"data"},
    "recipes": BELOW_RECIPES,
    # Loads pretrained models through recipes/registry.py; only cli/ imports it.
    "evaluation": BELOW_RECIPES | {"recipes"},
    "cli": BELOW_RECIPES | {"recipes", "evaluation", "preprocessing"},
}
# Inside training/: what each of its subpackages may import of training/ besides itself.
TRAINING_ALLOWED = {"resilience": set(), "observability": {"callbacks"}}


def layer_of(module: str) -> str | None:
    """``megatron_taco.x.y`` -> "x" for a subpackage, ROOT for a package-level module."""
    parts = module.split(".")
    if parts[0] != "megatron_taco" or len(parts) < 2:
        return None
    return parts[1] if (PACKAGE / parts[1]).is_dir() else ROOT


def imported_layers(path: Path, package: str) -> set[str]:
    return {layer for m in imported_modules(path, package) if (layer := layer_of(m)) is not None}


def violations(root: Path = PACKAGE) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        layer = rel.parts[0] if len(rel.parts) > 1 else ROOT
        package = ".".join(["megatron_taco", *rel.parts[:-1]])
        allowed = ALLOWED[layer] | {layer, ROOT}
        for bad in sorted(imported_layers(path, package) - allowed):
            out.append(f"{rel} ({layer}) imports {bad}")
        if layer == "training" and rel.parts[1] in TRAINING_ALLOWED:
            own = TRAINING_ALLOWED[rel.parts[1]] | {rel.parts[1]}
            for module in sorted(imported_modules(path, package)):
                parts = module.split(".")
                inside = parts[:2] == ["megatron_taco", "training"] and len(parts) > 2
                if inside and parts[2] not in own:
                    out.append(f"{rel} (training/{rel.parts[1]}) imports training.{parts[2]}")
    return out


def test_layers_import_only_downward():
    assert set(ALLOWED) - {ROOT} == {p.name for p in PACKAGE.iterdir() if p.is_dir()} - {
        "__pycache__"
    }, "a new subpackage needs its place in ALLOWED"
    assert violations() == []


def _copy_package(tmp_path: Path) -> Path:
    root = tmp_path / "megatron_taco"
    for path in PACKAGE.rglob("*.py"):
        target = root / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    return root


@pytest.mark.parametrize(
    "module, planted, expected",
    [
        # The two edges this test was written for: the monitor reading the model's output
        # names from models/, the data cache taking its barrier from parallel/.
        (
            "training/observability/monitor.py",
            "from megatron_taco.models.common.monitoring import REPRESENTATION",
            "training/observability/monitor.py (training) imports models",
        ),
        # The checkpoint package below the driver, the resume plan included.
        (
            "checkpoint/plan.py",
            "from megatron_taco.training.optim import optimizer_implementation",
            "checkpoint/plan.py (checkpoint) imports training",
        ),
        (
            "runtime/launcher.py",
            "from megatron_taco.parallel import comm",
            "runtime/launcher.py (runtime) imports parallel",
        ),
        # Resilience below the loop: the exit monitor never reaches into the driver.
        (
            "training/resilience/exit.py",
            "from megatron_taco.training.loop import Trainer",
            "training/resilience/exit.py (training/resilience) imports training.loop",
        ),
        (
            "data/cache.py",
            "from megatron_taco.parallel import comm",
            "data/cache.py (data) imports parallel",
        ),
        # Relative imports and imports inside a function count too.
        (
            "data/cache.py",
            "def _f():\n    from ..parallel.comm import barrier",
            "data/cache.py (data) imports parallel",
        ),
        (
            "model_outputs.py",
            "from megatron_taco import training",
            "model_outputs.py (<root>) imports training",
        ),
        # evaluation/ sits above recipes/: the registry may not reach up to it.
        (
            "recipes/registry.py",
            "from megatron_taco.evaluation.encoders import OurEncoder",
            "recipes/registry.py (recipes) imports evaluation",
        ),
    ],
)
def test_the_check_sees_an_edge_coming_back(tmp_path, module, planted, expected):
    root = _copy_package(tmp_path)
    with open(root / module, "a", encoding="utf-8") as f:
        f.write(f"\n\n{planted}\n")
    assert expected in violations(root)


def test_every_cli_module_runs_as_python_dash_m():
    """``python -m megatron_taco.cli.X`` runs the tool: a module with a main() and no
    ``__main__`` guard would exit 0 having done nothing."""
    import ast

    for path in sorted((Path(megatron_taco.__file__).parent / "cli").glob("*.py")):
        tree = ast.parse(path.read_text())
        has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        guarded = any(
            isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body
        )
        assert guarded or not has_main, f"{path.name}: main() is never called under -m"

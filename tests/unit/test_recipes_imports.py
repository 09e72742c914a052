"""recipes/ imports one way: sweep.py and sweep_summary.py (the protocols, their table) and finetune_eval.py (the
dev evaluation, results.json) never import finetune.py (the recipe and its command), and
finetune_eval.py imports neither of the others. Every import counts, also those inside
functions, which a cycle would otherwise hide until run time."""

from __future__ import annotations

from pathlib import Path

import pytest

import megatron_taco.recipes as recipes
from tests.helpers import imported_modules

RECIPES = Path(recipes.__file__).parent
PACKAGE = "megatron_taco.recipes"


def recipe_imports(name: str) -> set[str]:
    """The recipes/ modules ``name`` imports, anywhere in its source."""
    modules = imported_modules(RECIPES / f"{name}.py", PACKAGE)
    found = {m[len(PACKAGE) + 1 :].split(".")[0] for m in modules if m.startswith(f"{PACKAGE}.")}
    return found - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    def visit(node, path):
        if node in path:
            return path[path.index(node) :] + [node]
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, path + [node])
            if found:
                return found
        return None

    for start in graph:
        found = visit(start, [])
        if found:
            return found
    return None


def test_recipes_import_one_way():
    modules = sorted(p.stem for p in RECIPES.glob("*.py") if p.stem != "__init__")
    graph = {m: recipe_imports(m) & set(modules) for m in modules}
    assert _cycle(graph) is None, f"import cycle in recipes/: {' -> '.join(_cycle(graph))}"
    assert "finetune" not in graph["sweep"] | graph["finetune_eval"]
    assert not graph["finetune_eval"] & {"finetune", "sweep"}


def test_the_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    source = (RECIPES / "finetune_eval.py").read_text(encoding="utf-8")
    planted = source + "\n\ndef _f():\n    from megatron_taco.recipes.finetune import SPEC\n"
    (tmp_path / "finetune_eval.py").write_text(planted, encoding="utf-8")
    monkeypatch.setattr(f"{__name__}.RECIPES", tmp_path)
    assert "finetune" in recipe_imports("finetune_eval")


def test_the_check_sees_a_cycle_through_any_module(tmp_path, monkeypatch):
    """A cycle not through the three named modules (registry -> finetune -> registry) fails
    the check too: the cycle search itself is exercised on real sources."""
    for path in RECIPES.glob("*.py"):
        (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    with open(tmp_path / "registry.py", "a", encoding="utf-8") as f:
        f.write("\n\ndef _f():\n    from megatron_taco.recipes.finetune import SPEC\n")
    monkeypatch.setattr(f"{__name__}.RECIPES", tmp_path)
    with pytest.raises(AssertionError, match="import cycle in recipes/: .*registry"):
        test_recipes_import_one_way()

"""preprocessing/ is layered bottom up, in the order docs/architecture.md lists its modules:
each imports only modules listed above it, so reading (records -> corpora) never depends on
the pipeline built on it. Every import counts, also those inside functions."""

from __future__ import annotations

from pathlib import Path

import megatron_taco.preprocessing as preprocessing
from tests.helpers import imported_modules

PREPROCESSING = Path(preprocessing.__file__).parent
PACKAGE = "megatron_taco.preprocessing"
ORDER = (
    # reading the corpora
    *("records", "streams", "text", "jsonl", "readers", "inputs", "corpora"),
    # the pipeline
    *("config", "encode", "shards", "workers", "staging", "report", "preprocess", "merge"),
)


def upward_imports(root: Path = PREPROCESSING) -> list[str]:
    out = []
    for i, name in enumerate(ORDER):
        modules = imported_modules(root / f"{name}.py", PACKAGE)
        found = {
            m[len(PACKAGE) + 1 :].split(".")[0] for m in modules if m.startswith(f"{PACKAGE}.")
        }
        out += [f"{name} imports {m}" for m in sorted(found - set(ORDER[:i]))]
    return out


def test_preprocessing_modules_import_only_those_below():
    modules = {p.stem for p in PREPROCESSING.glob("*.py")} - {"__init__"}
    assert modules == set(ORDER), "a new module needs its place in ORDER (and the docs)"
    assert upward_imports() == []


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    for path in PREPROCESSING.glob("*.py"):
        (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    with open(tmp_path / "corpora.py", "a", encoding="utf-8") as f:
        f.write("\n\ndef _f():\n    from megatron_taco.preprocessing.encode import Skips\n")
    assert upward_imports(tmp_path) == ["corpora imports encode"]

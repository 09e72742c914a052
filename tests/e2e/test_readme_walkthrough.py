"""README's walkthrough, run as a new user would copy it: every block marked
`<!-- walkthrough -->` in order, on a fresh copy of the repository's tracked files (no data/,
no build/, no earlier outputs), with the venv's `python` first on PATH and every output under
$WORK. A command that fails fails the test (bash -e -o pipefail), so the README cannot drift
from the tools' flags. Every other shell or python block of the README must say why it is not
run (`<!-- not run: ... -->`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

MARKED = re.compile(r"<!-- (walkthrough|not run: [^>]*) -->\n```(bash|python)\n(.*?)```", re.S)
BLOCK = re.compile(r"```(bash|python)\n(.*?)```", re.S)


def readme_blocks(text: str) -> list[tuple[str, str, str]]:
    """(marker, language, code) of every bash/python block, in order; an unmarked block
    fails here, so a command added to the README is either run or says why not."""
    marked = [(m.group(1), m.group(2), m.group(3)) for m in MARKED.finditer(text)]
    every = [(m.group(1), m.group(2)) for m in BLOCK.finditer(text)]
    assert [(lang, code) for _, lang, code in marked] == every, (
        "README.md: every ```bash/```python block needs `<!-- walkthrough -->` or "
        "`<!-- not run: why -->` on the line before it"
    )
    return marked


def test_every_readme_block_is_run_or_says_why():
    blocks = readme_blocks((REPO / "README.md").read_text())
    run = [code for marker, _, code in blocks if marker == "walkthrough"]
    assert len(run) >= 9
    # The path the issue asks for, in this order.
    steps = ["train_tokenizer.py", "preprocess_data.py", "pretrain_", "learning", r"sentence\tlabel",
             "finetune.py", "glue_score.py", "export_hf.py", "pipeline("]  # fmt: skip
    text = "\n".join(run).replace("WARNING: iteration", "learning")
    positions = [text.find(s) for s in steps]
    assert -1 not in positions and positions == sorted(positions), dict(zip(steps, positions))
    # Then the same path for SAS and SAS^DA, with the recipe for short runs.
    sas = text[positions[-1] + 1 :]
    for s in ("--cold-start mlm", "pretrain_sas.py", "--disentangled-attention", "finetune.py",
              "export_hf.py", "pipeline("):  # fmt: skip
        assert s in sas, s
    # Only the two commands CI itself runs and the downloads that need the network are not run.
    skipped = [marker for marker, _, _ in blocks if marker != "walkthrough"]
    assert len(skipped) == 2 and any("network" in m for m in skipped), skipped


def fresh_copy(dest: Path) -> Path:
    """The tracked files of the working tree, as a fresh clone has them (uncommitted edits
    included, so the README under test is the one on disk)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the repository's git checkout to list its tracked files")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.mark.e2e
def test_readme_walkthrough_runs_on_a_fresh_copy(tmp_path):
    clone = fresh_copy(tmp_path / "clone")
    work = tmp_path / "work"
    env = {
        **os.environ,
        "WORK": str(work),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(clone),  # the copy's package, as `pip install -e .` there would
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    for number, (marker, language, code) in enumerate(
        readme_blocks((clone / "README.md").read_text())
    ):
        if marker != "walkthrough":
            continue
        command = (["bash", "-e", "-u", "-o", "pipefail", "-c", code] if language == "bash"
                   else [sys.executable, "-c", code])  # fmt: skip
        res = subprocess.run(command, cwd=clone, env=env, capture_output=True, text=True,
                             timeout=900)  # fmt: skip
        assert res.returncode == 0, (
            f"README walkthrough block {number} failed ({res.returncode}):\n{code}\n"
            f"--- stdout\n{res.stdout[-6000:]}\n--- stderr\n{res.stderr[-6000:]}"
        )
        if "grep -E" in code:  # step 5 shows the learning monitor's lines
            assert "valid at iteration" in res.stdout and "collapse_cosine" in res.stdout
        if "glue_score.py" in code:
            assert "| sst2 |" in res.stdout
        if language == "python":  # each served model labels both sentences with SST-2's names
            served = [line for line in res.stdout.splitlines() if "'label'" in line]
            assert served and all(
                "'label': 'positive'" in line and "'label': 'negative'" in line for line in served
            ), res.stdout
    for run, model in (("runs", "TACO"), ("runs_sas", "SAS"), ("runs_sas_da", "SAS")):
        results = json.loads((work / run / "sst2" / "results.json").read_text())
        assert results["finished"] and results["pretrained"]["model"] == model, run
    for folder, family in (("sst2_sas_hf", "electra"), ("sst2_sas_da_hf", "deberta-v2")):
        config = json.loads((work / folder / "config.json").read_text())
        assert config["model_type"] == family and config["id2label"] == {
            "0": "negative", "1": "positive"}  # fmt: skip
    # A fresh clone stays clean: every output went under $WORK.
    left = sorted(p.name for p in clone.iterdir() if not (REPO / p.name).exists())
    assert left == [], left

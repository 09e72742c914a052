"""benchmarks/ as a package: every benchmark listed with its goal, no sys.path edits, no
script reaching into another's private names, one way to write results, corpora built once
and reused, jobs run with their logs."""

from __future__ import annotations

import ast
import json
import os
import re
import sys

import numpy as np
import pytest

from benchmarks import run_all
from benchmarks.harness import corpora, jobs, results
from tests.helpers import REPO

BENCH = REPO / "benchmarks"
SOURCES = sorted(BENCH.rglob("*.py"))


def test_every_benchmark_is_listed_with_its_goal(capsys):
    scripts = {p.stem for p in BENCH.glob("bench_*.py")}
    assert [b.name for b in run_all.BENCHMARKS if b.name in scripts] == [
        b.name for b in run_all.BENCHMARKS
    ]
    assert {b.name for b in run_all.BENCHMARKS} == scripts
    assert all(b.what and b.goal for b in run_all.BENCHMARKS)
    assert run_all.main(["--list"]) == 0
    out = capsys.readouterr().out
    for b in run_all.BENCHMARKS:
        assert re.search(rf"^{b.name}\b", out, re.M), b.name
    # The ones that need inputs say how their table is made, and are not run.
    assert "python -m benchmarks.bench_sas_variants --corpus demo --vocab-size 1000" in out
    with pytest.raises(SystemExit) as stop:
        run_all.main(["--only", "sas_variants", "--out", "unused"])
    assert stop.value.code == 2
    assert "bench_sas_variants needs inputs; run: python -m" in capsys.readouterr().err


def test_no_sys_path_edits():
    for path in SOURCES:
        assert "sys.path" not in path.read_text(), f"{path.relative_to(REPO)} edits sys.path"
    for path in (REPO / "tests").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"sys\.path\.\w+\([^)]*benchmarks", text), path


def _benchmark_modules(tree: ast.Module) -> set[str]:
    """Local names bound to a module of the benchmarks package."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name.startswith("benchmarks.") and a.asname}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks"):
            names |= {a.asname or a.name for a in node.names if not a.name[0].isupper()}
    return names


def test_no_script_imports_anothers_private_names():
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        modules = _benchmark_modules(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.relative_to(REPO)} imports {private}"
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr.startswith("_")
            ):
                raise AssertionError(f"{path.relative_to(REPO)}: {node.value.id}.{node.attr}")


def test_results_are_written_one_way(tmp_path):
    path = tmp_path / "sub" / "r.json"
    rows = [
        results.Result("bench_x", "a / b", np.float32(1.5), 2, ">=", "x", "note"),
        results.Result("bench_x", "not measured", None),
    ]
    results.write_results(str(path), rows)
    results.write_results(None, rows)  # no --results-json: nothing written, no error
    back = results.read_results(str(path))
    assert back == [
        {
            "benchmark": "bench_x",
            "metric": "a / b",
            "value": 1.5,
            "goal": 2.0,
            "op": ">=",
            "unit": "x",
            "note": "note",
        },
        {
            "benchmark": "bench_x",
            "metric": "not measured",
            "value": None,
            "goal": None,
            "op": ">=",
            "unit": "x",
            "note": "",
        },
    ]
    assert [type(r["value"]) for r in back] == [float, type(None)]
    assert os.listdir(path.parent) == ["r.json"]  # the temporary file is gone
    assert [r.met() for r in rows] == [False, None]
    assert run_all.status(back[0]) == "MISSED by 25%"


def test_jobs_run_in_fresh_folders_with_their_logs(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the cores shared out
    stale = tmp_path / "ok" / "stale.txt"
    stale.parent.mkdir()
    stale.write_text("from an earlier run")
    code = "import os, sys; print('threads', os.environ['OMP_NUM_THREADS']); sys.exit({})"
    commands = [
        jobs.Command("ok", (sys.executable, "-c", code.format(0)), str(tmp_path / "ok")),
        jobs.Command("bad", (sys.executable, "-c", code.format(3)), str(tmp_path / "bad")),
        jobs.Command("third", (sys.executable, "-c", code.format(0)), str(tmp_path / "third")),
    ]
    assert jobs.run_parallel(commands, parallel=2) == {0: 0, 1: 3, 2: 0}
    assert not stale.exists()
    threads = max(1, (os.cpu_count() or 1) // 2)
    for name in ("ok", "bad", "third"):
        assert (tmp_path / name / "log.txt").read_text() == f"threads {threads}\n"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the caller's choice wins
    assert jobs.run_parallel(commands[:1], parallel=1) == {0: 0}
    assert (tmp_path / "ok" / "log.txt").read_text() == "threads 1\n"
    log = tmp_path / "run.log"
    assert jobs.run_logged([sys.executable, "-c", "print('to both')"], str(log)) == 0
    assert log.read_text() == "to both\n"


def test_setting_travels_to_the_peer_process_unchanged():
    from dataclasses import asdict

    from benchmarks.learning.setting import Setting, job_command

    s = Setting(
        prefix="p",
        tokenizer="t.model",
        cache="c",
        seq_length=32,
        batch=8,
        iters=4,
        lr=1e-3,
        warmup_fraction=0.1,
        eval_interval=2,
        eval_iters=1,
        split="90,5,5",
        seed=3,
        cold_start="mlm",
        layers=2,
        hidden=128,
    )
    argv = job_command("electra", s, "m.jsonl", "w", {})
    assert argv[1:4] == ["-m", "benchmarks.learning.peer_loop", "electra"]
    assert Setting(**json.loads(argv[4])) == s and argv[5] == "m.jsonl"
    assert job_command("electra", s, "m.jsonl", "w", {}, resume=True) == argv
    # A campaign's run cut short resumes from its own checkpoints (the driver refuses a
    # fresh run over them); a run not resumed loads nothing.
    ours = job_command("sas", s, "m.jsonl", "w", {})
    assert "--load" not in ours
    resumed = job_command("sas", s, "m.jsonl", "w", {}, resume=True)
    save = resumed[resumed.index("--save") + 1]
    assert save == os.path.join("w", "checkpoints") and resumed[resumed.index("--load") + 1] == save
    assert asdict(s.size()) == {
        "layers": 2,
        "hidden": 128,
        "heads": 2,
        "ffn": 512,
        "max_positions": 512,
    }


def test_a_corpus_is_built_once_then_reused(tmp_path, botchan_path):
    from megatron_taco.data.indexed_dataset import IndexedDataset
    from megatron_taco.data.tokenizer import Tokenizer

    paragraphs = [p for p in botchan_path.read_text().split("\n\n") if p.strip()]
    jsonl = tmp_path / "text.jsonl"
    jsonl.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    out = tmp_path / "demo"
    made = corpora.tokenize("demo", "test text", str(jsonl), str(out), 500, quiet=True)
    data = IndexedDataset(made.prefix)
    assert made.tokens == int(data.sizes.sum()) > 0 and made.sentences == len(data)
    assert Tokenizer(made.tokenizer).vocab_size == 500
    assert corpora.built(str(out)) == made
    before = os.stat(made.tokenizer).st_mtime_ns
    assert corpora.prepare("demo", str(out), 500) == made  # reused, nothing rebuilt
    assert os.stat(made.tokenizer).st_mtime_ns == before
    with pytest.raises(
        SystemExit,
        match="holds the demo corpus with a 500-piece tokenizer, "
        "not demo with 2000; give another --out",
    ):
        corpora.prepare("demo", str(out), 2000)
    os.remove(made.prefix + ".idx")  # an incomplete folder is not reused
    assert corpora.built(str(out)) is None


def test_a_run_cut_short_resumes_in_its_folder_under_reuse(tmp_path, monkeypatch):
    """run_jobs --reuse: a run that did not end is started again in its own folder with
    its checkpoints, store and metrics still there (the driver resumes from --load = its
    --save); without --reuse its folder is emptied first. Through run_parallel, with the
    driver replaced by a command that reports what it finds."""
    from benchmarks.learning import runs
    from benchmarks.learning.setting import Setting

    s = Setting(prefix="p", tokenizer="t", cache="c", seq_length=16, batch=4, iters=600,
                lr=1e-3, warmup_fraction=0.1, eval_interval=200, eval_iters=1,
                split="90,5,5", seed=1)  # fmt: skip
    work = tmp_path / "sas_s1"
    real = runs.job_command

    def reporting(model, s, metrics, workdir, flags, resume=False):
        argv = real(model, s, metrics, workdir, flags, resume)
        load = argv[argv.index("--load") + 1] if "--load" in argv else ""
        code = ("import os, sys; load, work = sys.argv[1:]; "
                "t = os.path.join(load, 'latest_checkpointed_iteration.txt'); "
                "sys.exit(0 if load and os.path.isfile(t) and "
                "os.path.isfile(os.path.join(work, 'store', 'shard')) else 3)")  # fmt: skip
        return [sys.executable, "-c", code, load, workdir]

    def cut_short():
        (work / "checkpoints").mkdir(parents=True, exist_ok=True)
        (work / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("400")
        (work / "store").mkdir(exist_ok=True)
        (work / "store" / "shard").write_bytes(b"x")
        (work / "metrics.jsonl").write_text(json.dumps({"split": "valid", "iteration": 400}))

    monkeypatch.setattr(runs, "job_command", reporting)
    cut_short()
    done = runs.run_jobs([runs.Job("sas", "sas", 1)], s, str(tmp_path), 1, reuse=True)
    assert ("sas", 1) in done and (work / "metrics.jsonl").is_file()
    assert (work / "log.txt").is_file()
    done = runs.run_jobs([runs.Job("sas", "sas", 1)], s, str(tmp_path), 1, reuse=False)
    assert done == {} and not (work / "checkpoints").exists()  # emptied: a fresh run

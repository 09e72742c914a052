"""tools/preprocess_data.py as a user runs it: a subprocess from the repository root,
including being killed in the middle of a run."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_taco.data.indexed_dataset import IndexedDataset

REPO = Path(__file__).resolve().parents[2]
CORPORA = REPO / "tests" / "fixtures" / "corpora"
BOTCHAN = REPO / "tests" / "fixtures" / "text" / "botchan_excerpt.txt"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def tool(*args: str) -> list[str]:
    return [sys.executable, "tools/preprocess_data.py", *args]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        tool(*args), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=180
    )


def final_names(directory: Path) -> set[str]:
    """Visible files: everything but the inputs and hidden temporaries."""
    return {
        p.name for p in directory.iterdir() if not p.name.startswith(".") and p.suffix != ".jsonl"
    }


def digests(directory: Path) -> dict[str, str]:
    return {
        n: hashlib.sha256((directory / n).read_bytes()).hexdigest() for n in final_names(directory)
    }


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def gone(pids: list[int], timeout: float) -> bool:
    """Whether all ``pids`` exit within ``timeout``; kills the survivors either way so a
    failing test leaks no process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
        if not alive:
            return True
        time.sleep(0.1)
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> Path:
    """~6 MB of JSON lines: with --split-sentences and one worker, several seconds of work."""
    rng = random.Random(7)
    lines = [ln for ln in BOTCHAN.read_text().splitlines() if ln.strip()]
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    with open(path, "w") as f:
        for _ in range(6000):
            f.write(json.dumps({"text": "\n".join(rng.choices(lines, k=8))}) + "\n")
    return path


def start_and_interrupt(
    tmp_path: Path, big_corpus: Path, tokenizer_model: str, sig: int, to_worker: bool = False
):
    """Start a run, wait until its workers are writing shards, send ``sig`` to the main
    process (or to a worker); returns (exit code, stderr, the pids of its worker processes)."""
    log = open(tmp_path / ".stderr.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        tool(
            "--input", str(big_corpus), "--output-prefix", str(tmp_path / "corpus"),
            "--tokenizer-model", tokenizer_model, "--split-sentences", "--workers", "1",
            # punkt: the slower splitter keeps the run going long enough to be interrupted
            "--chunk-size", "32", "--sentence-splitter", "punkt",
        ),
        cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=log,
    )  # fmt: skip
    shards = tmp_path / f".corpus.tmp-{proc.pid}" / "shards"
    deadline = time.monotonic() + 90
    while not (shards.is_dir() and any(p.stat().st_size > 0 for p in shards.iterdir())):
        assert proc.poll() is None, (tmp_path / ".stderr.log").read_text()
        assert time.monotonic() < deadline, "the run never started writing shards"
        time.sleep(0.05)
    workers = children(proc.pid)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    if to_worker:
        # the resource tracker is a child too; the worker is the one writing the shard
        worker = next(p for p in workers if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text())
        os.kill(worker, sig)
    else:
        proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    log.close()
    return rc, (tmp_path / ".stderr.log").read_text(), workers


def test_cli_end_to_end_and_megatron_core_reads_it(tmp_path):
    pytest.importorskip("megatron.core")
    # The tokenizer is trained by the sibling tool, as a user would.
    spm = subprocess.run(
        [sys.executable, "tools/train_tokenizer.py", "--input", str(BOTCHAN), "--model-prefix",
         str(tmp_path / "spm"), "--vocab-size", "800"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert spm.returncode == 0, spm.stderr
    model = str(tmp_path / "spm.model")
    res = cli(
        "--input", str(CORPORA / "jsonl" / "sonnets.jsonl.gz"), str(CORPORA / "wikipedia"),
        "--output-prefix", str(tmp_path / "mixed"), "--tokenizer-model", model,
        "--split-sentences", "--append-eod", "--workers", "2", "--chunk-size", "3",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "documents read" in res.stdout and "skipped: " in res.stdout
    assert "input (compressed bytes)" in res.stderr  # the progress bar says what it counts
    summary = json.loads((tmp_path / "mixed_summary.json").read_text())
    assert summary["documents_written"] > 10 and summary["skipped"]["redirect"] > 0

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as CoreDataset

    prefix = str(tmp_path / "mixed_text_sentence")
    ours, core = IndexedDataset(prefix), CoreDataset(prefix, mmap=True)
    assert len(core) == len(ours) == summary["sentences"]
    np.testing.assert_array_equal(core.document_indices, ours.document_indices)
    np.testing.assert_array_equal(core.sequence_lengths, ours.sizes)
    for i in range(len(ours)):
        np.testing.assert_array_equal(core[i], ours[i])


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--workers", "0"], "--workers: must be >= 1"),
        (["--input", "{missing}"], "--input: .*does_not_exist.jsonl does not exist"),
        (
            ["--tokenizer-model", "{missing}"],
            "--tokenizer-model: .*does_not_exist.jsonl does not exist",
        ),
        (
            ["--output-prefix", "/nonexistent_dir_xyz/out"],
            "--output-prefix: directory /nonexistent_dir_xyz",
        ),
        (
            ["--tokenizer-type", "BertWordPieceLowerCase"],
            "--tokenizer-model: not read by --tokenizer-type BertWordPieceLowerCase, which "
            "reads --vocab-file",
        ),
        (["--dataset-impl", "lazy"], "--dataset-impl: invalid choice"),
        (["--keep-newlines"], "--keep-newlines: not supported"),
    ],
)
def test_bad_arguments_name_the_flag(tmp_path, tokenizer_model, args, pattern):
    missing = str(tmp_path / "does_not_exist.jsonl")
    base = {
        "--input": str(CORPORA / "jsonl" / "sonnets.jsonl"),
        "--output-prefix": str(tmp_path / "out"),
        "--tokenizer-model": tokenizer_model,
    }
    flags = dict(zip(args[::2], args[1::2])) if len(args) % 2 == 0 else {}
    argv = []
    for k, v in {**base, **flags}.items():
        argv += [k, v.replace("{missing}", missing)]
    if len(args) % 2:
        argv += args
    res = cli(*argv)
    assert res.returncode == 2
    assert any(__import__("re").search(pattern, line) for line in res.stderr.splitlines()), (
        res.stderr
    )
    assert final_names(tmp_path) == set()


def test_sigkill_leaves_no_final_file_and_next_run_cleans_up(tmp_path, big_corpus, tokenizer_model):
    rc, _, workers = start_and_interrupt(tmp_path, big_corpus, tokenizer_model, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert final_names(tmp_path) == set()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]  # the stale temp
    # orphaned workers notice their parent is gone and exit on their own
    assert gone(workers, timeout=15)

    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "A short document. It has two sentences."}) + "\n")
    argv = ("--input", str(small), "--output-prefix", str(tmp_path / "corpus"),
            "--tokenizer-model", tokenizer_model, "--split-sentences")  # fmt: skip
    res = cli(*argv)
    assert res.returncode == 0, res.stderr
    assert "removed stale temporary files" in res.stderr
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    good = digests(tmp_path)
    assert set(good) == {
        "corpus_text_sentence.bin", "corpus_text_sentence.idx",
        "corpus_text_sentence_unigram.npy", "corpus_summary.json",
    }  # fmt: skip

    # SIGKILL runs no cleanup code at all: the good outputs (same names as the killed
    # run's) must still be untouched
    rc, _, workers = start_and_interrupt(tmp_path, big_corpus, tokenizer_model, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert digests(tmp_path) == good
    assert gone(workers, timeout=15)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_interrupt_cleans_up_and_keeps_previous_output(tmp_path, big_corpus, tokenizer_model, sig):
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "An earlier, good run. Its output must survive."}) + "\n")
    res = cli(
        "--input", str(small), "--output-prefix", str(tmp_path / "corpus"),
        "--tokenizer-model", tokenizer_model, "--split-sentences",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    before = digests(tmp_path)
    assert len(before) == 4

    rc, stderr, workers = start_and_interrupt(tmp_path, big_corpus, tokenizer_model, sig)
    assert rc == 128 + sig, stderr
    assert f"interrupted by {signal.Signals(sig).name}" in stderr
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # temp files removed
    assert digests(tmp_path) == before  # the old outputs, untouched
    assert gone(workers, timeout=5)


def test_crashed_worker_fails_the_run_cleanly(tmp_path, big_corpus, tokenizer_model):
    rc, stderr, workers = start_and_interrupt(
        tmp_path, big_corpus, tokenizer_model, signal.SIGKILL, to_worker=True
    )
    assert rc == 1, stderr
    assert "was killed by SIGKILL" in stderr and "no output was written" in stderr
    assert final_names(tmp_path) == set()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert gone(workers, timeout=5)

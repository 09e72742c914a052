"""Where the benchmarks read and write: the repository and build/'s caches."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(REPO, "build")
# Downloads and built corpora, reused by every later run (build/ is ignored by git).
BENCH_DATA = os.path.join(BUILD, "bench_data")
DOWNLOADS = os.path.join(BENCH_DATA, "downloads")
# Logs and results of the runs (run_all's default --out).
BENCH_OUT = os.path.join(BUILD, "bench")
BUNDLED_CORPUS = os.path.join(REPO, "examples", "corpus", "demo.jsonl.gz")

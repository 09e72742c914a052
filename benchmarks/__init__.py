"""The benchmarks: side-by-side ratios against named peers, each with its goal.

Run one as ``python -m benchmarks.bench_x --help`` from the repository root, all of them as
``make bench`` (``python -m benchmarks.run_all``; ``--list`` prints what each measures and
its goal). What the scripts share lives in ``benchmarks.harness`` (results, timing, corpora,
subprocess jobs) and ``benchmarks.learning`` (the learning comparisons' settings, peers,
runs and curves).
"""

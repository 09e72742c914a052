"""What the benchmark scripts share: ``paths`` (where things are), ``results`` (the one way a
results JSON is written and read), ``timing`` (step timing, MFU peak, peak memory),
``batches`` (the step benchmarks' synthetic batches), ``corpora`` (registry text and the
tokenized corpora, ``python -m benchmarks.harness.corpora``) and ``jobs`` (subprocesses
with logs, several at a time). paths, results, corpora and jobs import only the standard
library at the top: bench_preprocess's spawned workers import their script again, and what
they import is measured as the tool's start-up.
"""

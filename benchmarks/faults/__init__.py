"""The fault campaign's parts (benchmarks/bench_faults.py): plan (what a trial runs, from a
seed), jobs (commands and processes), inject (faults into a running job), shim (the
sitecustomize that injects at a byte or code point and plants bugs), compare (a trial against
its reference), verdict (outcomes), trial (one trial), report (the summary)."""

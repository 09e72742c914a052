"""The self-augmentation store against the reference's in-RAM buffer, side by side.

1. Overhead: per SAS-small micro-batch, the store's work (write the sampled rows of the
   batch's instances + read the rows of the next epoch's batch) as a share of a SAS-small
   training step (forward, backward, AdamW), beside the same work on an in-RAM
   [N, seq_len] int16 buffer (the reference implementation). Target: store < 2% of a step.
   The sampling draw itself is SAS's, not the store's; it is reported separately.
2. Memory: peak RSS of a process that creates a generation of N instances, writes every row,
   commits it and reads every row back, against one that fills and reads the reference's
   [N, seq_len] int16 buffer, for growing N. Target: the store's RSS flat in N (it grows
   by at most FLAT_MIB from the smallest to the largest N; the buffer's grows by
   N x seq_len x 2 bytes).

    python -m benchmarks.bench_sas_store [--results-json PATH]
    python -m benchmarks.bench_sas_store --micro-batch 64 --sizes 100000 1000000 4000000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import torch

from benchmarks.harness.paths import REPO
from benchmarks.harness.timing import time_steps

SEQ, VOCAB, MASK_PROB = 128, 30522, 0.15
FLAT_MIB = 32.0
WIDTH = math.ceil(MASK_PROB * (SEQ - 2))


def _rss_child(kind: str, n: int, root: str) -> dict:
    """Runs in a subprocess: the peak RSS of one kind of buffer holding n instances."""
    from megatron_taco.data.replacement_store import (
        GenerationReader,
        GenerationWriter,
        StoreLayout,
        commit_generation,
    )

    def hwm_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))

    before = hwm_kib()
    rng = np.random.default_rng(0)
    chunk = 4096
    if kind == "store":
        layout = StoreLayout(num_instances=n, width=WIDTH, vocab_size=VOCAB, num_shards=8)
        with GenerationWriter(root, 0, layout, range(8)) as writer:
            for start in range(0, n, chunk):
                ids = np.arange(start, min(start + chunk, n))
                writer.write(ids, rng.integers(5, VOCAB, (ids.size, WIDTH)))
            writer.flush()
        commit_generation(root, 0, layout)
        reader = GenerationReader(root, 0, verify=False)
        for start in range(0, n, chunk):
            reader.read(np.arange(start, min(start + chunk, n)))
    else:  # the reference: one [N, seq_len] int16 buffer per rank, -100 = empty
        buffer = np.full((n, SEQ), -100, dtype=np.int16)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            buffer[start:stop, :WIDTH] = rng.integers(5, VOCAB, (stop - start, WIDTH))
        for start in range(0, n, chunk):
            buffer[start : start + chunk].copy()
    return {"kind": kind, "n": n, "peak_rss_mib": (hwm_kib() - before) / 1024}


def memory_table(sizes: list[int]) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    print(f"\npeak RSS growth per rank (MiB) vs instances (seq {SEQ}, {WIDTH} slots)")
    print(f"  {'instances':>10s} {'store':>10s} {'in-RAM buffer':>14s}")
    for n in sizes:
        row = {}
        for kind in ("store", "buffer"):
            with tempfile.TemporaryDirectory() as root:
                res = subprocess.run(
                    [sys.executable, "-m", "benchmarks.bench_sas_store", "--child", kind, str(n), root],
                    cwd=REPO,
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                row[kind] = json.loads(res.stdout.splitlines()[-1])["peak_rss_mib"]
        print(f"  {n:>10,d} {row['store']:>10.1f} {row['buffer']:>14.1f}")
        rows[n] = row
    return rows


def overhead(micro_batch: int, repeats: int) -> dict[str, float]:
    from megatron_taco.data.replacement_store import (
        GenerationReader,
        GenerationWriter,
        StoreLayout,
        commit_generation,
    )
    from megatron_taco.models.sas.config import SasConfig
    from megatron_taco.models.sas.model import SasForPretraining
    from megatron_taco.parallel.sampling import vocab_parallel_sample
    from megatron_taco.parallel.state import single_process_state

    torch.manual_seed(0)
    model = SasForPretraining(SasConfig.preset("small", vocab_size=VOCAB), single_process_state())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (micro_batch, SEQ), generator=g)
    pick = torch.zeros(micro_batch, SEQ, dtype=torch.bool)
    pick[:, 1 : 1 + WIDTH] = True
    batch = dict(
        input_ids=ids, attention_mask=torch.ones_like(pick),
        mlm_labels=torch.where(pick, ids, torch.full_like(ids, -100)),
        rtd_labels=torch.zeros_like(ids),
    )  # fmt: skip
    holder = {}

    def step():
        out = model(batch)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        holder["logits"] = out["mlm_logits"]

    n = 100_000
    instances = np.random.default_rng(1).choice(n, micro_batch, replace=False)
    rows = np.random.default_rng(2).integers(5, VOCAB, (micro_batch, WIDTH))
    buffer = np.full((n, SEQ), -100, dtype=np.int16)
    times: dict[str, list[float]] = {k: [] for k in ("step", "draw", "store", "buffer")}
    with tempfile.TemporaryDirectory() as root:
        layout = StoreLayout(num_instances=n, width=WIDTH, vocab_size=VOCAB, num_shards=8)
        writer = GenerationWriter(root, 0, layout, range(8))
        writer.write(np.arange(n), np.full((n, WIDTH), 7))
        writer.flush()
        commit_generation(root, 0, layout)
        reader = GenerationReader(root, 0, verify=False)
        writer = GenerationWriter(root, 1, layout, range(8))

        def store_io():
            writer.write(instances, rows)
            for i in instances:  # the collator reads one row per sample
                reader.read(np.asarray([i]))

        def buffer_io():
            buffer[instances, :WIDTH] = rows
            for i in instances:
                buffer[i].copy()

        def draw():
            vocab_parallel_sample(
                holder["logits"], None, vocab_size=VOCAB,
                row_keys=torch.arange(holder["logits"].shape[0]), seed=1,
            )  # fmt: skip

        step()
        for _ in range(repeats):
            times["step"].append(time_steps(step, 1, "cpu"))
            times["draw"].append(time_steps(draw, 1, "cpu"))
            times["store"].append(time_steps(store_io, 5, "cpu"))
            times["buffer"].append(time_steps(buffer_io, 5, "cpu"))
        writer.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"SAS-small micro-batch {micro_batch} x seq {SEQ} (CPU), median of {repeats}:")
    print(f"  training step                 {1000 * med['step']:9.2f} ms")
    for key, name in (("store", "store write + read"), ("buffer", "in-RAM buffer (reference)"),
                      ("draw", "sampling draw (SAS)")):  # fmt: skip
        print(
            f"  {name:29s} {1000 * med[key]:9.2f} ms  = {100 * med[key] / med['step']:.2f}% of a step"
        )
    print(f"store overhead: {100 * med['store'] / med['step']:.2f}% of a step (target < 2%)")
    return med


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_rss_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
        return
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_sas_store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 3_000_000])
    parser.add_argument("--results-json", help="also write the results there (harness/results.py)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    med = overhead(args.micro_batch, args.repeats)
    rss = memory_table(args.sizes)
    from benchmarks.harness.results import Result, write_results

    lo, hi = min(rss), max(rss)
    growth = rss[hi]["store"] - rss[lo]["store"]
    write_results(
        args.results_json,
        [
            Result("bench_sas_store", "store work / SAS-small step", 100 * med["store"] / med["step"],
                   2.0, "<=", "%", f"micro-batch {args.micro_batch}; in-RAM buffer "
                   f"{100 * med['buffer'] / med['step']:.2f}%"),
            Result("bench_sas_store", f"store RSS growth {lo:,} -> {hi:,} instances", growth,
                   FLAT_MIB, "<=", "MiB", f"in-RAM buffer grows {rss[hi]['buffer'] - rss[lo]['buffer']:.0f} MiB"),
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()

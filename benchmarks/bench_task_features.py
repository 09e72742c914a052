"""How fast does load_task build MNLI-sized GLUE features?

    python -m benchmarks.bench_task_features [--pairs 400000] [--seq-length 128]
        [--tokenizer-model M] [--repeat 2] [--results-json PATH]

Writes a synthetic MNLI train.tsv (the GLUE distribution's 12 columns) of --pairs sentence
pairs with MNLI's shape (each premise paired with three hypotheses) from the words of the
Botchan excerpt of tests/fixtures, plus a small dev_matched and dev_mismatched, and times,
alternately (A B A B ..., median of --repeat each):

(a) megatron_taco.tasks.load_task("mnli", ...): reading, batched sentencepiece encoding of
    each distinct sentence once, the vectorised longest-first truncation and assembly into
    [N, s] arrays;
(b) the named peer, Megatron-LM's tasks/glue featurisation (tasks/data_utils.py
    build_tokens_types_paddings_from_ids), the per-example Python loop most fine-tuning
    scripts use: split the line, encode each sentence, truncate in a while loop, pad, collect;
    with the same tokenizer and reading, so the ratio is about featurisation.

Prints both times and (b)/(a), in wall and in CPU seconds (all threads: sentencepiece
encodes a batch on several, so on a shared machine the CPU ratio is the steadier one). The default tokenizer is the tests' 800-piece model trained
on the same excerpt; with a 30k vocabulary both sides encode fewer, longer pieces.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import numpy as np

from benchmarks.harness.paths import REPO
from benchmarks.harness.results import Result, write_results
from megatron_taco.data.tokenizer import Tokenizer
from megatron_taco.tasks import load_task

BOTCHAN = os.path.join(REPO, "tests", "fixtures", "text", "botchan_excerpt.txt")
HEADER = [
    *("index", "promptID", "pairID", "genre", "sentence1_binary_parse"),
    *("sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"),
    *("label1", "gold_label"),
]
LABELS = ("entailment", "neutral", "contradiction")


def write_mnli(folder: str, pairs: int, seed: int = 0) -> None:
    """MNLI's shape: each premise (10-35 words) with three hypotheses (5-15 words), one per
    label; words drawn from the excerpt so that sentences are distinct."""
    with open(BOTCHAN, encoding="utf-8") as f:
        words = f.read().split()
    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    dev_header = [*HEADER[:-1], "label2", "label3", "label4", "label5", "gold_label"]
    for name, n, header in (
        ("train", pairs, HEADER),
        ("dev_matched", 2000, dev_header),
        ("dev_mismatched", 2000, dev_header),
    ):
        extra = len(header) - 11
        with open(os.path.join(folder, f"{name}.tsv"), "w", encoding="utf-8") as f:
            f.write("\t".join(header) + "\n")
            for i in range(n):
                if i % 3 == 0:
                    a = " ".join(rng.choices(words, k=rng.randint(10, 35)))
                b = " ".join(rng.choices(words, k=rng.randint(5, 15)))
                label = LABELS[i % 3]
                cols = [str(i), "1", f"{i}e", "fiction", "( x )", "( y )", "(ROOT)", "(ROOT)", a, b]
                f.write("\t".join(cols + [label] * extra + [label]) + "\n")


def peer(folder: str, tokenizer: Tokenizer, seq_length: int):
    """Megatron-LM tasks/glue style: one example at a time."""
    out = {}
    for split in ("train", "dev_matched", "dev_mismatched"):
        ids_list, pad_list, labels = [], [], []
        with open(os.path.join(folder, f"{split}.tsv"), encoding="utf-8") as f:
            next(f)
            for line in f:
                row = line.rstrip("\n").split("\t")
                a, b = tokenizer.encode(row[8]), tokenizer.encode(row[9])
                while len(a) + len(b) > seq_length - 3:
                    if len(a) > len(b):
                        a.pop()
                    else:
                        b.pop()
                ids = [tokenizer.cls_id, *a, tokenizer.sep_id, *b, tokenizer.sep_id]
                pad = seq_length - len(ids)
                ids_list.append(ids + [tokenizer.pad_id] * pad)
                pad_list.append([1] * len(ids) + [0] * pad)
                labels.append(LABELS.index(row[-1]))
        out[split] = (np.array(ids_list, dtype=np.int64), np.array(pad_list), np.array(labels))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_task_features", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pairs", type=int, default=400_000)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--tokenizer-model", default=None)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--results-json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.tokenizer_model
        if model is None:
            from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer

            model = train_tokenizer(
                TrainTokenizerConfig(
                    input=(BOTCHAN,),
                    model_prefix=os.path.join(tmp, "spm"),
                    vocab_size=800,
                    num_threads=1,
                )
            )
        tokenizer = Tokenizer(model)
        folder = os.path.join(tmp, "MNLI")
        t = time.perf_counter()
        write_mnli(folder, args.pairs)
        size = os.path.getsize(os.path.join(folder, "train.tsv")) / 2**20
        print(
            f"synthetic MNLI: {args.pairs} train pairs, {size:.0f} MB ({time.perf_counter() - t:.1f}s to write)"
        )
        ours, theirs, ours_cpu, theirs_cpu = [], [], [], []
        for _ in range(args.repeat):
            t, c = time.perf_counter(), time.process_time()
            data = load_task("mnli", folder, tokenizer, seq_length=args.seq_length)
            ours.append(time.perf_counter() - t)
            ours_cpu.append(time.process_time() - c)
            t, c = time.perf_counter(), time.process_time()
            ref = peer(folder, tokenizer, args.seq_length)
            theirs.append(time.perf_counter() - t)
            theirs_cpu.append(time.process_time() - c)
            # same features: a benchmark of different work would mean nothing
            np.testing.assert_array_equal(data.train.input_ids, ref["train"][0])
            np.testing.assert_array_equal(data.train.targets["labels"], ref["train"][2])
            del ref
        a, b = statistics.median(ours), statistics.median(theirs)
        print(
            f"load_task(mnli): {a:.1f}s (runs {', '.join(f'{x:.1f}' for x in ours)}); stats: "
            f"truncated {data.stats['truncated']['train']}, {data.train.input_ids.nbytes / 2**20:.0f} MB of ids"
        )
        print(
            f"Megatron-style per-example loop: {b:.1f}s (runs {', '.join(f'{x:.1f}' for x in theirs)})"
        )
        ca, cb = statistics.median(ours_cpu), statistics.median(theirs_cpu)
        print(
            f"speed-up: {b / a:.2f}x wall; CPU seconds (all threads) {ca:.1f} vs {cb:.1f}: {cb / ca:.2f}x"
        )
    if args.results_json:
        note = f"{args.pairs} pairs, seq {args.seq_length}: wall {a:.1f}s vs {b:.1f}s, CPU {ca:.1f}s vs {cb:.1f}s"
        write_results(
            args.results_json,
            [
                Result(
                    "bench_task_features.py",
                    "mnli_features_cpu_speedup_vs_megatron_loop",
                    cb / ca,
                    2.0,
                    ">=",
                    "x",
                    note,
                ),
                Result(
                    "bench_task_features.py",
                    "mnli_features_wall_speedup_vs_megatron_loop",
                    b / a,
                    None,
                    ">=",
                    "x",
                    note + " (wall: noisy on a shared machine)",
                ),
            ],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

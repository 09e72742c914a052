"""What takes SAS off the plateau: the paper's recipe, the reference release's cold starts,
the named departures and their useful pairs, beside transformers' ELECTRA and BERT, on the
same batches, optimizer and schedule (bench_learning's runs, benchmarks/learning/; the
variants are listed in benchmarks/learning/variants.py).

    python -m benchmarks.bench_sas_variants --data-path demo_output/demo_text_sentence \\
        --tokenizer-model demo_output/tokenizer.model --split 90,5,5 --iters 600
    python -m benchmarks.bench_sas_variants ... --variants paper mlm mlm_lambda_small electra
    python -m benchmarks.bench_sas_variants --corpus wiki --iters 600   # on Wikipedia leads
    python -m benchmarks.bench_sas_variants --corpus wiki --variants taco bert --equal-flops

The same campaign judges TACO against BERT (the TACO paper's claim): ``taco`` is our TACO at
TACO-small's widths, ``bert`` transformers' BERT at --layers x --hidden on the MLM rows of
the same TACO batches; with --equal-flops BERT trains for TACO's FLOPs at --iters.

Per variant, at the end of the run: the tokens after which held-out MLM accuracy first
reaches --left-plateau (1.5) x the most frequent target's share ("leaves the plateau"), the
final MLM accuracy and its ratio to that baseline, the collapse figure (mean pairwise cosine
of last-layer token vectors; 1 = one vector for everything) and RTD accuracy on replaced and
original tokens; and the training FLOPs per iteration (ELECTRA's convention,
megatron_taco/models/flops.py), with which SAS's and ELECTRA's curves are also compared at
equal FLOPs. Held-out MLM accuracy is each model's own: SAS at S under its cold start's
corruption (unigram replacements, or [MASK] for the release's mask/mlm cold starts), BERT
and ELECTRA's generator at [MASK]ed positions. A PNG of the curves goes to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics

from benchmarks.harness.corpora import CORPORA, prepare
from benchmarks.harness.paths import BENCH_OUT
from benchmarks.harness.results import write_json
from benchmarks.learning.curves import (
    at_equal_flops,
    left_plateau,
    load_curves,
    mean,
    per_seed_curves,
)
from benchmarks.learning.runs import Job, run_jobs
from benchmarks.learning.setting import Setting
from benchmarks.learning.variants import (
    PEER_OF,
    PEERS,
    VARIANTS,
    flops_reference,
    train_flops_per_iteration,
)


def summarise(curves: dict, tokens: int, factor: float) -> dict:
    out = {}
    for name, points in curves.items():
        end = points[max(points)]
        left = left_plateau(points, factor)
        acc, base = mean(end, "mlm_acc"), mean(end, "mlm_baseline_acc")
        seeds = per_seed_curves(points)
        exits = {k: left_plateau(curve, factor) for k, curve in seeds.items()}
        ratios = [r["mlm_acc"] / r["mlm_baseline_acc"] for r in end if r.get("mlm_baseline_acc")]
        out[name] = {
            "seeds": len(seeds),
            "left_plateau_tokens_by_seed": {
                str(k): None if it is None else it * tokens for k, it in exits.items()
            },
            "ratio_by_seed": ratios,
            "collapse_by_seed": [r["collapse_cosine"] for r in end if "collapse_cosine" in r],
            "left_plateau_tokens": None if left is None else left * tokens,
            "mlm_acc": acc,
            "baseline": base,
            "ratio": acc / base if acc is not None and base else None,
            "collapse": mean(end, "collapse_cosine"),
            "rtd_replaced": mean(end, "rtd_acc_replaced"),
            "rtd_original": mean(end, "rtd_acc_original"),
            "tokens": max(points) * tokens,
        }
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def report(curves: dict, variants: dict, s: Setting, args, vocab: int) -> dict:
    """``variants``: curve name -> (its variant's entry of VARIANTS, its lr)."""
    tokens = s.batch * s.seq_length
    table = summarise(curves, tokens, args.left_plateau)
    flops = {n: train_flops_per_iteration(variants[n][0][0], s, vocab) for n in curves}
    print(f"\n{s.layers} layers x {s.hidden}, batch {s.batch} x seq {s.seq_length}, "
          f"{s.iters} iterations ({flops_reference(m[0][0] for m in variants.values())}'s), lr {' '.join(sorted({f'{v[1]:g}' for v in variants.values()}))}; "
          f"'left' = first evaluation at >= "
          f"{args.left_plateau:g}x the baseline (of the mean over seeds; 'k/n': seeds whose "
          "own curve left); MLM figures mean over seeds, x base ± std")  # fmt: skip
    print(f"{'variant':<28} {'seeds left':>10} {'left at':>10} {'MLM %':>6} "
          f"{'x base':>12} {'collapse':>8} {'RTD repl':>8} {'RTD orig':>8} {'GFLOP/it':>9}  what")  # fmt: skip
    for name, row in table.items():
        exits = row["left_plateau_tokens_by_seed"].values()
        ratio = row["ratio"]
        ratio_cell = "-" if ratio is None else f"{ratio:.2f} ± {_std(row['ratio_by_seed']):.2f}"
        print(f"{name:<28} {sum(e is not None for e in exits):>6}/{len(exits):<3} "
              f"{_fmt(row['left_plateau_tokens'], ',.0f'):>10} "
              f"{_fmt(row['mlm_acc'] and 100 * row['mlm_acc'], '.2f'):>6} "
              f"{ratio_cell:>12} {_fmt(row['collapse'], '.3f'):>8} "
              f"{_fmt(row['rtd_replaced'], '.3f'):>8} {_fmt(row['rtd_original'], '.3f'):>8} "
              f"{flops[name] / 1e9:>9.2f}  {variants[name][0][3]}")  # fmt: skip
        row["train_flops_per_iteration"] = flops[name]
        row["variant"], row["lr"] = variants[name][0][0], variants[name][1]
    for peer in PEERS:
        compare_at_peer_flops(curves, variants, flops, table, peer)
    taco_vs_bert(curves, variants, flops, table, tokens)
    plot(curves, table, flops, tokens, os.path.join(args.out, "sas_variants.png"))
    return table


def most_seeds(curves: dict, variants: dict, model: str) -> str | None:
    """``model``'s curve with the most seeds (with --select-lr: its chosen learning rate;
    else its first)."""
    names = [n for n in curves if variants[n][0][0] == model]
    return max(names, key=lambda n: len(per_seed_curves(curves[n])), default=None)


def compare_at_peer_flops(curves: dict, variants: dict, flops: dict, table: dict, peer: str):
    """Held-out MLM accuracy of each of our variants whose peer is ``peer`` (PEER_OF), at
    the peer's last training FLOPs that both reached (the peer's most_seeds curve)."""
    ref_name = most_seeds(curves, variants, peer)
    if ref_name is None:
        return
    ref = curves[ref_name]
    print(f"\nheld-out MLM accuracy at {peer}'s training FLOPs ({ref_name})")
    for name in curves:
        if PEER_OF.get(variants[name][0][0]) != peer:
            continue
        budgets = [it * flops[ref_name] for it in sorted(ref)]
        pairs = [(b, at_equal_flops(curves[name], flops[name], b)) for b in budgets]
        pairs = [(b, a) for b, a in pairs if a is not None]
        if pairs:
            b, a = pairs[-1]
            e = at_equal_flops(ref, flops[ref_name], b)
            print(f"  {name:<24} at {b:.3g} FLOPs: {100 * a:.2f}% vs {peer} {100 * e:.2f}%")
            table[name]["vs_peer_equal_flops"] = {"peer": ref_name, "flops": b,
                                                  "mlm_acc": a, "peer_mlm_acc": e}  # fmt: skip


def taco_vs_bert(curves: dict, variants: dict, flops: dict, table: dict, tokens: int) -> None:
    """TACO against BERT at equal FLOPs at each of TACO's evaluations, seed by seed
    (bench_learning's comparison), on each model's most_seeds curve."""
    from benchmarks.learning.report import taco_vs_bert_at_equal_flops

    taco, bert = most_seeds(curves, variants, "taco"), most_seeds(curves, variants, "bert")
    if taco is None or bert is None:
        return
    print(f"\n{taco} against {bert}:", end="")
    results = taco_vs_bert_at_equal_flops(
        {"taco": curves[taco], "bert": curves[bert]},
        {"taco": flops[taco], "bert": flops[bert]},
        tokens,
    )
    table[taco]["vs_bert_equal_flops"] = [
        {"metric": r.metric, "value": r.value, "note": r.note} for r in results
    ]


def plot(curves: dict, table: dict, flops: dict, tokens: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 5))
    for k, (name, points) in enumerate(curves.items()):
        its = sorted(points)
        style = dict(marker="o", markersize=3, color=f"C{k % 10}",
                     linestyle="-" if k < 10 else "--")  # fmt: skip
        ratio = [mean(points[i], "mlm_acc") / mean(points[i], "mlm_baseline_acc")
                 for i in its]  # fmt: skip
        axes[0].plot([i * tokens for i in its], ratio, label=name, **style)
        axes[1].plot(
            [i * tokens for i in its],
            [mean(points[i], "collapse_cosine") for i in its],
            label=name,
            **style,
        )
        rtd = [mean(points[i], "rtd_acc_replaced") for i in its]
        if any(r is not None for r in rtd):
            axes[2].plot([i * tokens for i in its], rtd, label=name, **style)
        axes[3].plot(
            [i * flops[name] for i in its],
            [mean(points[i], "mlm_acc") for i in its],
            label=name,
            **style,
        )
    axes[0].axhline(1.5, color="k", linestyle=":", label="1.5x (left the plateau)")
    axes[0].set(title="held-out MLM accuracy / most frequent token's share",
                xlabel="training tokens")  # fmt: skip
    axes[1].set(title="collapse_cosine (1 = collapsed)", xlabel="training tokens", ylim=(0, 1.02))
    axes[2].set(title="held-out RTD accuracy on replaced tokens", xlabel="training tokens")
    axes[3].set(title="held-out MLM accuracy by training FLOPs (ELECTRA's convention)",
                xlabel="training FLOPs", xscale="log")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # an empty panel (no RTD model) has none
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\ncurves: {path}")


def run_selected(jobs: list[Job], s: Setting, args, variants: dict, variant_of: dict) -> dict:
    """--select-lr: the grid at the first seed, each variant's lr chosen on the validation
    documents (benchmarks/learning/campaign.py), the other seeds at that lr only.
    ``variant_of``: a run's curve name (VARIANT_lrLR) -> its VARIANT."""
    from benchmarks.learning.campaign import Run, choose_lr, selection_part
    from megatron_taco.data.tokenizer import load_tokenizer

    done = run_jobs([j for j in jobs if j.seed == args.seed], s, args.out, args.jobs,
                    reuse=args.reuse)  # fmt: skip
    tok = load_tokenizer(args.tokenizer_model)
    dev = selection_part(args.data_path, tok, args.split, s.seq_length)
    rest = []
    for variant in dict.fromkeys(variant_of[j.name] for j in jobs):
        runs = [Run(variant, variants[j.name][1], j.seed, os.path.join(args.out, f"{j.name}_s{j.seed}"))
                for j in jobs if variant_of[j.name] == variant and (j.name, j.seed) in done]  # fmt: skip
        if not runs:
            continue
        chosen, _ = choose_lr(runs, dev, s, tok)
        print(f"{variant}: lr {chosen:g} chosen on the validation documents", flush=True)
        rest += [j for j in jobs if variant_of[j.name] == variant and j.seed != args.seed
                 and j.lr == chosen]  # fmt: skip
    done.update(run_jobs(rest, s, args.out, args.jobs, reuse=args.reuse))
    return done


def campaign_jobs(args, s: Setting, vocab: int, existing: dict) -> tuple[list, dict, dict]:
    """(jobs, {curve name: (its VARIANTS entry, lr)}, {curve name: its variant}): every
    variant of --variants not given by --with, at each lr of the grid, for --seeds seeds;
    with --equal-flops each for the reference's (flops_reference) FLOPs at --iters."""
    lrs = args.lrs or [args.lr]
    variants = {name: (VARIANTS[name], args.lr) for name in existing}
    variant_of = {}  # a run's curve name -> its variant
    ref = flops_reference(VARIANTS[v][0] for v in [*args.variants, *existing])
    jobs = []
    for name in args.variants:
        if name in existing:
            continue
        model, cold, flags, _ = VARIANTS[name]
        iters = args.iters
        if args.equal_flops:  # the reference's FLOPs at --iters, in this variant's iterations
            budget = args.iters * train_flops_per_iteration(ref, s, vocab)
            iters = max(1, round(budget / train_flops_per_iteration(model, s, vocab)))
        flags = tuple(f.replace("{warmup}", str(iters // 2)) for f in flags)
        for lr in lrs:
            run = f"{name}_lr{lr:g}" if args.lrs else name
            variants[run] = (VARIANTS[name], lr)
            variant_of[run] = name
            jobs += [Job(run, model, args.seed + k, cold, flags, lr=lr, iters=iters)
                     for k in range(args.seeds)]  # fmt: skip
    return jobs, variants, variant_of


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_sas_variants", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--variants",
        nargs="*",
        default=[v for v in VARIANTS if v != "taco"],
        choices=list(VARIANTS),
        help="Variants to run (none: only report the --with ones); default: SAS's and the "
        "peers (TACO against BERT is its own campaign: --variants taco bert).",
    )
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data-path", help="A dataset prefix (give its --tokenizer-model).")
    data.add_argument(
        "--corpus",
        choices=list(CORPORA),
        help="A corpus of benchmarks/harness/corpora.py instead, built in build/corpora (or "
        "reused) with a --vocab-size tokenizer trained on it; --split defaults to 90,5,5.",
    )
    p.add_argument("--tokenizer-model")
    p.add_argument("--vocab-size", type=int, default=2000, help="--corpus's tokenizer pieces.")
    p.add_argument("--data-cache-path")
    p.add_argument("--split", help="Default 949,50,1 (--data-path), 90,5,5 (--corpus).")
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-fraction", type=float, default=0.1,
                   help="Linear warm-up over this share of each run, then linear decay to 0.")  # fmt: skip
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=1234, help="The first seed.")
    p.add_argument("--seeds", type=int, default=1,
                   help="Seeds per variant (--seed, --seed + 1, ...): curves are their means, "
                   "the table gives the spread and how many seeds left the plateau.")  # fmt: skip
    p.add_argument("--lrs", type=float, nargs="+", metavar="LR",
                   help="A learning-rate grid instead of --lr: every variant at each (curves "
                   "VARIANT_lrLR); bench_sas_downstream --runs picks each variant's on a "
                   "held-out split.")  # fmt: skip
    p.add_argument("--equal-flops", action="store_true",
                   help="Each variant trains for the training FLOPs of SAS at --iters "
                   "(TACO's where taco is in --variants; ELECTRA's convention): its own "
                   "--iters, schedule and warm-up scaled to that budget (ELECTRA, with its "
                   "generator, runs fewer iterations).")  # fmt: skip
    p.add_argument("--select-lr", action="store_true",
                   help="With --lrs and --seeds > 1: run the grid at --seed only, pick each "
                   "variant's lr on the validation documents (bench_sas_downstream --runs' "
                   "choice: the frozen probe), then the other seeds at that lr only.")  # fmt: skip
    p.add_argument("--reuse", action="store_true",
                   help="Keep the runs in --out that ended (same names and seeds) instead of "
                   "running them again: a campaign resumes where it stopped.")  # fmt: skip
    p.add_argument(
        "--with",
        dest="existing",
        nargs="*",
        default=[],
        metavar="VARIANT=METRICS",
        help="A variant's metrics.jsonl from an earlier run of the same setting.",
    )
    add_output_flags(p, "sas_variants", "Write the summary here.")
    return p


def add_output_flags(p: argparse.ArgumentParser, name: str, json_help: str) -> None:
    """The flags every learning campaign shares (bench_sas_variants, bench_sas_factors):
    the plateau bar, runs at a time, where the runs and the summary go."""
    p.add_argument("--left-plateau", type=float, default=1.5)
    p.add_argument("--jobs", type=int, default=2, help="Runs at a time (one core each).")
    p.add_argument("--out", default=os.path.join(BENCH_OUT, name))
    p.add_argument("--json", help=json_help)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    if not 0 <= args.warmup_fraction < 1:
        p.error(f"--warmup-fraction must be in [0, 1), got {args.warmup_fraction}")
    if args.lrs is not None and (not args.lrs or any(not lr > 0 for lr in args.lrs)):
        p.error(f"--lrs must be one or more values > 0, got {args.lrs}")
    if args.select_lr and not (args.lrs and len(args.lrs) > 1 and args.seeds > 1):
        p.error("--select-lr needs a grid (--lrs with two or more values) and --seeds > 1")
    existing = {}
    for item in args.existing:
        name, sep, path = item.partition("=")
        if not sep or name not in VARIANTS or not os.path.isfile(path):
            p.error(f"--with {item}: expected VARIANT=METRICS with a variant of --variants' "
                    "choices and an existing metrics.jsonl")  # fmt: skip
        existing[name] = path
    if bool(args.data_path) != bool(args.tokenizer_model):
        p.error("--tokenizer-model goes with --data-path (a --corpus has its own)")
    models = {VARIANTS[v][0] for v in [*args.variants, *existing]}
    sas_models = {m for m, peer in PEER_OF.items() if peer == "electra"}
    if args.equal_flops and "taco" in models and models & sas_models:
        p.error("--equal-flops: --variants mixes TACO and SAS's variants, whose budgets "
                "differ (TACO's FLOPs or SAS's at --iters); run them as two campaigns")  # fmt: skip
    from megatron_taco.data.tokenizer import Tokenizer

    if args.corpus:
        corpus = prepare(args.corpus, vocab_size=args.vocab_size)
        args.data_path, args.tokenizer_model = corpus.prefix, corpus.tokenizer
        args.data_cache_path = args.data_cache_path or corpus.cache
        args.split = args.split or corpus.split
    s = Setting(prefix=args.data_path, tokenizer=args.tokenizer_model,
                   cache=args.data_cache_path or os.path.join(args.out, "cache"),
                   seq_length=args.seq_length, batch=args.batch, iters=args.iters, lr=args.lr,
                   warmup_fraction=args.warmup_fraction, eval_interval=args.eval_interval,
                   eval_iters=args.eval_iters, split=args.split or "949,50,1", seed=args.seed,
                   layers=args.layers, hidden=args.hidden)  # fmt: skip
    vocab = Tokenizer(args.tokenizer_model).vocab_size
    jobs, variants, variant_of = campaign_jobs(args, s, vocab, existing)
    os.makedirs(args.out, exist_ok=True)
    if args.select_lr:
        done = run_selected(jobs, s, args, variants, variant_of)
    else:
        done = run_jobs(jobs, s, args.out, args.jobs, reuse=args.reuse)
    done.update({(name, args.seed): path for name, path in existing.items()})
    curves = {name: points for name, points in load_curves(done).items()}
    order = [n for n in variants if n in curves]
    table = report({n: curves[n] for n in order}, variants, s, args, vocab)
    if args.json:
        write_json(args.json, table)
    return 0 if len(done) == len(jobs) + len(existing) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""What takes SAS off the plateau: the paper's recipe, the reference release's cold starts,
the named departures and their useful pairs, beside transformers' ELECTRA and BERT, on the
same batches, optimizer and schedule (benchmarks/bench_learning.py runs every one of them).

    python benchmarks/bench_sas_variants.py --data-path demo_output/demo_text_sentence \\
        --tokenizer-model demo_output/tokenizer.model --split 90,5,5 --iters 600
    python benchmarks/bench_sas_variants.py ... --variants paper mlm mlm_lambda_small electra

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
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_learning as bl  # noqa: E402

LAMBDA_SMALL = ("--rtd-weight", "1", "--rtd-weight-final", "4")  # the paper's x 0.02
LAMBDA_ZERO = ("--rtd-weight", "0", "--rtd-weight-final", "0")
GDES = ("--gradient-disentangled-embedding",)
MASK_SHARE = ("--stored-mask-share", "0.8")

# name -> (model, cold start, extra flags, what it is). "{warmup}" is half the run.
VARIANTS = {
    "paper": ("sas", "unigram", (), "the paper: unigram cold start, lambda 50 -> 200"),
    "uniform": ("sas", "uniform", (), "the paper's Table 4 alternative cold start"),
    "mask": ("sas", "mask", (), "release: [MASK] at S in epoch 1"),
    "mlm": ("sas", "mlm", (), "release: BERT's MLM in epoch 1, no RTD loss"),
    "gdes": ("sas", "unigram", GDES, "departure: RTD kept out of the word embedding"),
    "rtd_warmup": ("sas", "unigram", ("--rtd-weight-warmup-iters", "{warmup}"),
                   "departure: lambda 0 for the first half"),
    "rate30": ("sas", "unigram", ("--mask-prob", "0.3"), "departure: 30% replaced"),
    "lambda_small": ("sas", "unigram", LAMBDA_SMALL, "departure: lambda 1 -> 4"),
    "mask_share": ("sas", "unigram", MASK_SHARE, "departure: 80% of S [MASK] from epoch 2"),
    "mlm_gdes": ("sas", "mlm", GDES, "release mlm + GDES"),
    "mlm_warmup": ("sas", "mlm", ("--rtd-weight-warmup-iters", "{warmup}"),
                   "release mlm + lambda 0 for the first half"),
    "mlm_rate30": ("sas", "mlm", ("--mask-prob", "0.3"), "release mlm + 30% replaced"),
    "mlm_lambda_small": ("sas", "mlm", LAMBDA_SMALL, "release mlm + lambda 1 -> 4"),
    "mlm_lambda0": ("sas", "mlm", LAMBDA_ZERO, "release mlm + no RTD loss: MLM on own samples"),
    "mlm_mask_share": ("sas", "mlm", (*MASK_SHARE, *LAMBDA_SMALL),
                       "release mlm + 80% of S [MASK] later + lambda 1 -> 4"),
    "mlm_gdes_lambda_small": ("sas", "mlm", (*GDES, *LAMBDA_SMALL),
                              "release mlm + GDES + lambda 1 -> 4"),
    "bert_control": ("sas", "mlm", ("--stored-mask-share", "1", *LAMBDA_ZERO),
                     "control: every epoch [MASK] at S, no RTD (BERT in SAS's code)"),
    "sas_c": ("sas_c", "unigram", (), "SAS^c: the paper's recipe with a constant lambda 50"),
    "sas_da": ("sas_da", "unigram", (), "SAS^DA: the paper's recipe with DeBERTa's attention"),
    "sas_c_mlm_lambda_small": ("sas_c", "mlm", ("--rtd-weight", "1", "--rtd-weight-final", "1"),
                               "SAS^c: release mlm + constant lambda 1"),
    "sas_da_mlm_lambda_small": ("sas_da", "mlm", LAMBDA_SMALL,
                                "SAS^DA: release mlm + lambda 1 -> 4"),
    "electra": ("electra", "unigram", (), "transformers' ELECTRA (generator 1/4 wide)"),
    "bert": ("bert", "unigram", (), "transformers' BERT ([MASK] MLM)"),
}  # fmt: skip


def train_flops_per_iteration(model: str, s: bl.Setting, vocab: int) -> float:
    """ELECTRA's convention (tools/count_flops.py) for one iteration of ``s.batch`` rows."""
    from megatron_taco.models import flops

    size = s.size()
    shape = flops.EncoderShape(
        layers=size.layers, hidden=size.hidden, ffn=size.ffn, heads=size.heads,
        head_size=size.hidden // size.heads, embedding_size=size.hidden, vocab_size=vocab,
        seq_length=s.seq_length,
    )  # fmt: skip
    if model == "electra":
        import dataclasses

        disc = dataclasses.replace(shape, embedding_size=size.hidden // 2)
        return flops.electra_train_flops(disc, flops.generator_shape(disc), s.batch, 1)
    if model == "bert":
        return flops.bert_train_flops(shape, s.batch, 1)
    return flops.sas_train_flops(shape, s.batch, 1, disentangled_attention=model == "sas_da")


def summarise(curves: dict, tokens: int, factor: float) -> dict:
    out = {}
    for name, points in curves.items():
        end = points[max(points)]
        left = bl.left_plateau(points, factor)
        acc, base = bl._mean(end, "mlm_acc"), bl._mean(end, "mlm_baseline_acc")
        out[name] = {
            "left_plateau_tokens": None if left is None else left * tokens,
            "mlm_acc": acc,
            "baseline": base,
            "ratio": acc / base if acc is not None and base else None,
            "collapse": bl._mean(end, "collapse_cosine"),
            "rtd_replaced": bl._mean(end, "rtd_acc_replaced"),
            "rtd_original": bl._mean(end, "rtd_acc_original"),
            "tokens": max(points) * tokens,
        }
    return out


def at_equal_flops(curve: dict, per_iteration: float, budget: float) -> float | None:
    """MLM accuracy of ``curve`` after ``budget`` training FLOPs, linear between evaluations."""
    points = sorted((it * per_iteration, bl._mean(rs, "mlm_acc")) for it, rs in curve.items())
    for (f0, a0), (f1, a1) in zip(points, points[1:]):
        if f0 <= budget <= f1:
            return a0 + (a1 - a0) * (budget - f0) / (f1 - f0)
    return None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(curves: dict, variants: dict, s: bl.Setting, args, vocab: int) -> dict:
    tokens = s.batch * s.seq_length
    table = summarise(curves, tokens, args.left_plateau)
    flops = {n: train_flops_per_iteration(variants[n][0], s, vocab) for n in curves}
    print(f"\n{s.layers} layers x {s.hidden}, batch {s.batch} x seq {s.seq_length}, "
          f"{s.iters} iterations, lr {s.lr:g}; 'left' = first evaluation at >= "
          f"{args.left_plateau:g}x the baseline")  # fmt: skip
    print(f"{'variant':<24} {'left at':>10} {'MLM %':>6} {'x base':>6} {'collapse':>8} "
          f"{'RTD repl':>8} {'RTD orig':>8} {'GFLOP/it':>9}  what")  # fmt: skip
    for name, row in table.items():
        print(f"{name:<24} {_fmt(row['left_plateau_tokens'], ',.0f'):>10} "
              f"{_fmt(row['mlm_acc'] and 100 * row['mlm_acc'], '.2f'):>6} "
              f"{_fmt(row['ratio'], '.2f'):>6} {_fmt(row['collapse'], '.3f'):>8} "
              f"{_fmt(row['rtd_replaced'], '.3f'):>8} {_fmt(row['rtd_original'], '.3f'):>8} "
              f"{flops[name] / 1e9:>9.2f}  {variants[name][3]}")  # fmt: skip
        row["train_flops_per_iteration"] = flops[name]
    if "electra" in curves:
        print("\nheld-out MLM accuracy at ELECTRA's training FLOPs (SAS's MLM head vs ELECTRA's "
              "generator)")  # fmt: skip
        ref = curves["electra"]
        for name in curves:
            if name in ("electra", "bert"):
                continue
            budgets = [it * flops["electra"] for it in sorted(ref)]
            pairs = [(b, at_equal_flops(curves[name], flops[name], b)) for b in budgets]
            pairs = [(b, a) for b, a in pairs if a is not None]
            if pairs:
                b, a = pairs[-1]
                e = at_equal_flops(ref, flops["electra"], b)
                print(f"  {name:<24} at {b:.3g} FLOPs: {100 * a:.2f}% vs ELECTRA {100 * e:.2f}%")
                table[name]["vs_electra_equal_flops"] = {"flops": b, "mlm_acc": a, "electra": e}
    plot(curves, table, flops, tokens, os.path.join(args.out, "sas_variants.png"))
    return table


def plot(curves: dict, table: dict, flops: dict, tokens: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 5))
    for k, (name, points) in enumerate(curves.items()):
        its = sorted(points)
        style = dict(marker="o", markersize=3, color=f"C{k % 10}",
                     linestyle="-" if k < 10 else "--")  # fmt: skip
        ratio = [bl._mean(points[i], "mlm_acc") / bl._mean(points[i], "mlm_baseline_acc")
                 for i in its]  # fmt: skip
        axes[0].plot([i * tokens for i in its], ratio, label=name, **style)
        axes[1].plot(
            [i * tokens for i in its],
            [bl._mean(points[i], "collapse_cosine") for i in its],
            label=name,
            **style,
        )
        rtd = [bl._mean(points[i], "rtd_acc_replaced") for i in its]
        if any(r is not None for r in rtd):
            axes[2].plot([i * tokens for i in its], rtd, label=name, **style)
        axes[3].plot(
            [i * flops[name] for i in its],
            [bl._mean(points[i], "mlm_acc") for i in its],
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
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\ncurves: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_sas_variants.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--variants",
        nargs="*",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        help="Variants to run (none: only report the --with ones).",
    )
    p.add_argument("--data-path", required=True)
    p.add_argument("--tokenizer-model", required=True)
    p.add_argument("--data-cache-path")
    p.add_argument("--split", default="949,50,1")
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--left-plateau", type=float, default=1.5)
    p.add_argument("--jobs", type=int, default=2, help="Runs at a time (one core each).")
    p.add_argument(
        "--with",
        dest="existing",
        nargs="*",
        default=[],
        metavar="VARIANT=METRICS",
        help="A variant's metrics.jsonl from an earlier run of the same setting.",
    )
    p.add_argument("--out", default=os.path.join(bl.REPO, "build", "bench", "sas_variants"))
    p.add_argument("--json", help="Write the summary here.")
    args = p.parse_args(argv)
    existing = {}
    for item in args.existing:
        name, sep, path = item.partition("=")
        if not sep or name not in VARIANTS or not os.path.isfile(path):
            p.error(f"--with {item}: expected VARIANT=METRICS with a variant of --variants' "
                    "choices and an existing metrics.jsonl")  # fmt: skip
        existing[name] = path
    from megatron_taco.data.tokenizer import Tokenizer

    s = bl.Setting(prefix=args.data_path, tokenizer=args.tokenizer_model,
                   cache=args.data_cache_path or os.path.join(args.out, "cache"),
                   seq_length=args.seq_length, batch=args.batch, iters=args.iters, lr=args.lr,
                   warmup_fraction=0.1, eval_interval=args.eval_interval,
                   eval_iters=args.eval_iters, split=args.split, seed=args.seed,
                   layers=args.layers, hidden=args.hidden)  # fmt: skip
    variants = {name: VARIANTS[name] for name in [*args.variants, *existing]}
    jobs = []
    for name in args.variants:
        if name in existing:
            continue
        model, cold, flags, _ = VARIANTS[name]
        flags = tuple(f.replace("{warmup}", str(args.iters // 2)) for f in flags)
        jobs.append(bl.Job(name, model, args.seed, cold, flags))
    os.makedirs(args.out, exist_ok=True)
    done = bl.run_jobs(jobs, s, args.out, args.jobs)
    done.update({(name, args.seed): path for name, path in existing.items()})
    curves = {name: points for name, points in bl.load_curves(done).items()}
    order = [n for n in variants if n in curves]
    table = report({n: curves[n] for n in order}, variants, s, args,
                   Tokenizer(args.tokenizer_model).vocab_size)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0 if len(done) == len(jobs) + len(existing) else 1


if __name__ == "__main__":
    raise SystemExit(main())

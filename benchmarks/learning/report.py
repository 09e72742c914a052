"""bench_learning's report: the held-out MLM table by training tokens, the end figures, its
goals as results, and a PNG of the curves."""

from __future__ import annotations

import os
import statistics
import sys

from benchmarks.harness.results import Result
from benchmarks.learning.curves import (
    at_equal_flops,
    by_seed,
    family_baseline,
    left_plateau,
    mean,
    per_seed_curves,
    spread,
)
from benchmarks.learning.setting import MODELS, Setting, label, sas_like


def colour(name: str, names: list[str]) -> str:
    known = MODELS.index(name) if name in MODELS else len(MODELS) + names.index(name)
    return f"C{known % 10}"


def report(curves: dict, s: Setting, args, out_dir: str, flops: dict | None = None) -> list:
    """``flops``: each model's training FLOPs per iteration when the runs ended at equal
    FLOPs (bench_learning --equal-flops): TACO and BERT are then compared by FLOPs."""
    tokens = s.batch * s.seq_length
    models = [m for m in MODELS if m in curves] + [m for m in curves if m not in MODELS]
    iters = sorted({it for m in models for it in curves[m]})
    print(f"\nheld-out MLM accuracy (mean over seeds) by training tokens; batch {s.batch} x "
          f"seq {s.seq_length}, lr {s.lr:g}, warm-up {s.warmup_fraction:g} of {s.iters} "
          "iterations")  # fmt: skip
    print("(baseline: the most frequent target's share, of the [MASK]ed positions for TACO,")
    print(" BERT and ELECTRA, of SAS's replaced set S for the SAS models)")
    head = f"{'tokens':>10} {'base':>7} {'base S':>7} " + " ".join(f"{m:>8}" for m in models)
    print(head)
    for it in iters:
        base = [family_baseline(curves, models, it, sas) for sas in (False, True)]
        cells = [mean(curves[m].get(it, []), "mlm_acc") for m in models]
        print(f"{it * tokens:>10,} "
              + " ".join(f"{b:>7.4f}" if b is not None else f"{'-':>7}" for b in base) + " "
              + " ".join(f"{c:>8.4f}" if c is not None else f"{'-':>8}" for c in cells))  # fmt: skip
    print("\ncollapse_cosine (1 = one vector for every token) and RTD accuracy at the end")
    for m in models:
        last = curves[m][max(curves[m])]
        rtd = ""
        if mean(last, "rtd_acc_replaced") is not None:
            rtd = (f"  RTD replaced {mean(last, 'rtd_acc_replaced'):.3f} "
                   f"original {mean(last, 'rtd_acc_original'):.3f}")  # fmt: skip
        collapse = mean(last, "collapse_cosine")
        shown = "-" if collapse is None else f"{collapse:.4f}"
        print(f"  {m:>8}: collapse {shown}{rtd}  ({label(m)})")
    results = []
    if flops is not None and "taco" in curves and "bert" in curves:
        results += taco_vs_bert_at_equal_flops(curves, flops, tokens)
    elif "taco" in curves and "bert" in curves:
        common = [it for it in iters if it in curves["taco"] and it in curves["bert"]]
        ratios = [mean(curves["taco"][it], "mlm_acc") / max(mean(curves["bert"][it], "mlm_acc"),
                  1e-9) for it in common]  # fmt: skip
        worst = min(ratios) if ratios else None
        met = [it * tokens for it, r in zip(common, ratios) if r >= 1.0]
        since = next((it * tokens for it, r in zip(common, ratios)
                      if all(q >= 1.0 for q in ratios[common.index(it):])), None)  # fmt: skip
        results.append(Result("bench_learning", "taco_vs_bert_mlm_acc_worst_point", worst, 1.0,
                              ">=", "x", f"TACO / BERT held-out MLM accuracy, worst of "
                              f"{len(ratios)} points; at or above at {len(met)}, at every "
                              f"point from {since:,} tokens on" if since is not None else
                              f"TACO / BERT held-out MLM accuracy, worst of {len(ratios)} "
                              f"points; at or above at {len(met)}"))  # fmt: skip
    if "sas" in curves and "sas_ref" in curves:
        end = max(curves["sas"])
        for key in ("mlm_acc", "rtd_acc_replaced"):
            a, b = mean(curves["sas"][end], key), mean(curves["sas_ref"].get(end, []), key)
            noise = max(
                spread(curves["sas"][end], key) or 0,
                spread(curves["sas_ref"].get(end, []), key) or 0,
            )
            note = (
                f"seed spread {noise:.4f}"
                if noise
                else "one seed each: give --seeds 2 for the noise"
            )
            results.append(Result("bench_learning", f"sas_minus_ref_{key}", None if b is None else a - b,
                                   None, "<=", "abs", note))  # fmt: skip
    results += parity(curves, tokens)
    for m in ("sas", "electra"):
        if m in curves:
            it = left_plateau(curves[m], args.left_plateau)
            results.append(Result("bench_learning", f"{m}_left_plateau_tokens",
                                  None if it is None else float(it * tokens), None, "<=", "tokens",
                                  "not within the run" if it is None else f"iteration {it}"))  # fmt: skip
    print()
    for r in results:
        shown = "not measured" if r.value is None else f"{r.value:.4g} {r.unit}"
        goal = f" (goal {r.op} {r.goal:g})" if r.goal is not None else ""
        print(f"  {r.metric}: {shown}{goal}  {r.note}")
    plot(curves, models, s, os.path.join(out_dir, "learning_curves.png"))
    return results


def taco_vs_bert_at_equal_flops(curves: dict, flops: dict, tokens: int) -> list:
    """At each of TACO's evaluations, BERT's held-out MLM accuracy after the same training
    FLOPs (linear between its evaluations), seed by seed, with a paired t-test over the
    seeds at each (3 seeds or more); the worst ratio of the means and the end's."""
    from scipy import stats

    taco, bert = per_seed_curves(curves["taco"]), per_seed_curves(curves["bert"])
    seeds = sorted(set(taco) & set(bert))
    print(f"\nTACO vs BERT at equal training FLOPs (TACO {flops['taco'] / 1e9:.1f}, BERT "
          f"{flops['bert'] / 1e9:.1f} GFLOPs per iteration), held-out MLM accuracy %, "
          f"{len(seeds)} seeds")  # fmt: skip
    print(f"{'TFLOPs':>8} {'TACO tokens':>12} {'TACO':>14} {'BERT':>14} {'ratio':>6} "
          f"{'paired p':>8}")  # fmt: skip
    rows = []
    for it in sorted(curves["taco"]):
        budget = it * flops["taco"]
        t = [mean(taco[k].get(it, []), "mlm_acc") for k in seeds]
        b = [at_equal_flops(bert[k], flops["bert"], budget) for k in seeds]
        if None in t or None in b:
            continue
        rows.append((budget, it, t, b))
        p = stats.ttest_rel(t, b).pvalue if len(seeds) > 2 else float("nan")
        print(f"{budget / 1e12:>8.2f} {it * tokens:>12,} {_ms(t):>14} {_ms(b):>14} "
              f"{statistics.mean(t) / max(statistics.mean(b), 1e-9):>6.2f} {p:>8.3f}")  # fmt: skip
    if not rows:
        return []
    ratios = [statistics.mean(t) / max(statistics.mean(b), 1e-9) for _, _, t, b in rows]
    _, _, t, b = rows[-1]
    worst = min(range(len(rows)), key=lambda k: ratios[k])
    return [
        Result("bench_learning", "taco_vs_bert_equal_flops_worst_point", ratios[worst], 1.0,
               ">=", "x", f"at {rows[worst][0] / 1e12:.2f} TFLOPs, worst of {len(rows)}; "
               f"at or above at {sum(r >= 1.0 for r in ratios)}"),
        Result("bench_learning", "taco_vs_bert_equal_flops_end", ratios[-1], 1.0, ">=", "x",
               f"{_ms(t)} vs {_ms(b)} at {rows[-1][0] / 1e12:.2f} TFLOPs over {len(seeds)} "
               f"seeds, paired t-test p {p:.3f}"),
    ]  # fmt: skip


# (ours, reference): the parity comparison and its ablation arms (PARITY in setting.py).
PARITY_PAIRS = (
    ("sas_mlm", "bert_mlm"),
    ("sas_mlm_init02", "bert_mlm"),
    ("sas_mlm", "bert_mlm_scaled"),
    ("sas_mlm_init02", "bert_mlm_scaled"),
)


def _ms(values: list[float]) -> str:
    if len(values) < 2:
        return f"{100 * values[0]:.2f}" if values else "-"
    return f"{100 * statistics.mean(values):.2f} ± {100 * statistics.stdev(values):.2f}"


def parity(curves: dict, tokens: int) -> list:
    """Held-out MLM accuracy of each (ours, reference) pair at every evaluation, seed by
    seed (seed k of both read the same batches and masks): the difference of the means
    against the seed spread (the larger of the two models' max - min over seeds), and a
    paired t-test over the seeds (scipy) at each evaluation."""
    from scipy import stats

    results = []
    for a, b in PARITY_PAIRS:
        if a not in curves or b not in curves:
            continue
        common = [it for it in sorted(curves[a]) if it in curves[b]]
        print(f"\nparity: {a} vs {b}, held-out MLM accuracy % (mean ± std over seeds), "
              "difference of the means, seed spread (max - min, the larger), paired t-test")  # fmt: skip
        print(f"{'tokens':>10} {a:>16} {b:>16} {'diff':>7} {'spread':>7} {'p':>6}")
        outside, worst = 0, None
        for it in common:
            x, y = by_seed(curves[a][it], "mlm_acc"), by_seed(curves[b][it], "mlm_acc")
            seeds = sorted(set(x) & set(y))
            xs, ys = [x[k] for k in seeds], [y[k] for k in seeds]
            diff = statistics.mean(xs) - statistics.mean(ys)
            noise = max(max(xs) - min(xs), max(ys) - min(ys)) if len(seeds) > 1 else 0.0
            p = stats.ttest_rel(xs, ys).pvalue if len(seeds) > 2 else float("nan")
            outside += abs(diff) > noise
            if worst is None or abs(diff) - noise > abs(worst[0]) - worst[1]:
                worst = (diff, noise, it)
            print(f"{it * tokens:>10,} {_ms(xs):>16} {_ms(ys):>16} {100 * diff:>+7.2f} "
                  f"{100 * noise:>7.2f} {p:>6.3f}")  # fmt: skip
        diff, noise, it = worst
        results.append(Result("bench_learning", f"parity_{a}_vs_{b}_outside_seed_spread",
                              float(outside), 0.0, "<=", "evaluations",
                              f"of {len(common)}; largest excess at {it * tokens:,} tokens: "
                              f"{100 * diff:+.2f} points against a seed spread of "
                              f"{100 * noise:.2f}"))  # fmt: skip
    return results


def plot(curves: dict, models: list[str], s: Setting, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = s.batch * s.seq_length
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for m in models:
        its = sorted(curves[m])
        x = [it * tokens for it in its]
        style = dict(marker="o", color=colour(m, models))  # one colour per model
        axes[0].plot(x, [mean(curves[m][it], "mlm_acc") for it in its], label=label(m), **style)
        axes[1].plot(x, [mean(curves[m][it], "collapse_cosine") for it in its], label=m, **style)
        if sas_like(m) or m == "electra":
            axes[2].plot(x, [mean(curves[m][it], "rtd_acc_replaced") for it in its],
                         label=f"{m} replaced", **style)  # fmt: skip
    base_its = sorted({it for m in models for it in curves[m]})
    for sas, line, what in ((False, "k--", "[MASK]ed positions"), (True, "k:", "SAS's S")):
        base = [family_baseline(curves, models, it, sas) for it in base_its]
        if any(b is not None for b in base):
            axes[0].plot([it * tokens for it in base_its], base, line,
                         label=f"most frequent token ({what})")  # fmt: skip
    axes[0].set(title="held-out MLM accuracy", xlabel="training tokens")
    axes[1].set(title="collapse_cosine (1 = collapsed)", xlabel="training tokens", ylim=(0, 1.02))
    axes[2].set(title="RTD accuracy on replaced tokens", xlabel="training tokens")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # an empty panel (no RTD model) has none
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"curves: {path}", file=sys.stderr, flush=True)

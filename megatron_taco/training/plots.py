"""Loss curves (PNG) from the metrics JSON-lines file."""

from __future__ import annotations

import math
import os

from megatron_taco.training.logging import read_metrics

# Non-loss series worth a panel when a model logs them (SAS: lambda, hits, RTD accuracies).
_EXTRA_KEYS = ("rtd_weight", "replaced_share", "rtd_acc_replaced", "rtd_acc_original")


def _loss_keys(records: list[dict]) -> list[str]:
    keys = {
        k
        for r in records
        for k, v in r.items()
        if (k == "loss" or k.endswith("_loss")) and isinstance(v, (int, float))
    }
    extra = [k for k in _EXTRA_KEYS if any(isinstance(r.get(k), (int, float)) for r in records)]
    return sorted(keys, key=lambda k: (k != "loss", k)) + extra


_PRETRAIN_SPLITS = ("train", "valid", "test")
_NOT_PLOTTED = ("iteration", "epoch", "split")


def _eval_keys(records: list[dict]) -> list[str]:
    """Metrics of other evaluations (a fine-tuning run's dev splits: accuracy, F1, ...)."""
    return sorted(
        {
            k
            for r in records
            if r.get("split", "train") not in _PRETRAIN_SPLITS
            for k, v in r.items()
            if k not in _NOT_PLOTTED and isinstance(v, (int, float))
        }
    )


def _epoch_starts(records: list[dict]) -> list[int]:
    """Iterations after which a new epoch began (from the train records' "epoch")."""
    train = [r for r in records if r.get("split", "train") == "train" and "epoch" in r]
    return [b["iteration"] for a, b in zip(train, train[1:]) if b["epoch"] != a["epoch"]]


def plot_loss_curves(metrics_file: str, output: str | None = None) -> str | None:
    """Write train (and validation) loss curves; returns the PNG path, or None when the
    file holds no loss values."""
    records = read_metrics(metrics_file)
    keys = _loss_keys(records)
    eval_keys = [k for k in _eval_keys(records) if k not in keys]
    if not keys:
        return None
    keys += eval_keys
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    output = output or os.path.join(
        os.path.dirname(os.path.abspath(metrics_file)), "loss_curve.png"
    )
    # A grid of at most three panels per row, readable however many series a model logs.
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    boundaries = _epoch_starts(records)
    splits = [("train", "-"), ("valid", "o--")] + [
        (s, "o-")
        for s in sorted({r.get("split", "train") for r in records})
        if s not in _PRETRAIN_SPLITS
    ]
    for ax, key in zip(axes.flat, keys):
        for i, x in enumerate(boundaries):
            ax.axvline(x, color="grey", linestyle=":", label="epoch" if i == 0 else None)
        for split, style in splits:
            points = [
                (r["iteration"], r[key])
                for r in records
                if r.get("split", "train") == split
                and isinstance(r.get(key), (int, float))
                and math.isfinite(r[key])
            ]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, label=split, markersize=3)
        ax.set_title(key)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = output + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, output)
    return output

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


def _epoch_starts(records: list[dict]) -> list[int]:
    """Iterations after which a new epoch began (from the train records' "epoch")."""
    train = [r for r in records if r.get("split", "train") == "train" and "epoch" in r]
    return [b["iteration"] for a, b in zip(train, train[1:]) if b["epoch"] != a["epoch"]]


def plot_loss_curves(metrics_file: str, output: str | None = None) -> str | None:
    """Write train (and validation) loss curves; returns the PNG path, or None when the
    file holds no loss values."""
    records = read_metrics(metrics_file)
    keys = _loss_keys(records)
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    output = output or os.path.join(
        os.path.dirname(os.path.abspath(metrics_file)), "loss_curve.png"
    )
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    boundaries = _epoch_starts(records)
    for ax, key in zip(axes[0], keys):
        for i, x in enumerate(boundaries):
            ax.axvline(x, color="grey", linestyle=":", label="epoch" if i == 0 else None)
        for split, style in (("train", "-"), ("valid", "o--")):
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

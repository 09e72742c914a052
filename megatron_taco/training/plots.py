"""Loss curves (PNG) from the metrics JSON-lines file."""

from __future__ import annotations

import math
import os

from megatron_taco.training.logging import read_metrics


def _loss_keys(records: list[dict]) -> list[str]:
    keys = {
        k
        for r in records
        for k, v in r.items()
        if (k == "loss" or k.endswith("_loss")) and isinstance(v, (int, float))
    }
    return sorted(keys, key=lambda k: (k != "loss", k))


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
    for ax, key in zip(axes[0], keys):
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

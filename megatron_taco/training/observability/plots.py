"""Loss and learning curves (PNG) from the metrics JSON-lines file."""

from __future__ import annotations

import math
import os

from megatron_taco import io
from megatron_taco.training.observability.log import read_metrics
from megatron_taco.training.observability.monitor import BASELINE_SUFFIX as _BASELINE
from megatron_taco.training.observability.monitor import COLLAPSE

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


def _series(records: list[dict], split: str, key: str) -> tuple[list, list]:
    points = [
        (r["iteration"], r[key])
        for r in records
        if r.get("split", "train") == split
        and isinstance(r.get(key), (int, float))
        and math.isfinite(r[key])
    ]
    return ([x for x, _ in points], [y for _, y in points])


def _save_panels(
    panels: list[tuple[str, list[tuple[list, list, str, str]]]], boundaries: list[int], output: str
) -> str:
    """A grid of at most three panels per row (readable however many series a model logs):
    each panel a title and its (xs, ys, style, label) lines, the epoch boundaries dotted."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (title, lines) in zip(axes.flat, panels):
        for i, x in enumerate(boundaries):
            ax.axvline(x, color="grey", linestyle=":", label="epoch" if i == 0 else None)
        for xs, ys, style, label in lines:
            if xs:
                ax.plot(xs, ys, style, label=label, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with io.atomic_path(output) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return output


def _beside(metrics_file: str, name: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(metrics_file)), name)


def plot_loss_curves(metrics_file: str, output: str | None = None) -> str | None:
    """Write train (and validation) loss curves; returns the PNG path, or None when the
    file holds no loss values."""
    records = read_metrics(metrics_file)
    keys = _loss_keys(records)
    eval_keys = [k for k in _eval_keys(records) if k not in keys]
    if not keys:
        return None
    keys += eval_keys
    splits = [("train", "-"), ("valid", "o--")] + [
        (s, "o-")
        for s in sorted({r.get("split", "train") for r in records})
        if s not in _PRETRAIN_SPLITS
    ]
    panels = [
        (key, [(*_series(records, split, key), style, split) for split, style in splits])
        for key in keys
    ]
    return _save_panels(
        panels, _epoch_starts(records), output or _beside(metrics_file, "loss_curve.png")
    )


def plot_learning_curves(metrics_file: str, output: str | None = None) -> str | None:
    """Is it learning? The validation figures of training/observability/monitor.py: each head's accuracy
    beside its most-frequent-target baseline, and the collapse cosine. Returns the PNG path,
    or None when no evaluation recorded them."""
    records = read_metrics(metrics_file)
    valid = [r for r in records if r.get("split") == "valid"]
    heads = sorted({k[: -len(_BASELINE)] for r in valid for k in r if k.endswith(_BASELINE)})
    panels = [
        (
            f"{head}_acc",
            [
                (*_series(records, "valid", f"{head}_acc"), "o-", "valid"),
                (*_series(records, "valid", f"{head}{_BASELINE}"), "k--", "baseline"),
            ],
        )
        for head in heads
    ]
    if any(COLLAPSE in r for r in valid):
        panels.append((COLLAPSE, [(*_series(records, "valid", COLLAPSE), "o-", "valid")]))
    if not panels:
        return None
    return _save_panels(
        panels, _epoch_starts(records), output or _beside(metrics_file, "learning_curve.png")
    )

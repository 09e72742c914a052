"""Learning curves read back from the runs' metrics files: the held-out records by
iteration, their means over seeds, and when a curve leaves the plateau."""

from __future__ import annotations

from benchmarks.learning.setting import sas_like


def load_curves(done: dict) -> dict:
    from megatron_taco.training.observability.log import read_metrics

    curves: dict[str, dict[int, list[dict]]] = {}
    for (model, seed), path in done.items():
        for r in read_metrics(path):
            if r.get("split") == "valid":
                # The seed goes with the record: seed k of two models read the same batches
                # (a paired comparison).
                record = {**r, "seed": seed}
                curves.setdefault(model, {}).setdefault(int(r["iteration"]), []).append(record)
    return curves


def mean(records: list[dict], key: str) -> float | None:
    vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def spread(records: list[dict], key: str) -> float | None:
    vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return max(vals) - min(vals) if len(vals) > 1 else None


def family_baseline(curves, models, it, sas: bool) -> float | None:
    records = [r for m in models if sas_like(m) == sas for r in curves[m].get(it, [])]
    return mean(records, "mlm_baseline_acc")


def left_plateau(points: dict[int, list[dict]], factor: float) -> int | None:
    """First evaluated iteration at which MLM accuracy >= factor x the baseline."""
    for it in sorted(points):
        acc, base = mean(points[it], "mlm_acc"), mean(points[it], "mlm_baseline_acc")
        if acc is not None and base and acc >= factor * base:
            return it
    return None


def by_seed(records: list[dict], key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in records if isinstance(r.get(key), (int, float))}


def at_equal_flops(curve: dict, per_iteration: float, budget: float, key: str = "mlm_acc"):
    """``key`` of ``curve`` (mean over its records) after ``budget`` training FLOPs, linear
    between evaluations; the last evaluation's within one iteration past it (a run whose
    iterations were rounded to a FLOPs budget); None outside the curve."""
    points = sorted((it * per_iteration, mean(rs, key)) for it, rs in curve.items())
    for (f0, a0), (f1, a1) in zip(points, points[1:]):
        if f0 <= budget <= f1:
            return a0 + (a1 - a0) * (budget - f0) / (f1 - f0)
    if points and points[-1][0] <= budget <= points[-1][0] + per_iteration:
        return points[-1][1]
    return None


def per_seed_curves(points: dict) -> dict[int, dict]:
    """One curve per seed: {seed: {iteration: [its record]}}."""
    out: dict[int, dict] = {}
    for it, records in points.items():
        for r in records:
            out.setdefault(r.get("seed"), {})[it] = [r]
    return out

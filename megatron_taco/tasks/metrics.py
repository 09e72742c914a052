"""GLUE-style metrics in numpy (scaled to 0-100 like ELECTRA's scorers and the SQuAD scripts)
and the GLUE score.

Each function is the textbook definition; the tests check them against scikit-learn and
scipy, which stay test-only dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np


def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    return 100.0 * float(np.mean(np.asarray(pred) == np.asarray(gold))) if len(gold) else 0.0


def f1_binary(pred: np.ndarray, gold: np.ndarray, positive: int = 1) -> float:
    """F1 of the positive class (MRPC: equivalent, QQP: duplicate); 0 when it is never
    predicted nor present (scikit-learn's zero_division=0)."""
    pred, gold = np.asarray(pred) == positive, np.asarray(gold) == positive
    tp = int(np.sum(pred & gold))
    denom = int(pred.sum()) + int(gold.sum())
    return 100.0 * 2 * tp / denom if denom else 0.0


def matthews_corrcoef(pred: np.ndarray, gold: np.ndarray) -> float:
    """Multiclass MCC (Gorodkin's R_K, which is Matthews' for two classes): covariance of the
    one-hot label and prediction matrices over their standard deviations; 0 when either is
    constant."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    classes = np.union1d(pred, gold)
    p = np.searchsorted(classes, pred)
    g = np.searchsorted(classes, gold)
    k = len(classes)
    confusion = np.bincount(g * k + p, minlength=k * k).reshape(k, k).astype(np.float64)
    n = confusion.sum()
    t_sum, p_sum = confusion.sum(axis=1), confusion.sum(axis=0)
    cov_tp = np.trace(confusion) * n - t_sum @ p_sum
    cov_pp = n * n - p_sum @ p_sum
    cov_tt = n * n - t_sum @ t_sum
    if cov_pp == 0 or cov_tt == 0:
        return 0.0
    return 100.0 * float(cov_tp / math.sqrt(cov_tt * cov_pp))


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson's r; 0 when either side is constant (undefined there: an untrained regression
    head predicting one value must not win best-epoch selection with a NaN)."""
    x = np.asarray(x, dtype=np.float64) - np.mean(x)
    y = np.asarray(y, dtype=np.float64) - np.mean(y)
    denom = math.sqrt(float(x @ x) * float(y @ y))
    return 100.0 * float(x @ y) / denom if denom > 0 else 0.0


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing their average rank (scipy's method="average")."""
    x = np.asarray(x)
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    first = np.concatenate([[True], sorted_x[1:] != sorted_x[:-1]])
    group = np.cumsum(first) - 1  # tie group of each sorted position
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], len(x))  # exclusive
    avg = (starts + 1 + ends) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = avg[group]
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(rankdata(x), rankdata(y))


BASE_METRICS = {
    "acc": accuracy,
    "f1": f1_binary,
    "mcc": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}


def compute(names: tuple[str, ...], pred: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    """The named metrics; "a_b_mean" is the mean of metrics a and b (MRPC's f1_acc_mean)."""
    out = {n: BASE_METRICS[n](pred, gold) for n in names if n in BASE_METRICS}
    for n in names:
        if n.endswith("_mean"):
            a, b = n[: -len("_mean")].split("_")
            out[n] = (out[a] + out[b]) / 2
    return {n: out[n] for n in names}


# The GLUE score over the eight dev tasks (WNLI excluded, as BERT, ELECTRA and the SAS paper
# do). The two conventions differ in how a task with two numbers becomes one:
# - "sas": the SAS paper (its "Downstream Tasks" paragraph): STS-B the mean of Pearson and
#   Spearman, MNLI the mean of matched and mismatched accuracy, MRPC and QQP accuracy, CoLA MCC,
#   the rest accuracy.
# - "electra": google-research/electra's fine-tuning code: classification_tasks.py gives MRPC
#   and QQP the plain AccuracyScorer, STS the RegressionScorer whose README column is
#   "Spearman", CoLA the MCCScorer, and MNLI's "dev" split is read as dev_matched only
#   (get_examples: `if split == "dev": split += "_matched"`); the README's results table lists
#   the metrics as MCC, Acc, Acc, Spearman, Acc, Acc, Acc, Acc.
GLUE_SCORE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte")
_DEV_ACC = {task: [("dev", "acc")] for task in GLUE_SCORE_TASKS}  # the tasks not named below
_GLUE_SCORE_METRIC = {
    "sas": {
        **_DEV_ACC,
        "cola": [("dev", "mcc")],
        "stsb": [("dev", "pearson"), ("dev", "spearman")],
        "mnli": [("dev_matched", "acc"), ("dev_mismatched", "acc")],
    },
    "electra": {
        **_DEV_ACC,
        "cola": [("dev", "mcc")],
        "stsb": [("dev", "spearman")],
        "mnli": [("dev_matched", "acc")],
    },
}
GLUE_SCORE_CONVENTIONS = tuple(_GLUE_SCORE_METRIC)


def glue_task_scores(
    results: Mapping[str, Mapping[str, Mapping[str, float]]], convention: str = "sas"
) -> dict[str, float]:
    """Each GLUE-score task's one number. results: task -> dev split -> metrics (as
    TaskData.score returns them; extra tasks such as wnli are ignored)."""
    if convention not in _GLUE_SCORE_METRIC:
        raise ValueError(f"convention {convention!r} is not one of {GLUE_SCORE_CONVENTIONS}")
    scores: dict[str, float] = {}
    for task, parts in _GLUE_SCORE_METRIC[convention].items():
        if task not in results:
            continue
        values = []
        for split, metric in parts:
            try:
                values.append(float(results[task][split][metric]))
            except KeyError:
                raise ValueError(
                    f"GLUE score ({convention}): {task} needs {metric} of its {split} split, "
                    f"got {dict(results[task])}"
                ) from None
        scores[task] = sum(values) / len(values)
    return scores


def glue_score(
    results: Mapping[str, Mapping[str, Mapping[str, float]]], convention: str = "sas"
) -> float:
    """The GLUE score: the mean of glue_task_scores over all eight tasks (an average over
    fewer tasks is not a GLUE score: a missing task is an error)."""
    scores = glue_task_scores(results, convention)
    missing = [t for t in GLUE_SCORE_TASKS if t not in scores]
    if missing:
        raise ValueError(
            f"GLUE score needs all of {', '.join(GLUE_SCORE_TASKS)}; missing {', '.join(missing)}"
        )
    return sum(scores.values()) / len(scores)

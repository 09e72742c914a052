"""The task metrics against scikit-learn / scipy and hand-derived values; the GLUE score's two
conventions; the batched tokenisation, vectorised truncation and row assembly against plain
loops."""

import numpy as np
import pytest
import scipy.stats
from sklearn.metrics import f1_score
from sklearn.metrics import matthews_corrcoef as sk_mcc

from megatron_taco.tasks import glue_score, glue_task_scores
from megatron_taco.tasks.base import Segment, assemble, tokenize, truncate_pair
from megatron_taco.tasks.metrics import (
    accuracy,
    compute,
    f1_binary,
    matthews_corrcoef,
    pearson,
    rankdata,
    spearman,
)


def test_hand_derived_binary_metrics():
    gold = np.array([1, 1, 1, 0, 0, 0, 1, 0])
    pred = np.array([1, 1, 0, 0, 0, 1, 1, 1])
    # TP=3 (0,1,6), FN=1 (2), TN=2 (3,4), FP=2 (5,7)
    assert accuracy(pred, gold) == pytest.approx(100 * 5 / 8)
    # F1 = 2TP / (2TP + FP + FN) = 6 / 9
    assert f1_binary(pred, gold) == pytest.approx(100 * 6 / 9)
    # MCC = (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (6 - 2) / sqrt(5*4*4*3)
    assert matthews_corrcoef(pred, gold) == pytest.approx(100 * 4 / np.sqrt(240))
    # a constant prediction has MCC 0 (sklearn's convention), F1 0 when never positive
    assert matthews_corrcoef(np.zeros(8, int), gold) == 0.0
    assert f1_binary(np.zeros(8, int), gold) == 0.0


def test_hand_derived_correlations():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    y = np.array([2.0, 4.0, 5.0, 9.0])
    # centred x = (-1.5, -.5, .5, 1.5), y = (-3, -1, 0, 4): sum xy = 4.5 + .5 + 0 + 6 = 11,
    # sum x^2 = 5, sum y^2 = 26 -> r = 11 / sqrt(130)
    assert pearson(x, y) == pytest.approx(100 * 11 / np.sqrt(130))
    # monotone -> Spearman 1; ties share the average rank
    assert spearman(x, y) == pytest.approx(100.0)
    assert rankdata(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    assert pearson(np.ones(4), y) == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_metrics_match_sklearn_and_scipy(seed):
    rng = np.random.default_rng(seed)
    n = 200
    gold = rng.integers(0, 2, n)
    pred = np.where(rng.random(n) < 0.7, gold, 1 - gold)
    assert matthews_corrcoef(pred, gold) == pytest.approx(100 * sk_mcc(gold, pred), abs=1e-9)
    assert f1_binary(pred, gold) == pytest.approx(100 * f1_score(gold, pred), abs=1e-9)
    # three classes (MNLI-like) for the multiclass MCC
    gold3 = rng.integers(0, 3, n)
    pred3 = np.where(rng.random(n) < 0.5, gold3, rng.integers(0, 3, n))
    assert matthews_corrcoef(pred3, gold3) == pytest.approx(100 * sk_mcc(gold3, pred3), abs=1e-9)
    # STS-B-like scores on a 0.2 grid: many ties for Spearman
    score = np.round(rng.uniform(0, 5, n) * 5) / 5
    out = score + rng.normal(0, 1, n)
    assert pearson(out, score) == pytest.approx(100 * scipy.stats.pearsonr(score, out)[0])
    assert spearman(out, score) == pytest.approx(100 * scipy.stats.spearmanr(score, out)[0])
    assert spearman(np.round(out), score) == pytest.approx(
        100 * scipy.stats.spearmanr(score, np.round(out))[0]
    )


def test_compute_two_metric_means():
    gold = np.array([1, 1, 0, 0])
    pred = np.array([1, 0, 0, 0])
    out = compute(("f1", "acc", "f1_acc_mean"), pred, gold)
    # F1 = 2/3, accuracy 3/4
    assert out == pytest.approx({"f1": 200 / 3, "acc": 75.0, "f1_acc_mean": (200 / 3 + 75) / 2})
    assert list(out) == ["f1", "acc", "f1_acc_mean"]


def _glue_results():
    return {
        "cola": {"dev": {"mcc": 50.0}},
        "sst2": {"dev": {"acc": 90.0}},
        "mrpc": {"dev": {"f1": 88.0, "acc": 84.0, "f1_acc_mean": 86.0}},
        "stsb": {"dev": {"pearson": 86.0, "spearman": 85.0, "pearson_spearman_mean": 85.5}},
        "qqp": {"dev": {"f1": 86.0, "acc": 89.0, "f1_acc_mean": 87.5}},
        "mnli": {"dev_matched": {"acc": 80.0}, "dev_mismatched": {"acc": 81.0}},
        "qnli": {"dev": {"acc": 88.0}},
        "rte": {"dev": {"acc": 65.0}},
        "wnli": {"dev": {"acc": 10.0}},  # excluded: it must not move the score
    }


def test_glue_score_conventions():
    results = _glue_results()
    # SAS paper: STS-B (86+85)/2, MNLI (80+81)/2, MRPC/QQP accuracy
    sas = [50, 90, 84, 85.5, 89, 80.5, 88, 65]
    assert glue_task_scores(results)["stsb"] == 85.5
    assert glue_score(results) == pytest.approx(sum(sas) / 8)
    # ELECTRA: STS-B Spearman, MNLI matched only
    electra = [50, 90, 84, 85, 89, 80, 88, 65]
    assert glue_score(results, convention="electra") == pytest.approx(sum(electra) / 8)
    del results["rte"]
    with pytest.raises(ValueError, match="missing rte"):
        glue_score(results)
    results["mnli"] = {"dev_matched": {"acc": 80.0}}
    with pytest.raises(ValueError, match="mnli needs acc of its dev_mismatched"):
        glue_task_scores(results)


def _truncate_loop(la, lb, budget):
    while la + lb > budget:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return la, lb


def test_truncate_pair_is_longest_first():
    rng = np.random.default_rng(0)
    la = rng.integers(0, 40, 3000)
    lb = rng.integers(0, 40, 3000)
    for budget in (1, 5, 13, 30, 61, 100):
        a, b = truncate_pair(la, lb, budget)
        expect = np.array([_truncate_loop(x, y, budget) for x, y in zip(la, lb)])
        np.testing.assert_array_equal(a, expect[:, 0])
        np.testing.assert_array_equal(b, expect[:, 1])


class _Specials:
    pad_id, cls_id, sep_id = 0, 2, 3


def test_assemble_matches_row_by_row():
    rng = np.random.default_rng(1)
    flat_a = rng.integers(5, 100, 500).astype(np.int32)
    flat_b = rng.integers(5, 100, 500).astype(np.int32)
    n, s = 50, 24
    la, lb = rng.integers(0, 10, n), rng.integers(0, 10, n)
    sa, sb = rng.integers(0, 490, n), rng.integers(0, 490, n)
    ids, lengths = assemble(
        [Segment(flat_a, sa, la), Segment(flat_b, sb, lb)], s, _Specials, np.uint16, chunk=7
    )
    for r in range(n):
        row = [2, *flat_a[sa[r] : sa[r] + la[r]], 3, *flat_b[sb[r] : sb[r] + lb[r]], 3]
        assert lengths[r] == len(row)
        assert ids[r].tolist() == row + [0] * (s - len(row))


def test_tokenize_encodes_each_distinct_text_once(tokenizer):
    texts = ["the cat sat.", "", "a dog", "the cat sat.", "Café  crème", "a dog", "the cat sat."]
    calls = []

    class Counting:
        def encode_batch(self, batch):
            calls.append(list(batch))
            return tokenizer.encode_batch(batch)

    toks = tokenize(Counting(), texts, chunk=2)
    assert sorted(t for c in calls for t in c) == sorted(set(texts))
    for i, text in enumerate(texts):
        got = toks.flat[toks.start[i] : toks.start[i] + toks.length[i]].tolist()
        assert got == tokenizer.encode(text)

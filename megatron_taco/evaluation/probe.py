"""The frozen-feature probe: logistic regression on mean-pooled last-layer vectors, the
encoder's weights untouched (scikit-learn, imported when a probe is trained)."""

from __future__ import annotations

import numpy as np
import torch

from megatron_taco.evaluation.encoders import FrozenEncoder, pad_rows


@torch.no_grad()
def mean_pooled(enc: FrozenEncoder, rows: list[list[int]], pad: int, batch: int = 64):
    """float64 [len(rows), H]: each row's last-layer vectors averaged over its real tokens."""
    out = []
    for k in range(0, len(rows), batch):
        ids, mask, pos = pad_rows(rows[k : k + batch], pad)
        hidden = enc.hidden(ids, mask, pos)
        m = mask[..., None].to(hidden.dtype)
        out.append((hidden * m).sum(1) / m.sum(1))
    return torch.cat(out).double().numpy()


def probe(features_orig, features_shuf, size: int, seed: int) -> float:
    """Accuracy at telling the two forms apart: trained on ``size`` labelled sentences
    (each sentence in one form only, drawn by ``seed``), tested on the other half of the
    sentences in both forms. Features: [n, H], row i of both the same sentence."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(features_orig))
    half = len(order) // 2
    train_idx, test_idx = order[:half][:size], order[half:]
    form = rng.integers(0, 2, len(train_idx))  # 1 = original
    x = np.where(form[:, None] == 1, features_orig[train_idx], features_shuf[train_idx])
    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000, C=0.1))
    clf.fit(x, form)
    x_test = np.concatenate([features_orig[test_idx], features_shuf[test_idx]])
    y_test = np.concatenate([np.ones(len(test_idx)), np.zeros(len(test_idx))])
    return float(clf.score(x_test, y_test))

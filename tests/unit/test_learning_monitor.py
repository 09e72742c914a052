"""The learning monitor's figures (training/observability/monitor.py) against hand-computed values, its
warnings and its stop, and the eval-mode outputs TACO and SAS give it."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_taco.errors import ConfigError
from megatron_taco.models.common.monitoring import label_counts, monitoring_outputs
from megatron_taco.training.observability.monitor import (
    CollapseError,
    EvaluationStatistics,
    LearningMonitor,
    LearningMonitorConfig,
)
from tests.helpers import build, build_sas, make_batch, make_sas_batch, tiny_config, tiny_sas_config


def _brute_force_cosine(vectors: torch.Tensor, mask: torch.Tensor) -> float:
    real = vectors[mask].double()
    total, pairs = 0.0, 0
    for i, j in itertools.permutations(range(real.shape[0]), 2):
        total += float(torch.nn.functional.cosine_similarity(real[i], real[j], dim=0))
        pairs += 1
    return total / pairs


def _statistics(batches) -> dict[str, float]:
    stats = EvaluationStatistics()
    for vectors, mask, labels in batches:
        stats.add(monitoring_outputs(vectors, mask, mlm=(labels, 11)))
    return stats.reduce()


def test_collapse_cosine_is_the_mean_over_pairs_of_real_tokens_of_all_batches():
    g = torch.Generator().manual_seed(0)
    # A shared direction plus noise: pairwise cosines well away from 0 and 1.
    common = torch.randn(6, generator=g)
    batches, all_vectors, all_masks = [], [], []
    for lengths in ([5, 3], [2, 4]):
        vectors = common + 0.8 * torch.randn(2, 5, 6, generator=g)
        mask = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
        labels = torch.randint(0, 11, (2, 5), generator=g).masked_fill(~mask, -100)
        batches.append((vectors, mask, labels))
        all_vectors.append(vectors.flatten(0, 1))
        all_masks.append(mask.flatten())
    want = _brute_force_cosine(torch.cat(all_vectors), torch.cat(all_masks))
    got = _statistics(batches)["collapse_cosine"]
    assert 0.2 < want < 0.9
    assert got == pytest.approx(want, rel=1e-12)
    # Padding does not count: garbage at padded positions changes nothing.
    poisoned = [(v.masked_fill(~m[..., None], 1e6), m, lab) for v, m, lab in batches]
    assert _statistics(poisoned)["collapse_cosine"] == pytest.approx(want, rel=1e-12)


def test_one_vector_for_every_token_is_collapse_one_and_baseline_is_the_top_share():
    vectors = torch.tensor([0.3, -1.0, 2.0]).expand(3, 4, 3) * torch.rand(3, 4, 1) + 0.0
    mask = torch.ones(3, 4, dtype=torch.bool)
    labels = torch.tensor([[7, 7, -100, 2], [7, 1, -100, -100], [2, 7, 9, -100]])
    out = _statistics([(vectors, mask, labels)])
    assert out["collapse_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert out["mlm_baseline_acc"] == pytest.approx(4 / 8)  # token 7: 4 of 8 labels


def test_label_counts_match_bincount_and_ignore_padding():
    labels = torch.tensor([[3, -100, 3, 0], [9, 9, 9, -100]])
    counts = label_counts(labels, 10)
    assert counts.dtype == torch.int64
    assert counts.tolist() == torch.bincount(labels[labels >= 0], minlength=10).tolist()


def test_monitor_warns_on_collapse_and_plateau_after_warmup():
    lines = []
    monitor = LearningMonitor(LearningMonitorConfig(), warmup_iters=10, emit=lines.append)
    healthy = {"collapse_cosine": 0.3, "mlm_acc": 0.2, "mlm_baseline_acc": 0.06}
    plateau = {"collapse_cosine": 0.3, "mlm_acc": 0.06, "mlm_baseline_acc": 0.06}
    monitor.check(20, healthy)
    monitor.check(10, plateau)  # still in warm-up: at the baseline is expected
    assert lines == []
    monitor.check(20, plateau)
    assert len(lines) == 1 and "mlm_acc 0.0600 is still at the most-frequent" in lines[0]
    lines.clear()
    for it in (5, 6, 7):  # without --exit-on-collapse: a warning each time, nothing held
        monitor.check(it, {"collapse_cosine": 0.995})
        assert not monitor.holds_saves
    assert len(lines) == 3 and "collapsed" in lines[0] and "0.9950" in lines[0]


def test_no_collapse_figure_leaves_the_streak_and_says_once_that_nothing_is_watched():
    """A validation without vectors (a model that gives none, or one token in all) is no
    news: the streak stands, and with --exit-on-collapse one line says the encoder is not
    watched (the recovery line read the missing figure as a number and raised)."""
    lines = []
    monitor = LearningMonitor(LearningMonitorConfig(exit_on_collapse=True), 0, lines.append)
    monitor.check(10, {"collapse_cosine": 0.999})
    assert monitor.holds_saves
    lines.clear()
    monitor.check(20, {"mlm_acc": 0.5, "mlm_baseline_acc": 0.1})
    monitor.check(30, {})
    assert monitor.holds_saves and monitor.streak == 1
    assert len(lines) == 1 and "--exit-on-collapse: the validation gives no collapse" in lines[0]
    with pytest.raises(CollapseError, match="2 evaluations in a row since iteration 10"):
        monitor.check(40, {"collapse_cosine": 0.999})
    quiet = []
    LearningMonitor(LearningMonitorConfig(), 0, quiet.append).check(10, {})
    assert quiet == []  # without the flag, a model without vectors is simply not measured


def test_without_save_the_stop_says_nothing_was_kept():
    lines = []
    monitor = LearningMonitor(LearningMonitorConfig(exit_on_collapse=True), 0, lines.append,
                              saves=False)  # fmt: skip
    monitor.check(10, {"collapse_cosine": 0.999})
    assert "held back" not in lines[-1] and "stopping after 2 collapsed" in lines[-1]
    with pytest.raises(CollapseError, match="nothing is saved without --save"):
        monitor.check(20, {"collapse_cosine": 0.999})


def test_exit_on_collapse_holds_saves_and_stops_after_the_patience():
    lines = []
    stopper = LearningMonitor(
        LearningMonitorConfig(exit_on_collapse=True), warmup_iters=0, emit=lines.append
    )
    stopper.check(30, {"collapse_cosine": 0.3})
    assert not stopper.holds_saves
    stopper.check(40, {"collapse_cosine": 0.9999})  # 1 of 2: saves held, a warning
    assert stopper.holds_saves and "checkpoints held back" in lines[-1]
    stopper.check(50, {"collapse_cosine": 0.5})  # a transient collapse: saving again
    assert not stopper.holds_saves and "recovered" in lines[-1]
    stopper.check(60, {"collapse_cosine": 0.999})
    with pytest.raises(CollapseError, match=r"^iteration 70: the encoder has collapsed.*"
                       r"2 evaluations in a row since iteration 60;.*the last checkpoint before iteration 60 is "
                       r"kept"):  # fmt: skip
        stopper.check(70, {"collapse_cosine": 0.9995})
    ender = LearningMonitor(LearningMonitorConfig(exit_on_collapse=True), 0, lines.append)
    ender.check_end(80)  # not collapsed: nothing to say
    ender.check(80, {"collapse_cosine": 0.999})
    with pytest.raises(CollapseError, match=r"^iteration 80: training ended with the encoder"):
        ender.check_end(80)


@pytest.mark.parametrize(
    ("kw", "flag"),
    [(dict(collapse_threshold=0.0), "--collapse-threshold"),
     (dict(collapse_threshold=1.5), "--collapse-threshold"),
     (dict(plateau_margin=0.5), "--plateau-margin"),
     (dict(collapse_patience=0), "--collapse-patience")],
)  # fmt: skip
def test_bad_thresholds_name_their_flag(kw, flag):
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        LearningMonitorConfig(**kw)


def test_taco_and_sas_give_the_monitor_their_vectors_and_labels_in_eval_mode_only():
    taco = build(tiny_config(hidden_dropout=0.0, attention_dropout=0.0))
    batch = make_batch(b=3, s=16)
    assert "representation" not in taco(batch)  # training: nothing extra
    taco.eval()
    with torch.no_grad():
        out = taco(batch)
        h_we, h_pe = taco.taco(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    rows = batch["input_ids"].shape[0] // 2  # the MLM rows
    assert torch.equal(out["representation"], torch.cat([h_we, h_pe], -1)[:rows])
    assert torch.equal(out["representation_mask"], batch["attention_mask"][:rows].bool())
    mlm = batch["mlm_labels"]
    assert torch.equal(
        out["mlm_label_counts"], torch.bincount(mlm[mlm >= 0], minlength=taco.config.vocab_size)
    )
    mpm = batch["mpm_labels"]
    positions = taco.config.max_position_embeddings
    assert torch.equal(out["mpm_label_counts"], torch.bincount(mpm[mpm >= 0], minlength=positions))

    sas = build_sas(tiny_sas_config(hidden_dropout=0.0, attention_dropout=0.0))
    batch = make_sas_batch(b=3, s=16)
    assert "representation" not in sas(batch)
    sas.eval()
    with torch.no_grad():
        out = sas(batch)
        hidden = sas.sas(batch["input_ids"], batch["attention_mask"])
    assert torch.equal(out["representation"], hidden)
    mlm = batch["mlm_labels"]
    assert torch.equal(
        out["mlm_label_counts"], torch.bincount(mlm[mlm >= 0], minlength=sas.config.vocab_size)
    )

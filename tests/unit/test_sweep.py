"""The protocols' grids (recipes/sweep.py) and the score table: mean / median over seeds,
the best configuration, and the GLUE score, against values worked out by hand."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest

from megatron_taco.arguments import ConfigError
from megatron_taco.recipes.sweep import (
    GLUE_TASKS,
    RunSpec,
    SweepConfig,
    expand_tasks,
    plan_runs,
    run_namespace,
    summarize,
)


def _args(**kw) -> argparse.Namespace:
    base = dict(lr=1e-4, global_batch_size=None, micro_batch_size=8, train_epochs=3,
                epoch_selection="best", seed=10, data_dir="/data", output="/out",
                weight_decay=0.0)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_sas_protocol_follows_its_table_6():
    runs = plan_runs(SweepConfig(protocol="sas"), expand_tasks("glue"), _args(), "small")
    seeds = Counter(r.task for r in runs)
    # 2 learning rates x (5 seeds: CoLA, MRPC, STS-B, RTE; 3: QNLI, SST-2; 1: MNLI, QQP).
    assert seeds == {"cola": 10, "mrpc": 10, "stsb": 10, "rte": 10, "qnli": 6, "sst2": 6,
                     "mnli": 2, "qqp": 2}  # fmt: skip
    assert {r.lr for r in runs} == {1e-4, 7.5e-5}
    assert {(r.epochs, r.selection) for r in runs if r.task == "rte"} == {(20, "best")}
    assert {(r.epochs, r.selection) for r in runs if r.task == "mnli"} == {(4, "last")}
    assert {r.batch_size for r in runs} == {32} and {r.weight_decay for r in runs} == {0.0}
    base = plan_runs(SweepConfig(protocol="sas"), ["cola"], _args(), "base")
    assert {r.lr for r in base} == {7.5e-5, 5e-5}
    assert sorted({r.seed for r in base}) == [10, 11, 12, 13, 14]


def test_taco_protocol_follows_its_table_8():
    sweep = SweepConfig(protocol="taco")
    glue = plan_runs(sweep, ["rte"], _args(), "base")
    assert len(glue) == 2 * 4 * 4 * 5 and {r.weight_decay for r in glue} == {0.01}
    squad = plan_runs(sweep, ["squad_v2"], _args(), "base")
    assert {r.batch_size for r in squad} == {32} and {r.epochs for r in squad} == {2, 3, 4, 5}
    race = plan_runs(sweep, ["race"], _args(), "base")
    assert {(r.lr, r.batch_size, r.epochs, r.weight_decay) for r in race} == {(1e-5, 16, 6, 0.1)}
    assert len(race) == 5


def test_overrides_and_bad_tasks():
    sweep = SweepConfig(protocol="sas", lrs=(1e-3,), seeds=2, epoch_grid=(1,))
    runs = plan_runs(sweep, ["cola"], _args(), "small")
    assert [(r.lr, r.epochs, r.seed) for r in runs] == [(1e-3, 1, 10), (1e-3, 1, 11)]
    with pytest.raises(ConfigError, match="--task: unknown task 'sst5'"):
        expand_tasks("cola,sst5")
    with pytest.raises(ConfigError, match="--sweep-shard"):
        SweepConfig(sweep_shard=2, sweep_shards=2)


def test_a_runs_micro_batch_divides_its_global_batch():
    run = RunSpec("rte", 2e-5, 16, 3, 1, "last")
    assert run_namespace(_args(micro_batch_size=8), run, "/out", 4).micro_batch_size == 4
    assert run_namespace(_args(micro_batch_size=3), run, "/out", 1).micro_batch_size == 2
    with pytest.raises(ConfigError, match="--batch-sizes"):
        run_namespace(_args(), RunSpec("rte", 2e-5, 6, 3, 1, "last"), "/out", 4)


def _write(root, task, lr, seed, dev, finished=True):
    folder = root / task / f"lr{lr:g}-bs32-ep3-seed{seed}"
    folder.mkdir(parents=True)
    main = {"mrpc": "f1_acc_mean", "qqp": "f1_acc_mean", "stsb": "pearson_spearman_mean",
            "cola": "mcc"}.get(task, "acc")  # fmt: skip
    split = "dev_matched" if task == "mnli" else "dev"
    result = {"task": task, "finished": finished, "main_metric": main, "main_split": split,
              "dev": dev,
              "hyperparameters": {"lr": lr, "global_batch_size": 32, "epochs": 3}}  # fmt: skip
    (folder / "results.json").write_text(json.dumps(result))


def test_summary_means_over_seeds_picks_the_best_lr_and_scores_glue(tmp_path):
    # Each task: lr 1e-4 seeds score 70 and 80 (mean 75), lr 5e-5 seeds 60 and 100 (mean 80)
    # -> 5e-5 is best with 80 on every metric; an unfinished run is left out.
    def dev(task, v):
        if task == "mnli":
            return {"dev_matched/acc": v, "dev_mismatched/acc": v - 10}
        if task == "stsb":
            return {"pearson": v, "spearman": v, "pearson_spearman_mean": v}
        if task in ("mrpc", "qqp"):
            return {"f1": v, "acc": v, "f1_acc_mean": v}
        return {"mcc" if task == "cola" else "acc": v}

    for task in GLUE_TASKS:
        for lr, scores in ((1e-4, (70, 80)), (5e-5, (60, 100))):
            for seed, v in enumerate(scores):
                _write(tmp_path, task, lr, seed, dev(task, v))
        _write(tmp_path, task, 5e-5, 9, dev(task, 0), finished=False)
    summary = summarize(str(tmp_path), "sas")
    assert summary["tasks"]["rte"]["best"] == "lr5e-05-bs32-ep3"
    assert summary["tasks"]["rte"]["seeds"] == 2 and summary["tasks"]["rte"]["dev"]["acc"] == 80
    assert summary["tasks"]["mnli"]["dev"] == {"dev_matched/acc": 80, "dev_mismatched/acc": 70}
    # SAS's GLUE score: every task 80 except MNLI, the mean of matched 80 and mismatched 70.
    assert summary["glue_score"] == pytest.approx((7 * 80 + 75) / 8)
    # A third seed of 5e-5 at 61: its median (TACO) is 61, its mean (SAS) 73.67, both now
    # below 1e-4's 75, which becomes the best configuration either way.
    _write(tmp_path, "rte", 5e-5, 3, dev("rte", 61))
    for protocol, value in (("taco", 61), ("sas", (60 + 100 + 61) / 3)):
        rte = summarize(str(tmp_path), protocol)["tasks"]["rte"]
        assert rte["configs"]["lr5e-05-bs32-ep3"]["dev"]["acc"] == pytest.approx(value)
        assert rte["best"] == "lr0.0001-bs32-ep3" and rte["dev"]["acc"] == 75

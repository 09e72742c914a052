"""The protocols' grids and fixed settings (recipes/sweep.py) and the score table: mean /
median over seeds, seeds found against those expected, configurations keyed on every
hyperparameter, the best configuration, unreadable results, and the GLUE score in both
conventions, against values worked out by hand."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest

from megatron_taco.arguments import dataclass_from_args
from megatron_taco.cli.glue_score import main as glue_score_main
from megatron_taco.errors import ConfigError
from megatron_taco.recipes.finetune import _finished
from megatron_taco.recipes.sweep import (
    RunSpec,
    SweepConfig,
    check_fixed_settings,
    expand_tasks,
    plan_runs,
    run_namespace,
)
from megatron_taco.recipes.sweep_summary import markdown_table, summarize, write_plan, write_summary
from megatron_taco.training.configure import build_parser


def _args(**kw) -> argparse.Namespace:
    base = dict(lr=1e-4, global_batch_size=None, micro_batch_size=8, train_epochs=3,
                epoch_selection="best", seed=10, data_dir="/data", output="/out",
                weight_decay=0.0)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_sas_protocol_follows_its_table_6():
    runs = plan_runs(SweepConfig(protocol="sas"), expand_tasks("glue"), _args(), "small")
    seeds = Counter(r.task for r in runs)
    # 2 learning rates x 2 batch sizes x (5 seeds: CoLA, MRPC, STS-B, RTE; 3: QNLI, SST-2;
    # 1: MNLI, QQP).
    assert seeds == {"cola": 20, "mrpc": 20, "stsb": 20, "rte": 20, "qnli": 12, "sst2": 12,
                     "mnli": 4, "qqp": 4}  # fmt: skip
    assert {r.lr for r in runs} == {1e-4, 7.5e-5}
    assert {r.batch_size for r in runs} == {16, 32}  # "Batch size 16, 32"
    assert {(r.epochs, r.selection) for r in runs if r.task == "rte"} == {(20, "best")}
    assert {(r.epochs, r.selection) for r in runs if r.task == "mnli"} == {(4, "last")}
    fixed = dict(runs[0].fixed)
    assert fixed["weight_decay"] == 0.0 and fixed["adam_eps"] == 1e-6
    assert (fixed["adam_beta1"], fixed["adam_beta2"]) == (0.9, 0.999)
    assert fixed["lr_warmup_fraction"] == 0.1 and fixed["lr_decay_style"] == "linear"
    assert fixed["layerwise_lr_decay"] is None and fixed["classifier_dropout"] == 0.1
    assert {r.fixed for r in runs} == {runs[0].fixed}
    base = plan_runs(SweepConfig(protocol="sas"), ["cola"], _args(), "base")
    assert {r.lr for r in base} == {7.5e-5, 5e-5}
    assert sorted({r.seed for r in base}) == [10, 11, 12, 13, 14]
    # The single batch size.
    one = plan_runs(SweepConfig(protocol="sas", batch_sizes=(32,)), ["cola"], _args(), "small")
    assert {r.batch_size for r in one} == {32} and len(one) == 2 * 5


def test_sas_protocol_refuses_tasks_its_table_does_not_cover():
    for task in ("squad_v1", "race", "custom"):
        with pytest.raises(ConfigError, match=rf"^--protocol sas: .*'{task}'.*--protocol taco"):
            plan_runs(SweepConfig(protocol="sas"), [task], _args(), "small")
    # Epochs alone are not enough: the seeds are task-dependent too.
    with pytest.raises(ConfigError, match="--num-seeds"):
        plan_runs(SweepConfig(protocol="sas", epoch_grid=(2,)), ["custom"], _args(), "small")
    # With the task-dependent values given, the rest of the protocol applies.
    sweep = SweepConfig(protocol="sas", epoch_grid=(2,), seeds=1)
    runs = plan_runs(sweep, ["custom"], _args(epoch_selection="last"), "small")
    assert {(r.lr, r.batch_size, r.epochs, r.selection) for r in runs} == {
        (lr, bs, 2, "last") for lr in (1e-4, 7.5e-5) for bs in (16, 32)
    }
    assert dict(runs[0].fixed)["adam_eps"] == 1e-6
    # WNLI is a GLUE task (excluded from the score): treated as a small task.
    assert {
        r.epochs for r in plan_runs(SweepConfig(protocol="sas"), ["wnli"], _args(), "small")
    } == {20}


def test_taco_protocol_follows_its_table_8():
    sweep = SweepConfig(protocol="taco")
    glue = plan_runs(sweep, ["rte"], _args(), "base")
    assert len(glue) == 2 * 4 * 4 * 5 and {r.fixed for r in glue} == {(("weight_decay", 0.01),)}
    squad = plan_runs(sweep, ["squad_v2"], _args(), "base")
    assert {r.batch_size for r in squad} == {32} and {r.epochs for r in squad} == {2, 3, 4, 5}
    race = plan_runs(sweep, ["race"], _args(), "base")
    assert {(r.lr, r.batch_size, r.epochs, dict(r.fixed)["weight_decay"]) for r in race} == {
        (1e-5, 16, 6, 0.1)
    }
    assert len(race) == 5


def _parse(*flags: str):
    from megatron_taco.recipes.finetune import SPEC

    parser = build_parser(SPEC)
    argv = ["--load", "ckpt", "--task", "cola", "--data-dir", "/data", "--output", "/out"]
    return parser, parser.parse_args([*argv, *flags])


def test_protocols_fix_their_settings_and_refuse_conflicting_flags():
    from megatron_taco.training.config import TrainingConfig

    # A SAS run's command line carries every fixed setting, whatever the namespace held.
    parser, args = _parse("--protocol", "sas")
    runs = plan_runs(SweepConfig(protocol="sas"), ["cola"], args, "small")
    line = check_fixed_settings("sas", runs, args, parser)
    assert line.startswith("sweep: --protocol sas fixes ") and "--adam-eps 1e-06" in line
    drifted = argparse.Namespace(**{**vars(args), "adam_eps": 1e-8, "lr_warmup_fraction": 0.3,
                                    "layerwise_lr_decay": 0.8, "weight_decay": 0.05,
                                    "adam_beta2": 0.98, "lr_decay_style": "cosine",
                                    "classifier_dropout": 0.0})  # fmt: skip
    ns = run_namespace(drifted, runs[0], "/out", 1)
    training = dataclass_from_args(TrainingConfig, ns)
    assert (training.adam_eps, training.adam_beta1, training.adam_beta2) == (1e-6, 0.9, 0.999)
    assert (training.lr_warmup_fraction, training.lr_decay_style) == (0.1, "linear")
    assert (training.weight_decay, training.layerwise_lr_decay) == (0.0, None)
    assert ns.classifier_dropout == 0.1 and training.min_lr == 0.0
    # A flag given at another value than the protocol's is refused, in one line naming all.
    parser, args = _parse("--protocol", "sas", "--adam-eps", "1e-8", "--layerwise-lr-decay", "0.8")
    runs = plan_runs(SweepConfig(protocol="sas"), ["cola"], args, "small")
    with pytest.raises(ConfigError) as info:
        check_fixed_settings("sas", runs, args, parser)
    message = str(info.value)
    assert "\n" not in message and message.startswith("--protocol sas fixes ")
    assert "--adam-eps 1e-08" in message and "--layerwise-lr-decay 0.8" in message
    # Layer-wise decay 1.0 is none: not a conflict.
    parser, args = _parse("--protocol", "sas", "--layerwise-lr-decay", "1.0")
    check_fixed_settings("sas", runs, args, parser)
    # TACO fixes Table 8's weight decay (0.01; RACE 0.1) and leaves the rest to the flags.
    parser, args = _parse("--protocol", "taco", "--adam-eps", "1e-8")
    runs = plan_runs(SweepConfig(protocol="taco"), ["rte", "race"], args, "base")
    assert check_fixed_settings("taco", runs, args, parser) == (
        "sweep: --protocol taco fixes --weight-decay 0.01"
    )
    by_task = {r.task: run_namespace(args, r, "/out", 1) for r in runs}
    assert (by_task["rte"].weight_decay, by_task["race"].weight_decay) == (0.01, 0.1)
    assert by_task["rte"].adam_eps == 1e-8
    parser, args = _parse("--protocol", "taco", "--weight-decay", "0.05")
    with pytest.raises(ConfigError, match=r"--weight-decay 0\.01 .*gives --weight-decay 0\.05"):
        check_fixed_settings("taco", runs, args, parser)


def test_overrides_and_bad_tasks():
    sweep = SweepConfig(protocol="sas", lrs=(1e-3,), seeds=2, epoch_grid=(1,), batch_sizes=(32,))
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


_MAIN = {"cola": "mcc", "stsb": "pearson_spearman_mean"}  # MRPC, QQP and the rest: acc


def _write(root, task, dev, *, lr=5e-5, seed=0, finished=True, random_init=False, **hyper):
    extra = "".join(f"-{k}{v}" for k, v in sorted(hyper.items())) + "-random" * random_init
    folder = root / task / f"lr{lr:g}{extra}-seed{seed}"
    folder.mkdir(parents=True)
    result = {"task": task, "finished": finished, "main_metric": _MAIN.get(task, "acc"),
              "main_split": "dev_matched" if task == "mnli" else "dev", "dev": dev,
              "selection": "best",
              "pretrained": {"load": "/ckpt/sas_small", "iteration": 100,
                             "random_init": random_init},
              "hyperparameters": {"lr": lr, "global_batch_size": 32, "epochs": 3, "seed": seed,
                                  "weight_decay": 0.0, "micro_batch_size": 8,
                                  "data_parallel_size": 1, **hyper}}  # fmt: skip
    (folder / "results.json").write_text(json.dumps(result))
    return folder / "results.json"


# Per task and learning rate, each seed's dev scores, all different metrics distinct, so a
# table or score reading the wrong metric gets another number. The mean over the 2 seeds is
# in the comment; "<-" marks the configuration the task's main metric picks.
_SEEDS = {
    # mcc: 61 <-, 60
    "cola": {1e-4: [{"mcc": 60}, {"mcc": 62}], 5e-5: [{"mcc": 50}, {"mcc": 70}]},
    "sst2": {1e-4: [{"acc": 92}, {"acc": 94}], 5e-5: [{"acc": 91}, {"acc": 91}]},  # 93 <-, 91
    "qnli": {1e-4: [{"acc": 90}, {"acc": 90}], 5e-5: [{"acc": 91}, {"acc": 93}]},  # 90, 92 <-
    "rte": {1e-4: [{"acc": 70}, {"acc": 80}], 5e-5: [{"acc": 60}, {"acc": 100}]},  # 75, 80 <-
    # acc 82 <- (f1 71, f1_acc_mean 76.5); acc 79 (f1 91, f1_acc_mean 85: would win by those)
    "mrpc": {1e-4: [{"acc": 80, "f1": 70, "f1_acc_mean": 75},
                    {"acc": 84, "f1": 72, "f1_acc_mean": 78}],
             5e-5: [{"acc": 78, "f1": 90, "f1_acc_mean": 84},
                    {"acc": 80, "f1": 92, "f1_acc_mean": 86}]},
    # acc 89 <- (f1 80, mean 84.5); acc 86 (f1 86, mean 86)
    "qqp": {1e-4: [{"acc": 88, "f1": 80, "f1_acc_mean": 84},
                   {"acc": 90, "f1": 80, "f1_acc_mean": 85}],
            5e-5: [{"acc": 86, "f1": 85, "f1_acc_mean": 85.5},
                   {"acc": 86, "f1": 87, "f1_acc_mean": 86.5}]},
    # pearson 89, spearman 86, mean 87.5 <-; pearson 85, spearman 88, mean 86.5
    "stsb": {1e-4: [{"pearson": 88, "spearman": 86, "pearson_spearman_mean": 87},
                    {"pearson": 90, "spearman": 86, "pearson_spearman_mean": 88}],
             5e-5: [{"pearson": 85, "spearman": 87, "pearson_spearman_mean": 86},
                    {"pearson": 85, "spearman": 89, "pearson_spearman_mean": 87}]},
    # matched 85 <- (mismatched 84); matched 83 (mismatched 87)
    "mnli": {1e-4: [{"dev_matched/acc": 84, "dev_mismatched/acc": 83},
                    {"dev_matched/acc": 86, "dev_mismatched/acc": 85}],
             5e-5: [{"dev_matched/acc": 83, "dev_mismatched/acc": 87},
                    {"dev_matched/acc": 83, "dev_mismatched/acc": 87}]},
}  # fmt: skip
# By hand from the comments above: CoLA 61, SST-2 93, QNLI 92, RTE 80, MRPC acc 82, QQP acc
# 89; SAS: STS-B (89 + 86) / 2, MNLI (85 + 84) / 2; ELECTRA: STS-B Spearman 86, MNLI m 85.
_SAS_GLUE = (61 + 93 + 92 + 80 + 82 + 89 + (89 + 86) / 2 + (85 + 84) / 2) / 8
# The GLUE score of one seed per task, the tasks' seeds independent: the best
# configurations' per-seed task numbers have sample variances cola (60, 62) 2, sst2 2, qnli
# (91, 93) 2, rte (60, 100) 800, mrpc (80, 84) 8, qqp 2, stsb (87, 88) 0.5, mnli (83.5,
# 85.5) 2: standard deviation sqrt(818.5) / 8.
_SAS_GLUE_STD = 818.5**0.5 / 8
_ELECTRA_GLUE = (61 + 93 + 92 + 80 + 82 + 89 + 86 + 85) / 8


def _write_glue(root):
    for task, by_lr in _SEEDS.items():
        for lr, seeds in by_lr.items():
            for seed, dev in enumerate(seeds):
                _write(root, task, dev, lr=lr, seed=seed)
        _write(root, task, {k: 0 for k in by_lr[5e-5][0]}, lr=5e-5, seed=9, finished=False)


def test_summary_means_over_seeds_picks_by_the_main_metric_and_scores_glue(tmp_path, capsys):
    _write_glue(tmp_path)
    summary = summarize(str(tmp_path), "sas")
    tasks = summary["tasks"]
    assert summary["glue_score"] == pytest.approx(_SAS_GLUE) == 83.625
    assert tasks["rte"]["best"] == "lr5e-05-bs32-ep3"  # the unfinished seed 9 is left out
    assert tasks["rte"]["seeds"] == 2 and tasks["rte"]["dev"]["acc"] == 80
    assert tasks["mrpc"]["best"] == "lr0.0001-bs32-ep3"
    assert tasks["mrpc"]["dev"] == {"acc": 82, "f1": 71, "f1_acc_mean": 76.5}
    assert tasks["qqp"]["dev"]["acc"] == 89 and tasks["stsb"]["dev"]["spearman"] == 86
    assert tasks["mnli"]["dev"] == {"dev_matched/acc": 85, "dev_mismatched/acc": 84}
    assert summary["glue_task_scores"]["stsb"] == 87.5 and summary["warnings"] == []
    # Mean ± standard deviation over seeds beside the aggregate (here both means).
    assert tasks["cola"]["dev_mean"] == {"mcc": 61} and tasks["cola"]["dev_std"]["mcc"] == (
        pytest.approx(2**0.5)
    )
    assert summary["glue_score_mean"] == pytest.approx(_SAS_GLUE)
    assert summary["glue_score_std"] == pytest.approx(_SAS_GLUE_STD)
    table = markdown_table(summary)
    assert "| mean ± std over seeds |" in table.splitlines()[0]
    assert "| cola | lr0.0001-bs32-ep3 | 2/2 | mcc 61.00 | mcc 61.00 ± 1.41 |" in table
    assert f"| 83.62 | 83.62 ± {_SAS_GLUE_STD:.2f} |" in table
    electra = summarize(str(tmp_path), "sas", convention="electra")
    assert electra["glue_score"] == pytest.approx(_ELECTRA_GLUE) == 83.5
    # The tool: the convention is chosen, passed through, and named in the output.
    assert glue_score_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "sas convention" in out and "GLUE score (sas convention): 83.62" in out
    assert f"mean ± std over seeds 83.62 ± {_SAS_GLUE_STD:.2f}" in out
    assert glue_score_main([str(tmp_path), "--convention", "electra"]) == 0
    out = capsys.readouterr().out
    assert "electra convention" in out and "GLUE score (electra convention): 83.50" in out
    # A third seed of each rte configuration: 5e-5's at 61 makes its median (TACO) 61, its
    # mean (SAS) 73.67, both below 1e-4's (70, 80, 75): 75 either way.
    _write(tmp_path, "rte", {"acc": 61}, lr=5e-5, seed=3)
    _write(tmp_path, "rte", {"acc": 75}, lr=1e-4, seed=3)
    for protocol, value in (("taco", 61), ("sas", (60 + 100 + 61) / 3)):
        rte = summarize(str(tmp_path), protocol)["tasks"]["rte"]
        assert rte["configs"]["lr5e-05-bs32-ep3"]["dev"]["acc"] == pytest.approx(value)
        assert rte["best"] == "lr0.0001-bs32-ep3" and rte["dev"]["acc"] == 75
        # the mean and spread are the seeds', whatever the protocol's aggregate
        assert rte["configs"]["lr5e-05-bs32-ep3"]["dev_mean"]["acc"] == pytest.approx(221 / 3)
        assert rte["dev_std"]["acc"] == pytest.approx(5.0)  # 70, 80, 75
    table = markdown_table(summarize(str(tmp_path), "taco"))
    assert "| rte | lr0.0001-bs32-ep3 | 3/3 | acc 75.00 | acc 75.00 ± 5.00 |" in table


def test_one_seed_has_no_standard_deviation(tmp_path, capsys):
    """One seed per task: no spread is known, for any task or for the GLUE score (a sum of
    the tasks' variances counting a single seed as 0 would print 0.00). Neither does one
    seed run twice (here at two data-parallel sizes, which pool into one configuration)."""
    for task, by_lr in _SEEDS.items():
        _write(tmp_path, task, by_lr[1e-4][0], lr=1e-4, seed=0)
    rerun = {"acc": 72}
    _write(tmp_path / "again", "rte", rerun, lr=1e-4, seed=0, data_parallel_size=2)
    summary = summarize(str(tmp_path), "sas")
    rte = summary["tasks"]["rte"]
    assert rte["seeds"] == 1 and rte["dev"]["acc"] == 71 and rte["dev_std"] == {"acc": None}
    assert all(v is None for t in summary["tasks"].values() for v in t["dev_std"].values())
    assert summary["glue_score_std"] is None
    table = markdown_table(summary)
    assert "| rte | lr0.0001-bs32-ep3 | 1/1 | acc 71.00 | acc 71.00 ± - |" in table
    glue = f"{summary['glue_score']:.2f}"
    assert f"| {glue} | {glue} ± - |" in table
    assert glue_score_main([str(tmp_path)]) == 0
    assert f"mean ± std over seeds {glue} ± -" in capsys.readouterr().out


def test_sweep_submits_the_best_runs_test_files(tmp_path):
    """OUTPUT/submission/ gets each task's server files from its best configuration's best
    seed (by the main dev metric)."""
    for seed, acc in ((0, 70), (1, 90), (2, 80)):
        folder = _write(tmp_path, "rte", {"acc": acc}, seed=seed).parent
        (folder / "submission").mkdir()
        (folder / "submission" / "RTE.tsv").write_text(f"index\tprediction\n0\tseed{seed}\n")
    _write(tmp_path, "cola", {"mcc": 50})  # no --predict-test: nothing of it is submitted
    write_summary(str(tmp_path), "sas")
    assert (tmp_path / "submission" / "RTE.tsv").read_text().endswith("seed1\n")
    assert sorted(p.name for p in (tmp_path / "submission").iterdir()) == ["RTE.tsv"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["submission"] == {"rte": "rte/lr5e-05-seed1"}


def test_a_finished_run_without_test_files_is_named(tmp_path, capsys):
    """A sweep given --predict-test does not rerun finished runs: the ones that finished
    without it are named, rather than OUTPUT/submission/ quietly lacking their files."""
    from megatron_taco.recipes.finetune import _warn_unsubmitted

    bare = _write(tmp_path, "rte", {"acc": 70}).parent
    submitted = _write(tmp_path, "rte", {"acc": 80}, seed=1)
    result = json.loads(submitted.read_text())
    result["submission"] = {"directory": "submission", "epoch": 3, "files": ["RTE.tsv"]}
    submitted.write_text(json.dumps(result))
    _warn_unsubmitted(str(bare))
    _warn_unsubmitted(str(submitted.parent))
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"sweep: warning: --predict-test: {bare} finished without it, so its test files are "
        "not submitted (remove the directory to run it again)"
    ]


def test_incomplete_configurations_are_marked_and_lose_to_complete_ones(tmp_path, capsys):
    _write_glue(tmp_path)
    # The sweep planned 5 seeds of RTE: 1e-4 gets all 5 (mean 75), 5e-5 only 1 of them, at 99.
    write_plan(str(tmp_path), "sas",
               [RunSpec("rte", 1e-4, 32, 3, s, "best") for s in range(5)])  # fmt: skip
    for seed, acc in ((2, 75), (3, 70), (4, 80)):
        _write(tmp_path, "rte", {"acc": acc}, lr=1e-4, seed=seed)
    for path in (tmp_path / "rte").glob("lr5e-05*seed1/results.json"):
        path.unlink()  # 5e-5 keeps seed 0 only: 60 (and 99 below)
    _write(tmp_path, "rte", {"acc": 99}, lr=5e-5, seed=7)
    summary = summarize(str(tmp_path))
    assert summary["protocol"] == "sas"  # from sweep.json
    rte = summary["tasks"]["rte"]
    assert rte["best"] == "lr0.0001-bs32-ep3" and rte["complete"] and rte["dev"]["acc"] == 75
    partial = rte["configs"]["lr5e-05-bs32-ep3"]
    assert (partial["seeds"], partial["seeds_expected"], partial["complete"]) == (2, 5, False)
    assert partial["seed_values"] == [0, 7] and partial["dev"]["acc"] == pytest.approx(79.5)
    table = markdown_table(summary)
    assert "| rte | lr0.0001-bs32-ep3 | 5/5 |" in table
    assert "rte lr5e-05-bs32-ep3 (2/5)" in table and summary["warnings"] == []
    # Every configuration incomplete: the best of them (79.5 over 75) is used, with a warning,
    # and the GLUE score says so.
    write_plan(str(tmp_path), "sas",
               [RunSpec("rte", 1e-4, 32, 3, s, "best") for s in range(10)])  # fmt: skip
    summary = summarize(str(tmp_path))
    rte = summary["tasks"]["rte"]
    assert rte["best"] == "lr5e-05-bs32-ep3" and not rte["complete"]
    assert "| rte | lr5e-05-bs32-ep3 | 2/10 (incomplete) |" in markdown_table(summary)
    assert summary["glue_task_scores"]["rte"] == pytest.approx(79.5)
    assert summary["warnings"][0].startswith("warning: rte: no configuration has all 10 seeds")
    assert summary["warnings"][1] == (
        "warning: the GLUE score uses incomplete configurations: rte (2/10 seeds)"
    )
    glue_score_main([str(tmp_path)])
    assert "warning: the GLUE score uses incomplete configurations" in capsys.readouterr().out
    # Without sweep.json, the fullest configuration sets what complete is.
    (tmp_path / "sweep.json").unlink()
    rte = summarize(str(tmp_path))["tasks"]["rte"]
    assert rte["seeds_expected"] == 5 and rte["complete"]


def test_configurations_differ_in_every_hyperparameter_but_the_seed(tmp_path):
    for seed in (0, 1):
        _write(tmp_path, "rte", {"acc": 70 + seed}, seed=seed, data_parallel_size=1 + seed)
        _write(tmp_path, "rte", {"acc": 90 + seed}, seed=seed, weight_decay=0.01)
        _write(tmp_path, "rte", {"acc": 50 + seed}, seed=seed, random_init=True)
    configs = summarize(str(tmp_path))["tasks"]["rte"]["configs"]
    # Only what differs is named; the device layout (data_parallel_size) pools.
    assert {name: row["dev"]["acc"] for name, row in configs.items()} == {
        "lr5e-05-bs32-ep3-pretrained-wd0": 70.5,
        "lr5e-05-bs32-ep3-pretrained-wd0.01": 90.5,
        "lr5e-05-bs32-ep3-random-init-wd0": 50.5,
    }
    assert {row["seeds"] for row in configs.values()} == {2}


def test_unreadable_results_are_skipped_with_a_line_naming_them(tmp_path, capsys):
    _write(tmp_path, "rte", {"acc": 70})
    truncated = _write(tmp_path, "rte", {"acc": 90}, seed=1)
    truncated.write_text(truncated.read_text()[:40])
    foreign = tmp_path / "other" / "results.json"
    foreign.parent.mkdir()
    foreign.write_text(
        json.dumps({"task": "rte", "finished": True, "dev": {}, "main_metric": "acc"})
    )
    summary = summarize(str(tmp_path))
    assert summary["tasks"]["rte"]["dev"]["acc"] == 70 and summary["tasks"]["rte"]["seeds"] == 1
    assert len(summary["warnings"]) == 2
    assert summary["warnings"][0].startswith(f"warning: skipped {foreign}: no 'hyperparameters'")
    assert summary["warnings"][1].startswith(f"warning: skipped {truncated}: not valid JSON")
    assert glue_score_main([str(tmp_path)]) == 0
    assert f"warning: skipped {truncated}" in capsys.readouterr().out
    # The sweep does not guess whether such a run finished: one line naming the file.
    with pytest.raises(ConfigError, match=rf"^{truncated}: not valid JSON.*fix or remove it"):
        _finished(str(truncated.parent))
    assert not _finished(str(tmp_path / "nothing"))

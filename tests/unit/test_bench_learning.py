"""benchmarks.bench_learning's arguments: what would only fail at the report, after the
runs' half hour, is one line before any run."""

from __future__ import annotations

import pytest

from benchmarks import bench_learning


@pytest.mark.parametrize(
    ("given", "says"),
    [("taco={missing}", "--with taco={missing}: {missing} is not a file"),
     ("taco", "--with taco: expected MODEL=METRICS"),
     ("GPT-2={file}", "--with GPT-2={file}: GPT-2 is not a name (lower-case letters, digits, _)"),
     ("taco=", "--with taco=: expected MODEL=METRICS")],
)  # fmt: skip
def test_bad_with_is_one_line_before_any_run(tmp_path, capsys, given, says):
    file = tmp_path / "metrics.jsonl"
    file.write_text("")
    missing = tmp_path / "missing.jsonl"
    fill = {"missing": missing, "file": file}
    # --data-path: nothing is built or downloaded; --models taco given --with: nothing to run.
    argv = ["--data-path", str(tmp_path / "x"), "--tokenizer-model", str(tmp_path / "t.model"),
            "--models", "taco", "--out", str(tmp_path / "out"), "--with", given.format(**fill)]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        bench_learning.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says.format(**fill) in err[-1], err
    assert not (tmp_path / "out").exists()


def test_data_path_needs_its_tokenizer(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_learning.main(["--data-path", str(tmp_path / "x"), "--out", str(tmp_path / "o")])
    assert "--data-path needs --tokenizer-model" in capsys.readouterr().err


def test_no_models_and_no_curves_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_learning.main(["--models", "--out", str(tmp_path / "o")])
    assert "--models: none given and no --with curves" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _records(values: list[float]) -> list[dict]:
    return [{"mlm_acc": v, "seed": 1234 + k} for k, v in enumerate(values)]


def test_parity_counts_the_evaluations_outside_the_seed_spread(capsys):
    from benchmarks.learning.report import parity

    # Seed k of both models read the same batches: at 100 the difference (+1 point) is
    # inside the seed spread (2 points), at 200 it (+5.07) is outside it (1 point).
    curves = {
        "sas_mlm": {100: _records([0.10, 0.115, 0.12]), 200: _records([0.20, 0.207, 0.21])},
        "bert_mlm": {100: _records([0.09, 0.10, 0.11]), 200: _records([0.15, 0.155, 0.16])},
    }
    (result,) = parity(curves, tokens=2048)
    assert result.metric == "parity_sas_mlm_vs_bert_mlm_outside_seed_spread"
    assert result.value == 1.0 and result.met() is False
    assert "at 409,600 tokens: +5.07 points against a seed spread of 1.00" in result.note
    assert parity({"sas_mlm": curves["sas_mlm"]}, tokens=2048) == []  # no pair, no result


def test_taco_vs_bert_at_equal_flops_reads_bert_at_tacos_flops(capsys):
    """TACO at 2 FLOPs per iteration, BERT at 1: TACO's iteration 100 (200 FLOPs) meets
    BERT's iteration 200, its 200 (400 FLOPs) BERT's 300-500 halfway, i.e. 400. Hand-derived
    ratios: 0.10 / 0.08 = 1.25 and 0.20 / 0.25 = 0.8 (the worst and the end). At the end
    BERT is 0.255, 0.245, 0.25 by seed, the paired differences -0.045, -0.055, -0.05:
    t = -0.05 / (0.005 / sqrt 3) = -17.32 on 2 degrees of freedom, two-sided
    p = 1 - |t| / sqrt(t^2 + 2) = 0.0033."""
    from benchmarks.learning.report import taco_vs_bert_at_equal_flops

    def curve(points: dict) -> dict:
        return {it: [{"mlm_acc": a, "seed": s} for s, a in enumerate(accs)]
                for it, accs in points.items()}  # fmt: skip

    curves = {
        "taco": curve({100: [0.09, 0.11, 0.10], 200: [0.21, 0.19, 0.20]}),
        "bert": curve({100: [0.05] * 3, 200: [0.07, 0.09, 0.08], 300: [0.2] * 3,
                       500: [0.31, 0.29, 0.30]}),
    }  # fmt: skip
    worst, end = taco_vs_bert_at_equal_flops(curves, {"taco": 2.0, "bert": 1.0}, tokens=2048)
    assert abs(end.value - 0.8) < 1e-12 and end.met() is False
    assert worst.value == end.value and "worst of 2; at or above at 1" in worst.note
    assert "paired t-test p 0.003" in end.note
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "409,600" in line]
    assert rows[0][-2:] == ["0.80", "0.003"]  # the p of each evaluation, in its own column


@pytest.mark.parametrize(
    "names, reference",
    [(["taco", "bert"], "taco"), (["paper", "electra", "bert"], "sas")],
)
def test_an_equal_flops_campaign_gives_each_variant_the_references_budget(names, reference):
    """bench_sas_variants --equal-flops: TACO's FLOPs at --iters where the campaign has
    TACO, SAS's otherwise; each variant's iterations that budget over its own FLOPs per
    iteration (ELECTRA's convention), every lr of the grid and every seed."""
    import argparse

    from benchmarks.bench_sas_variants import campaign_jobs
    from benchmarks.learning.setting import Setting
    from benchmarks.learning.variants import VARIANTS, train_flops_per_iteration

    s = Setting(prefix="p", tokenizer="t.model", cache="c", seq_length=32, batch=64,
                iters=600, lr=1e-3, warmup_fraction=0.1, eval_interval=200, eval_iters=1,
                split="90,5,5", seed=1234, layers=4, hidden=256)  # fmt: skip
    args = argparse.Namespace(variants=names, lrs=[5e-4, 1e-3], lr=1e-3, iters=600,
                              equal_flops=True, seed=1234, seeds=2)  # fmt: skip
    jobs, variants, variant_of = campaign_jobs(args, s, 1000, {})
    assert len(jobs) == len(names) * 2 * 2 and set(variant_of.values()) == set(names)
    budget = 600 * train_flops_per_iteration(reference, s, 1000)
    for job in jobs:
        model = VARIANTS[variant_of[job.name]][0]
        flops = train_flops_per_iteration(model, s, 1000)
        assert job.model == model and abs(job.iters * flops - budget) <= flops / 2
        assert job.iters == 600 or model != reference
        assert variants[job.name][1] == job.lr and job.name.endswith(f"_lr{job.lr:g}")
    assert {j.seed for j in jobs} == {1234, 1235}
    # TACO and BERT are not the same size: a budget in iterations alone would not match.
    bert = next(j for j in jobs if j.model == "bert")
    assert bert.iters != 600


def test_the_default_campaign_and_with_runs_keep_the_right_budget(tmp_path, capsys):
    """The default --variants is SAS's campaign (SAS's budget, no TACO); a TACO given by
    --with still sets BERT's budget; TACO and SAS variants in one --equal-flops campaign
    are refused in one line."""
    import argparse

    from benchmarks import bench_sas_variants as bsv
    from benchmarks.learning.setting import Setting
    from benchmarks.learning.variants import train_flops_per_iteration as f

    s = Setting(prefix="p", tokenizer="t.model", cache="c", seq_length=32, batch=64,
                iters=600, lr=1e-3, warmup_fraction=0.1, eval_interval=200, eval_iters=1,
                split="90,5,5", seed=1234, layers=4, hidden=256)  # fmt: skip
    default = next(a for a in bsv.build_parser()._actions if a.dest == "variants").default
    assert "taco" not in default and "paper" in default
    args = argparse.Namespace(variants=default, lrs=None, lr=1e-3, iters=600,
                              equal_flops=True, seed=1234, seeds=1)  # fmt: skip
    jobs, _, _ = bsv.campaign_jobs(args, s, 1000, {})
    assert next(j for j in jobs if j.name == "paper").iters == 600
    args.variants = ["bert"]
    (bert,) = bsv.campaign_jobs(args, s, 1000, {"taco": "m.jsonl"})[0]
    assert bert.iters == round(600 * f("taco", s, 1000) / f("bert", s, 1000))
    with pytest.raises(SystemExit) as stop:
        bsv.main(["--data-path", "x", "--tokenizer-model", "y", "--variants", "taco", "paper",
                  "--equal-flops", "--out", str(tmp_path)])  # fmt: skip
    assert stop.value.code == 2
    assert "mixes TACO and SAS's variants" in capsys.readouterr().err


def test_a_bad_warmup_fraction_is_one_line(tmp_path, capsys):
    from benchmarks import bench_sas_variants as bsv

    with pytest.raises(SystemExit) as stop:
        bsv.main(["--data-path", "x", "--tokenizer-model", "y", "--warmup-fraction", "1.0",
                  "--out", str(tmp_path)])  # fmt: skip
    assert stop.value.code == 2
    assert "--warmup-fraction must be in [0, 1), got 1.0" in capsys.readouterr().err


def test_the_taco_campaign_compares_each_models_curve_with_the_most_seeds():
    """bench_sas_variants' TACO-against-BERT table reads the chosen rate's curves (the ones
    with every seed), not the grid's other rate. Hand-derived as in the test above: TACO at
    2 FLOPs per iteration, BERT at 1; at TACO's iteration 200 BERT's 400 (halfway between
    0.20 and 0.30 = 0.25 over both seeds): 0.20 / 0.25 = 0.8."""
    from benchmarks.bench_sas_variants import taco_vs_bert
    from benchmarks.learning.variants import VARIANTS

    def curve(points: dict) -> dict:
        return {it: [{"mlm_acc": a, "seed": s} for s, a in enumerate(accs)]
                for it, accs in points.items()}  # fmt: skip

    curves = {
        "taco_lr0.001": curve({100: [0.5], 200: [0.9]}),  # one seed: the grid's other rate
        "taco_lr0.0005": curve({100: [0.09, 0.11], 200: [0.21, 0.19]}),
        "bert_lr0.0005": curve({200: [0.07, 0.09], 300: [0.2] * 2, 500: [0.31, 0.29]}),
    }
    variants = {"taco_lr0.001": (VARIANTS["taco"], 1e-3), "taco_lr0.0005": (VARIANTS["taco"], 5e-4),
                "bert_lr0.0005": (VARIANTS["bert"], 5e-4)}  # fmt: skip
    flops = {"taco_lr0.001": 2.0, "taco_lr0.0005": 2.0, "bert_lr0.0005": 1.0}
    table = {name: {} for name in curves}
    taco_vs_bert(curves, variants, flops, table, tokens=2048)
    worst, end = table["taco_lr0.0005"]["vs_bert_equal_flops"]
    assert end["metric"] == "taco_vs_bert_equal_flops_end" and abs(end["value"] - 0.8) < 1e-12
    # At TACO's iteration 100 (200 FLOPs) BERT's 200: 0.10 / 0.08 = 1.25; the worst is the end.
    assert abs(worst["value"] - 0.8) < 1e-12 and "at or above at 1" in worst["note"]
    assert "vs_bert_equal_flops" not in table["taco_lr0.001"]

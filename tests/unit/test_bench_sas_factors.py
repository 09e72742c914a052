"""benchmarks/bench_sas_factors.py: each factor changes what it names and nothing else, a
factor holds only when every seed leaves the plateau on every corpus, and the table reads
each campaign's own summary."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import bench_sas_factors, bench_sas_variants
from benchmarks.bench_sas_factors import FACTORS, campaign_argv, holds

SEQ = 32


def _campaign(factor: str, tmp_path, **over):
    args = bench_sas_factors.build_parser().parse_args(["--out", str(tmp_path)])
    for key, value in over.items():
        setattr(args, key, value)
    return bench_sas_variants.build_parser().parse_args(campaign_argv(args, "wiki", factor))


def _budget(a) -> dict:
    """Training tokens, tokens between evaluations, tokens per evaluation."""
    return {"train": a.iters * a.batch * SEQ, "between": a.eval_interval * a.batch * SEQ,
            "eval": a.eval_iters * a.batch * SEQ}  # fmt: skip


def test_each_factor_changes_only_what_it_names(tmp_path):
    base = _campaign("base", tmp_path)
    assert (base.batch, base.iters, base.eval_interval, base.warmup_fraction) == (64, 800, 200, 0.1)
    assert (base.vocab_size, base.layers, base.hidden, base.seq_length) == (1000, 2, 128, SEQ)
    assert (base.variants, base.lrs, base.seeds, base.reuse) == (["paper"], [1e-3], 3, True)
    changed = {
        "base": set(),
        "long": {"iters"},
        "b32": {"batch", "iters", "eval_interval", "eval_iters"},
        "b128": {"batch", "iters", "eval_interval", "eval_iters"},
        "warm30": {"warmup_fraction"},
        "v2000": {"vocab_size"},
    }
    assert set(changed) == set(FACTORS)
    for factor, names in changed.items():
        a = _campaign(factor, tmp_path)
        differ = {k for k, v in vars(a).items() if v != getattr(base, k)} - {"out", "json"}
        assert differ == names, factor
        assert a.out == os.path.join(str(tmp_path), "wiki", factor)
    # The batch factors: the same tokens, evaluated at the same token counts on as many
    # tokens, in twice / half the optimizer steps.
    for factor, steps in (("b32", 2.0), ("b128", 0.5)):
        a = _campaign(factor, tmp_path)
        assert _budget(a) == _budget(base)
        assert a.iters / base.iters == steps
    assert _budget(_campaign("long", tmp_path))["train"] == 2 * _budget(base)["train"]
    assert _campaign("warm30", tmp_path).warmup_fraction == 0.3
    assert _campaign("v2000", tmp_path).vocab_size == 2000
    # The recipe, its rate and the campaign's flags are the caller's.
    over = {"variant": "mlm_lambda_small", "lr": 1.2345678e-3, "seeds": 2, "seed": 99,
            "left_plateau": 1.25, "jobs": 1}  # fmt: skip
    a = _campaign("b32", tmp_path, **over)
    assert (a.variants, a.lrs, a.seeds, a.seed) == (["mlm_lambda_small"], [1.2345678e-3], 2, 99)
    assert (a.left_plateau, a.jobs) == (1.25, 1)


def _row(left: int, seeds: int = 3) -> dict:
    return {"left": left, "seeds": seeds, "ratio": 1.4, "ratio_std": 0.1}


@pytest.mark.parametrize(
    "rows, verdict",
    [
        ({"wiki": _row(3), "demo": _row(3)}, True),
        ({"wiki": _row(3), "demo": _row(2)}, False),  # one seed stayed on one corpus
        ({"wiki": _row(3), "demo": None}, False),  # a campaign that did not end
        ({"wiki": _row(2, seeds=2), "demo": _row(3)}, False),  # a seed cut short
        ({"wiki": _row(3)}, False),  # a corpus missing
    ],
)
def test_a_factor_holds_only_when_every_seed_leaves_on_every_corpus(rows, verdict):
    assert holds(rows, ["wiki", "demo"], 3) is verdict


def _summary(ratios: list[float], exits: list) -> dict:
    return {"paper_lr0.001": {
        "ratio_by_seed": ratios, "collapse": 0.5, "tokens": 1_638_400,
        "left_plateau_tokens_by_seed": {str(1234 + k): e for k, e in enumerate(exits)},
    }}  # fmt: skip


def _fake_campaigns(monkeypatch, written: dict) -> list:
    """Stands in for each campaign's training (bench_sas_variants' own tests cover it):
    writes the summary ``written`` holds for its (corpus, factor), else fails as ``written``
    says. What is tested is which summary each cell reads."""
    calls = []

    def campaign(argv):
        a = bench_sas_variants.build_parser().parse_args(argv)
        calls.append((a.corpus, os.path.basename(a.out)))
        summary = written.get(calls[-1])
        if isinstance(summary, BaseException):
            raise summary
        if summary is not None:
            os.makedirs(a.out, exist_ok=True)
            with open(a.json, "w") as f:
                json.dump(summary, f)
        return 0 if summary else 1

    monkeypatch.setattr(bench_sas_variants, "main", campaign)
    return calls


def _line(lines: list[str], factor: str) -> str:
    return next(line for line in lines if line.startswith(f"{factor} "))


def test_the_table_reads_each_campaigns_own_summary(tmp_path, monkeypatch, capsys):
    calls = _fake_campaigns(monkeypatch, {
        ("wiki", "base"): _summary([1.6, 1.7, 1.5], [409_600, 409_600, 819_200]),
        ("demo", "base"): _summary([1.2, 1.3, 1.6], [None, None, 1_228_800]),
        ("wiki", "b32"): _summary([1.8, 1.6, 1.9], [204_800, 409_600, 409_600]),
        ("wiki", "long"): _summary([1.8, 1.6], [204_800, 409_600]),  # a seed cut short
        ("demo", "long"): _summary([1.7, 1.6, 1.9], [204_800, 409_600, 409_600]),
        ("wiki", "warm30"): RuntimeError("a bug in one campaign"),
        ("demo", "warm30"): SystemExit(2),  # a campaign's one-line refusal
        ("wiki", "v2000"): _summary([1.6, 1.7, 1.5], [1, 1, 1]),
        ("demo", "v2000"): _summary([1.6, 1.7, 1.9], [1, 1, 1]),
    })  # fmt: skip
    # demo/b32 ended once before and fails now: its old summary must not be read.
    stale = tmp_path / "demo" / "b32"
    stale.mkdir(parents=True)
    (stale / "summary.json").write_text(json.dumps(_summary([3.0] * 3, [1, 1, 1])))
    out = tmp_path / "table.json"
    factors = ["base", "b32", "long", "warm30", "v2000"]
    argv = ["--corpus", "wiki", "demo", "--factors", *factors, "--out", str(tmp_path)]
    assert bench_sas_factors.main([*argv, "--json", str(out)]) == 1
    assert calls == [(c, f) for f in factors for c in ("wiki", "demo")]
    table = json.loads(out.read_text())
    assert table["base"]["wiki"]["left"] == 3
    assert table["base"]["demo"]["left"] == 1
    assert table["base"]["wiki"]["ratio"] == pytest.approx(1.6)
    assert table["base"]["demo"]["ratio_std"] == pytest.approx(0.2081666, rel=1e-6)
    assert table["b32"]["wiki"]["left"] == 3 and table["b32"]["demo"] is None
    assert table["warm30"] == {"wiki": None, "demo": None}
    lines = capsys.readouterr().out.splitlines()
    base = _line(lines, "base")
    assert "3/3 1.60 ± 0.10x" in base and "1/3 1.37 ± 0.21x" in base and " no " in base
    assert "did not end" in _line(lines, "b32") and " no " in _line(lines, "b32")
    assert "2/2 (1 cut) 1.70 ± 0.14x" in _line(lines, "long") and " no " in _line(lines, "long")
    assert " yes " in _line(lines, "v2000")
    assert "twice the steps" in _line(lines, "b32")


def test_every_campaign_that_ended_whole_is_a_success(tmp_path, monkeypatch, capsys):
    _fake_campaigns(monkeypatch, {("demo", "b128"): _summary([1.7], [819_200])})
    argv = ["--corpus", "demo", "--factors", "b128", "--seeds", "1", "--out", str(tmp_path)]
    assert bench_sas_factors.main(argv) == 0
    b128 = _line(capsys.readouterr().out.splitlines(), "b128")
    assert "1/1 1.70 ± 0.00x" in b128 and " yes " in b128 and "half the steps" in b128


def test_a_summary_without_a_finished_seed_is_no_row(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("{}")  # what a campaign whose every run failed writes
    assert bench_sas_factors.read_row(str(path)) is None
    path.write_text(json.dumps(_summary([], [None])))  # no baseline in the records
    row = bench_sas_factors.read_row(str(path))
    assert row["ratio"] is None and row["left"] == 0


def test_bad_flags_are_one_line(capsys):
    for argv, says in (
        (["--factors", "b64"], "invalid choice: 'b64'"),
        (["--variant", "electra"], "invalid choice: 'electra'"),
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--left-plateau", "0"], "--left-plateau must be > 0"),
        (["--jobs", "0"], "--jobs must be >= 1"),
    ):
        with pytest.raises(SystemExit) as e:
            bench_sas_factors.main(argv)
        assert e.value.code == 2
        assert says in capsys.readouterr().err

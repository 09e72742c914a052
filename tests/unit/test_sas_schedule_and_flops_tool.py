"""SAS's per-epoch lambda schedule and the FLOPs tool against the SAS paper's Table 1."""

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from megatron_taco.cli.count_flops import main as count_flops
from megatron_taco.errors import ConfigError
from megatron_taco.recipes.sas import RtdScheduleConfig

REPO = Path(__file__).resolve().parents[2]


def test_lambda_steps_linearly_per_epoch():
    sas = RtdScheduleConfig()
    assert [sas.weight(e, 5) for e in range(5)] == [50, 87.5, 125, 162.5, 200]
    assert sas.weight(0, 1) == 50
    constant = RtdScheduleConfig(rtd_weight=50, rtd_weight_final=50)  # SAS^c
    assert {constant.weight(e, 7) for e in range(7)} == {50}
    with pytest.raises(ConfigError, match="--rtd-weight"):
        RtdScheduleConfig(rtd_weight=-1)


def test_lambda_holds_its_final_value_after_the_last_whole_epoch():
    """250k steps x 512 over 25M instances is 5.12 epochs: 50 ... 200 over the 5 whole
    epochs, then 200 in the tail (not a ramp that reaches 200 only in the last 0.12)."""
    sas = RtdScheduleConfig()
    assert [sas.weight(e, 5) for e in range(6)] == [50, 87.5, 125, 162.5, 200, 200]
    assert [sas.weight(e, 2) for e in range(3)] == [50, 200, 200]
    assert [sas.weight(e, 1) for e in range(2)] == [50, 50]  # one whole epoch keeps the first
    assert sas.weight(0, 0) == 50
    epochs = Fraction(250_000 * 512, 25_000_000)
    assert sas.describe(epochs) == (
        "lambda per epoch 50, 87.5, 125, 162.5, 200, 200 (epoch 6 is 0.12 of an epoch)"
    )
    assert sas.describe(Fraction(3)) == "lambda per epoch 50, 125, 200"
    assert sas.describe(Fraction(40)).startswith("lambda per epoch 50, 53.8462, 57.6923, ..., ")


# SAS paper Table 1: batch 512, 250k steps, seq 128, vocab 30522.
TABLE1 = [
    (["--model", "bert"], 1.274e18),
    (["--model", "electra"], 1.294e18),
    (["--model", "sas"], 1.279e18),
]


@pytest.mark.parametrize("args,paper", TABLE1, ids=["bert", "electra", "sas"])
def test_count_flops_reproduces_table1(capsys, args, paper):
    assert count_flops([*args, "--model-size", "small"]) == 0
    out = capsys.readouterr().out
    value = float(out.split(": ")[1].split(" ")[0])
    assert value == pytest.approx(paper, rel=0.01), out


def test_count_flops_variants_and_cli():
    res = subprocess.run(
        [sys.executable, "tools/count_flops.py", "--model", "sas", "--disentangled-attention"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    da = float(res.stdout.split(": ")[1].split(" ")[0])
    assert da == pytest.approx(1.385e18, rel=0.01)  # SAS^DA-Small, Table 1
    res = subprocess.run(
        [sys.executable, "tools/count_flops.py", "--model", "taco", "--model-size", "nope"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 2 and "unknown preset 'nope'" in res.stderr


def test_blended_passes_banner_and_warning():
    from megatron_taco.recipes.sas import DatasetPasses, describe_passes

    passes = [
        DatasetPasses("wiki", 0.3, 300, 100, 3.0),
        DatasetPasses("books", 0.7, 700, 900, 0.7778),
    ]
    lines, warnings = describe_passes(passes)
    assert lines == [
        "per epoch: wiki (weight 0.3): 300 instances, 3.00 passes over its 100 samples",
        "per epoch: books (weight 0.7): 700 instances, 0.78 passes over its 900 samples",
    ]
    assert len(warnings) == 1 and warnings[0].startswith("--data-path: books is seen 0.78 times")
    assert "22% of it is never trained on" in warnings[0]
    assert "('--data-path 0.1 wiki 0.9 books')" in warnings[0]
    assert describe_passes(passes[:1]) == ([], [])  # one dataset: one pass by construction

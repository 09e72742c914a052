"""examples/demo_evaluate.py as users run it: bad input is one line. (What it measures:
tests/unit/test_evaluation.py; its run on checkpoints trained at tensor parallel 2 under
ZeRO is in the e2e tests of pretrain_taco.py and pretrain_sas.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_taco.errors import ConfigError
from megatron_taco.evaluation.random_twins import TwinsConfig
from tests.helpers import REPO


def test_bad_input_is_one_line(tmp_path):
    missing = tmp_path / "nothing"
    res = subprocess.run(
        [sys.executable, "examples/demo_evaluate.py", "--load", str(missing), "--data-path", "x"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert err == [f"demo_evaluate.py: error: --load: {missing} is not a directory"], err


@pytest.mark.parametrize("flag", ["sentences", "seeds", "random_twins"])
def test_counts_must_be_positive(flag):
    with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')}: must be >= 1, got 0"):
        TwinsConfig(data_path="x", load=("a",), **{flag: 0})
    with pytest.raises(ConfigError, match="--load: give at least one checkpoint"):
        TwinsConfig(data_path="x")

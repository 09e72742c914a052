"""pretrain_sas.py as users run it, with the real `deepspeed` launcher on 2 ranks:

* SAS^DA at tensor-parallel 2 saves, and a run resumed from the step-3 checkpoint logs
  exactly the losses of the uninterrupted run;
* SAS with self-augmentation over 3 epochs is killed with SIGKILL in the middle of epoch 2;
  resumed with --load it logs the uninterrupted run's losses, and the replacement store it
  commits is byte-identical to the uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import ENV, REPO, SAS_METRIC_KEYS, deepspeed, deepspeed_command, train_records

pytestmark = pytest.mark.e2e


def sas_args(dataset, *extra: str) -> list[str]:
    return [
        "--model-size", "tiny", "--seq-length", "64",
        "--data-path", dataset["prefix"], "--tokenizer-model", dataset["tokenizer"],
        "--data-cache-path", str(dataset["dir"] / "cache"), "--split", "80,10,10",
        "--lr", "1e-3", "--lr-warmup-iters", "2", "--log-interval", "1",
        "--num-workers", "1", "--eval-iters", "1",
        *extra,
    ]  # fmt: skip


def test_sas_da_tp2_deepspeed_exact_resume(botchan_dataset, tmp_path):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    run_args = sas_args(
        botchan_dataset,
        "--disentangled-attention", "--tensor-model-parallel-size", "2",
        "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "6",
        "--eval-interval", "3", "--save-interval", "3",
        "--deepspeed-config", "ds_configs/zero1_bf16.json",
    )  # fmt: skip
    res = deepspeed("pretrain_sas.py", *run_args, "--save", str(full_dir))
    out = res.stdout
    assert "megatron_taco: SAS pretraining" in out
    assert "world size 2 = tensor parallel 2 x data parallel 1" in out
    assert "variant: SAS^DA" in out and "train FLOPs (ELECTRA's convention)" in out
    full = train_records(full_dir / "metrics.jsonl")
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert all(set(SAS_METRIC_KEYS) <= set(r) for r in full.values())
    assert {r["rtd_weight"] for r in full.values()} <= {50.0, 87.5, 125.0, 162.5, 200.0}
    assert (full_dir / "loss_curve.png").stat().st_size > 0

    res = deepspeed(
        "pretrain_sas.py", *run_args, "--load", str(full_dir), "--ckpt-step", "3",
        "--save", str(resumed_dir),
    )  # fmt: skip
    assert f"resumed from {full_dir} at iteration 3" in res.stdout
    resumed = train_records(resumed_dir / "metrics.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    for it in (4, 5, 6):
        for key in (*SAS_METRIC_KEYS, "lr", "grad_norm", "epoch"):
            assert resumed[it][key] == full[it][key], (it, key)


def _store_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _run_until_killed(cmd: list[str], metrics: Path, iteration: int, timeout: float = 240):
    """Start ``cmd`` in its own process group and SIGKILL all of it once ``iteration`` is
    in the metrics file (the launcher and every rank: a node lost mid-epoch)."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and iteration in train_records(metrics):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_sigkill_mid_epoch_resumes_to_the_same_losses_and_store(botchan_dataset, tmp_path):
    # 200 instances per epoch at global batch 8: epochs end at iterations 25, 50, 75.
    common = sas_args(
        botchan_dataset,
        "--micro-batch-size", "4", "--global-batch-size", "8", "--train-epochs", "3",
        "--eval-interval", "1000", "--save-interval", "10",
        "--deepspeed-config", "ds_configs/zero0_fp32.json", "--replacement-store-shards", "5",
    )  # fmt: skip
    full_dir, crash_dir = tmp_path / "full", tmp_path / "crash"
    deepspeed("pretrain_sas.py", *common, "--save", str(full_dir), timeout=300)
    full = train_records(full_dir / "metrics.jsonl")
    assert sorted(full)[-1] == 75 and [full[i]["epoch"] for i in (25, 26, 51)] == [1, 2, 3]
    assert full[26]["self_augmented"] == 1.0 and full[25]["self_augmented"] == 0.0

    cmd = deepspeed_command("pretrain_sas.py", *common, "--save", str(crash_dir), "--load",
                            str(crash_dir))  # fmt: skip
    _run_until_killed(cmd, crash_dir / "metrics.jsonl", iteration=34)
    assert (crash_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
    deepspeed("pretrain_sas.py", *common, "--save", str(crash_dir), "--load", str(crash_dir),
              timeout=300)  # fmt: skip
    resumed = train_records(crash_dir / "metrics.jsonl")
    for it in range(31, 76):
        for key in (*SAS_METRIC_KEYS, "lr", "epoch"):
            assert resumed[it][key] == full[it][key], (it, key)
    a, b = (
        _store_bytes(full_dir / "replacement_store"),
        _store_bytes(crash_dir / "replacement_store"),
    )
    assert sorted(a) == sorted(b) and any(name.endswith("manifest.json") for name in a)
    for name in a:
        assert a[name] == b[name], name


def test_plain_python_unigram_ablation_flags(botchan_dataset, tmp_path):
    """One process, no launcher: the paper's Unif-MLM-RTD^c ablation (cold start in every
    epoch, uniform replacements, constant lambda), no store written."""
    import sys

    from tests.helpers import run

    args = sas_args(
        botchan_dataset,
        "--micro-batch-size", "8", "--global-batch-size", "8", "--train-epochs", "2",
        "--eval-interval", "1000", "--num-workers", "0", "--no-self-augmentation",
        "--cold-start", "uniform", "--rtd-weight-final", "50",
    )  # fmt: skip
    res = run([sys.executable, "pretrain_sas.py", *args, "--save", str(tmp_path / "ckpt")])
    assert "world size 1 = tensor parallel 1 x data parallel 1" in res.stdout
    assert "cold start uniform" in res.stdout and "no self-augmentation" in res.stdout
    records = train_records(tmp_path / "ckpt" / "metrics.jsonl")
    assert sorted(records)[-1] == 50 and {r["epoch"] for r in records.values()} == {1, 2}
    assert {r["rtd_weight"] for r in records.values()} == {50.0}
    assert {r["self_augmented"] for r in records.values() if "self_augmented" in r} <= {0.0}
    assert not (tmp_path / "ckpt" / "replacement_store").exists()

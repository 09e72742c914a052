"""pretrain_taco.py as users run it: the real `deepspeed` launcher with tensor parallelism
and an exact resume, and plain `python` with one process, on a dataset made by the
preprocessing tool from the Botchan excerpt."""

from __future__ import annotations

import json
import os
import sys

import pytest

from megatron_taco.training.observability.log import read_metrics
from tests.helpers import (
    BIN,
    TACO_METRIC_KEYS,
    assert_pretrained_and_random_rows,
    deepspeed,
    demo_evaluate,
    free_port,
    run,
    train_records,
    wandb_offline_runs,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def dataset(botchan_dataset):
    return botchan_dataset


def common_args(dataset, *extra: str) -> list[str]:
    return [
        "--model-size", "tiny", "--seq-length", "64",
        "--data-path", dataset["prefix"], "--tokenizer-model", dataset["tokenizer"],
        "--data-cache-path", str(dataset["dir"] / "cache"), "--split", "80,10,10",
        "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1",
        *extra,
    ]  # fmt: skip


def test_deepspeed_launcher_tp2_and_exact_resume(dataset, tmp_path):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    run_args = (
        "--tensor-model-parallel-size", "2", "--train-iters", "6",
        "--eval-interval", "3", "--eval-iters", "1", "--save-interval", "3",
        "--num-workers", "1", "--deepspeed_config", "ds_configs/zero2_fp32.json",
        "--wandb-project", "taco-e2e", "--wandb-exp-name", "tp2", "--wandb-mode", "offline",
    )  # fmt: skip
    res = deepspeed(
        "pretrain_taco.py",
        *common_args(dataset, *run_args),
        "--save",
        str(full_dir),
        "--tensorboard-dir",
        str(full_dir / "tb"),
        timeout=900,  # W&B's import, start and finish take minutes on a loaded machine
    )
    out = res.stdout
    assert "world size 2 = tensor parallel 2 x data parallel 1" in out
    assert "ZeRO stage 2 | precision fp32" in out
    assert "LayerNorm: torch.nn.modules.normalization.LayerNorm" in out
    assert (full_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    for it in ("iter_0000003", "iter_0000006"):
        files = os.listdir(full_dir / it)
        assert {"metadata.json", "rng_state_rank_00000.pt", "rng_state_rank_00001.pt"} <= set(files)
        # DeepSpeed's model files, one per tensor-parallel rank.
        assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(files)
    meta = json.loads((full_dir / "iter_0000003" / "metadata.json").read_text())
    assert (meta["iteration"], meta["consumed_samples"], meta["tensor_model_parallel_size"]) == (
        3,
        12,
        2,
    )
    assert meta["configs"]["training"]["train_iters"] == 6
    assert any(p.name.startswith("events.out.tfevents") for p in (full_dir / "tb").iterdir())
    full_metrics = full_dir / "tb" / "metrics.jsonl"
    assert (full_dir / "tb" / "loss_curve.png").stat().st_size > 0
    full = train_records(full_metrics)
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert [full[i]["consumed_samples"] for i in (1, 6)] == [4, 24]
    assert all(full[i]["tflops_per_rank"] > 0 and full[i]["grad_norm"] > 0 for i in full)
    valid = [r for r in read_metrics(str(full_metrics)) if r["split"] == "valid"]
    assert [r["iteration"] for r in valid] == [3, 6]
    # What the demo's evaluation reads of it: loaded at tp=1 from tensor parallel 2, ZeRO-2.
    rows = demo_evaluate([full_dir], dataset, tmp_path / "evaluation.json")
    assert_pretrained_and_random_rows(rows, "TACO")
    for r in valid:  # the learning monitor's figures (issue 19)
        assert 0 < r["collapse_cosine"] < 0.99, r
        assert 0 < r["mlm_baseline_acc"] < 1 and 0 < r["mpm_baseline_acc"] < 1, r
    assert (full_dir / "tb" / "learning_curve.png").stat().st_size > 0
    # Where the run is, in every train line (issue 30): elapsed, ETA, memory.
    assert all({"elapsed_s", "eta_s", "host_rss_gib"} <= set(full[i]) for i in full)
    assert full[6]["eta_s"] == 0 and " | ETA: 0:00:00 |" in out
    # W&B (offline): the metrics file's scalars at their iterations, the config, the plots;
    # the run id kept in the checkpoints.
    (wb,) = wandb_offline_runs(full_dir / "tb")
    assert wb["name"] == "tp2" and json.loads(wb["config"]["training"])["train_iters"] == 6
    assert sorted(wb["history"]) == [1, 2, 3, 4, 5, 6]
    assert all(wb["history"][i]["train/loss"] == full[i]["loss"] for i in full)
    assert [i for i in wb["history"] if "valid/loss" in wb["history"][i]] == [3, 6]
    assert wb["images"] == {(6, "plots/loss_curve"), (6, "plots/learning_curve")}
    assert meta["callbacks"]["wandb"] == {"run_id": wb["id"]}

    # Resume from the step-3 checkpoint: steps 4-6 must log exactly the same values.
    res = deepspeed(
        "pretrain_taco.py",
        *common_args(dataset, *run_args),
        "--load",
        str(full_dir),
        "--ckpt-step",
        "3",
        "--save",
        str(resumed_dir),
        timeout=900,
    )
    assert f"resumed from {full_dir} at iteration 3 (12 samples consumed)" in res.stdout
    resumed = train_records(resumed_dir / "metrics.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    for it in (4, 5, 6):
        for key in (*TACO_METRIC_KEYS, "lr", "grad_norm", "consumed_samples"):
            assert resumed[it][key] == full[it][key], (it, key)
    # The resumed run continues the W&B run of the checkpoint it resumed from.
    (wb_resumed,) = wandb_offline_runs(resumed_dir)
    assert wb_resumed["id"] == wb["id"] and sorted(wb_resumed["history"]) == [4, 5, 6]
    assert wb_resumed["history"][4]["train/loss"] == resumed[4]["loss"]


def test_plain_python_single_process(dataset, tmp_path):
    empty = tmp_path / "nothing_saved_yet"
    empty.mkdir()
    res = run(
        [
            sys.executable, "pretrain_taco.py",
            *common_args(dataset, "--train-iters", "2", "--eval-iters", "0", "--num-workers", "0"),
            # Megatron's --bf16 over an fp32 JSON: the flag sets the precision.
            "--deepspeed-config", "ds_configs/zero0_fp32.json", "--bf16",
            "--load", str(empty), "--save", str(tmp_path / "ckpt"),
        ],
        timeout=180,
    )  # fmt: skip
    assert "world size 1 = tensor parallel 1 x data parallel 1" in res.stdout
    assert "ZeRO stage 0 | precision bf16" in res.stdout
    # Megatron's behaviour for a --load directory without a tracker file.
    assert "latest_checkpointed_iteration.txt found, training from scratch" in res.stderr
    records = train_records(tmp_path / "ckpt" / "metrics.jsonl")
    assert sorted(records) == [1, 2]
    assert all(set(TACO_METRIC_KEYS) <= set(r) for r in records.values())
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_torchrun_data_parallel(dataset, tmp_path):
    res = run(
        [
            str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()),
            "pretrain_taco.py",
            *common_args(dataset, "--train-iters", "2", "--eval-iters", "0", "--num-workers", "0"),
            "--global-batch-size", "8", "--deepspeed-config", "ds_configs/zero1_bf16.json",
            "--metrics-file", str(tmp_path / "m.jsonl"),
        ],
        timeout=180,
    )  # fmt: skip
    assert "world size 2 = tensor parallel 1 x data parallel 2" in res.stdout
    assert "global batch 8 = micro-batch 2 x grad accumulation 2 x data parallel 2" in res.stdout
    records = train_records(tmp_path / "m.jsonl")
    assert sorted(records) == [1, 2] and records[2]["consumed_samples"] == 16


def test_exit_on_collapse_is_one_line_and_keeps_the_last_checkpoint(dataset, tmp_path):
    # Any real encoder is "collapsed" against a threshold of 1e-9: the flag's path through
    # the driver (parsing, the evaluation before the save, the one-line exit) end to end.
    save = tmp_path / "ckpt"
    res = run(
        [
            sys.executable, "pretrain_taco.py",
            *common_args(dataset, "--train-iters", "4", "--eval-interval", "2",
                         "--eval-iters", "1", "--num-workers", "0"),
            "--deepspeed-config", "ds_configs/zero0_fp32.json", "--save", str(save),
            "--save-interval", "1", "--exit-on-collapse", "--collapse-threshold", "1e-9",
        ],
        timeout=180,
        check=False,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("pretrain_taco.py: error: iteration 4: the encoder has collapsed"), last
    assert "2 evaluations in a row since iteration 2;" in last
    assert "the last checkpoint before iteration 2 is kept" in last
    assert "Traceback" not in res.stderr
    # Saved at 1; the saves at 2 and 3 were held back by the collapse found at 2.
    assert "not saving at iteration 3: the encoder is collapsed" in res.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not any((save / f"iter_000000{i}").exists() for i in (2, 3, 4))
    # A --split whose validation part holds no document of the 46 (found once the datasets
    # are built): one line, not a run in which nothing watches the encoder.
    res = run(
        [
            sys.executable, "pretrain_taco.py",
            *common_args(dataset, "--train-iters", "2", "--eval-iters", "1", "--num-workers", "0",
                         "--split", "1000,1,0"),
            "--deepspeed-config", "ds_configs/zero0_fp32.json", "--exit-on-collapse",
        ],
        timeout=180,
        check=False,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last == (
        "pretrain_taco.py: error: --exit-on-collapse: --split 1000,1,0 leaves no validation "
        "documents in --data-path: nothing would watch the encoder"
    ), res.stderr
    assert "Traceback" not in res.stderr

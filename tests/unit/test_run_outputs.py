"""What a person watching a long run reads, rank 0's outputs (training/observability/log.py and
training/observability/tracking.py): every train line's elapsed time, ETA and memory, in the console line,
the metrics file and TensorBoard alike, and the same records in a real Weights & Biases run
(offline mode: files only), which a resumed run continues under the same id."""

from __future__ import annotations

import json
import re
import time

import pytest

from megatron_taco.training.observability.log import TrainingLogger, _duration, read_metrics
from tests.helpers import wandb_offline_runs


def test_durations_read_as_days_hours_minutes_seconds():
    assert [_duration(s) for s in (0, 59.6, 3600, 93784.4)] == [
        "0:00:00",
        "0:01:00",
        "1:00:00",
        "1-2:03:04",
    ]


def test_train_line_says_elapsed_eta_and_memory_everywhere(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    psutil = pytest.importorskip("psutil")  # an independent reading of the resident set
    logger = TrainingLogger(rank=0, train_iters=100, start_iteration=20, progress_bar=False,
                            tensorboard_dir=str(tmp_path / "tb"),
                            metrics_file=str(tmp_path / "metrics.jsonl"))  # fmt: skip
    logger.log(
        "train", 30, {"consumed_samples": 120, "loss": 1.25, "mlm_tokens": 80.4, "mfu": 0.41}
    )
    rss = psutil.Process().memory_info().rss / 2**30
    logger.log("valid", 30, {"loss": 1.5})
    logger.close()
    train, valid = capsys.readouterr().out.splitlines()
    (record,) = [r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if r["split"] == "train"]
    # The ETA: the 70 iterations left at the pace of the 10 trained since this run started.
    assert record["eta_s"] == pytest.approx(7 * record["elapsed_s"], rel=1e-12)
    assert record["host_rss_gib"] == pytest.approx(rss, rel=0.05)
    assert re.fullmatch(
        r" iteration  30/100 \| elapsed: 0:00:\d\d \| ETA: 0:\d\d:\d\d \| consumed_samples: 120 "
        r"\| loss: 1\.2500 \| mlm_tokens: 80 \| mfu: 0\.4100 \| host_rss_gib: \d+\.\d{4} \|",
        train,
    ), train
    assert valid == " valid at iteration 30 | loss: 1.5000 |"
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for key in ("eta_s", "elapsed_s", "host_rss_gib", "mfu"):
        (scalar,) = events.Scalars(f"train/{key}")
        assert scalar.step == 30 and scalar.value == pytest.approx(record[key], rel=1e-6), key


def test_host_memory_is_the_resident_set_now_not_the_peak(tmp_path):
    # On CPU the current resident set (the CUDA peaks, reset after each line: tests/gpu): a
    # quarter GiB touched shows, and shows no more once freed (ru_maxrss would keep it).
    from megatron_taco.training.observability.log import memory_metrics

    before = memory_metrics()
    block = b"\x01" * 2**28  # every page written
    during = memory_metrics()
    del block
    after = memory_metrics()
    assert set(before) == set(during) == set(after) == {"host_rss_gib"}
    assert during["host_rss_gib"] - before["host_rss_gib"] == pytest.approx(0.25, abs=0.05)
    assert during["host_rss_gib"] - after["host_rss_gib"] == pytest.approx(0.25, abs=0.05)


def _run(tmp_path, run_id=None, name="tiny"):
    from megatron_taco.training.observability.tracking import WandbRun

    return WandbRun(project="taco-tests", name=name, save_dir=str(tmp_path), entity=None,
                    mode="offline", config={"training": {"lr": 1e-3, "train_iters": 30}},
                    run_id=run_id)  # fmt: skip


def test_wandb_gets_the_records_and_a_resume_continues_the_run(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_taco.training.observability.tracking import WandbRunState, saved_run_id

    png = str(tmp_path / "loss_curve.png")
    plt.plot([1, 2, 3])
    plt.savefig(png)
    plt.close()
    run = _run(tmp_path)
    logger = TrainingLogger(rank=0, train_iters=30, progress_bar=False, tracker=run)
    logger.log("train", 10, {"loss": 2.5, "lr": 1e-3, "grad_norm": float("nan")})
    logger.log("train", 20, {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5})
    logger.log("valid", 20, {"loss": 2.25, "collapse_cosine": 0.3})
    logger.image("loss_curve", png, 20)
    state = WandbRunState(run).state_dict()  # what the checkpoint keeps
    logger.close()
    assert state == {"run_id": run.run_id}

    # W&B names an offline run's folder by the second it starts and the run id: a resume
    # within the same second (never a real requeue's) would share the first run's folder.
    time.sleep(1.1)
    resumed = _run(tmp_path, run_id=saved_run_id({"wandb": state}))
    other_rank = TrainingLogger(rank=1, train_iters=30, progress_bar=False, tracker=_Refuses())
    other_rank.log("train", 30, {"loss": 9.0})  # rank 0 only: nothing is sent
    logger = TrainingLogger(rank=0, train_iters=30, start_iteration=20, progress_bar=False,
                            tracker=resumed)  # fmt: skip
    logger.log("train", 30, {"loss": 1.75})
    logger.close()

    # W&B's service process writes the run record of a resumed run's log after finish()
    # has returned, at times (seen under load): read the logs once both are complete.
    deadline = time.monotonic() + 60  # a bound for a loaded machine, not a timing
    while True:
        runs = wandb_offline_runs(tmp_path)
        if (len(runs) == 2 and all(r["id"] for r in runs)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    first, second = runs
    assert first["id"] == second["id"] == state["run_id"] and first["name"] == "tiny"
    assert json.loads(first["config"]["training"]) == {"lr": 1e-3, "train_iters": 30}
    assert sorted(first["history"]) == [10, 20] and sorted(second["history"]) == [30]
    h = first["history"]
    assert (h[10]["train/loss"], h[20]["train/loss"], h[20]["valid/loss"]) == (2.5, 2.0, 2.25)
    assert "train/grad_norm" not in h[10] and h[20]["train/grad_norm"] == 0.5  # NaN dropped
    assert h[20]["valid/collapse_cosine"] == 0.3
    # The progress fields of every train line go to W&B too.
    assert {"train/elapsed_s", "train/eta_s", "train/host_rss_gib"} <= set(h[10])
    assert first["images"] == {(20, "plots/loss_curve")}
    assert second["history"][30]["train/loss"] == 1.75


class _Refuses:
    def log(self, *args):
        raise AssertionError("a rank other than 0 logged to W&B")


def test_wandb_flags_need_a_project_and_the_package(monkeypatch):
    import importlib.util

    from megatron_taco.errors import ConfigError
    from megatron_taco.training.config import TrainingConfig

    with pytest.raises(ConfigError, match="^--wandb-exp-name: needs --wandb-project$"):
        TrainingConfig(train_iters=10, wandb_exp_name="x")
    with pytest.raises(ConfigError, match="^--wandb-mode: must be online, offline or disabled"):
        TrainingConfig(train_iters=10, wandb_project="p", wandb_mode="sometimes")
    t = TrainingConfig(train_iters=10, wandb_project="p")
    assert t.wandb_dir("ckpt") == "ckpt"  # W&B's wandb/ beside the metrics file (in --save)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
    )
    with pytest.raises(ConfigError, match=r"^--wandb-project: the wandb package is not installed"):
        TrainingConfig(train_iters=10, wandb_project="p")


def test_wandb_online_without_an_api_key_is_one_line(tmp_path, monkeypatch):
    # The real library, no credentials anywhere (no key, an empty home): its UsageError
    # becomes one line naming the flag and the ways out, not a traceback from rank 0.
    from megatron_taco.errors import ConfigError
    from megatron_taco.training.observability.tracking import WandbRun

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    with pytest.raises(ConfigError) as e:
        WandbRun(project="taco-tests", name=None, save_dir=str(tmp_path), entity=None,
                 mode="online", config={})  # fmt: skip
    msg = str(e.value)
    assert msg.startswith("--wandb-project: W&B could not start the run: ") and "\n" not in msg
    assert "--wandb-mode offline" in msg


def test_the_wandb_run_id_survives_runs_without_wandb():
    # A checkpoint with no id (a run before W&B, or one without it) opens a new W&B run; an
    # id a resumed run without --wandb-project read stays in the checkpoints it writes, so a
    # later run with W&B continues the same run.
    from megatron_taco.training.callbacks import CallbackList
    from megatron_taco.training.observability.tracking import (
        WANDB_STATE,
        WandbRunState,
        saved_run_id,
    )

    assert saved_run_id({}) is None and saved_run_id({WANDB_STATE: {}}) is None
    assert WandbRunState(None).state_dict() == {}
    without = WandbRunState(None)
    CallbackList([without]).load_state_dict({WANDB_STATE: {"run_id": "abc123"}})
    assert without.state_dict() == {"run_id": "abc123"}
    assert saved_run_id({WANDB_STATE: without.state_dict()}) == "abc123"

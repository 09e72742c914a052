"""pretrain_sas.py as users run it on 2 ranks (forked as torchrun starts them; the kill of
a whole launch through the real `deepspeed` launcher):

* SAS^DA at tensor-parallel 2 saves, and a run resumed from the step-3 checkpoint logs
  exactly the losses of the uninterrupted run;
* SAS with self-augmentation over 3 epochs is killed with SIGKILL in the middle of epoch 2;
  resumed with --load it logs the uninterrupted run's losses, and the replacement store it
  commits is byte-identical to the uninterrupted run's; the finished run extends to a 4th
  epoch, and goes back to a checkpoint three epoch boundaries old;
* the model's inputs, recorded through the real driver, are the committed generation's
  tokens (SAS) or the cold start at a redrawn S (the ablation); the log shows lambda and
  the measured self_augmented per epoch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_taco.training.callbacks import Callback
from tests.helpers import (
    SAS_METRIC_KEYS,
    assert_pretrained_and_random_rows,
    deepspeed_command,
    demo_evaluate,
    kill_when,
    launch,
    train_records,
)

pytestmark = pytest.mark.e2e
SAS_LOGGER = "megatron_taco.recipes.sas"


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
    res = launch("pretrain_sas.py", *run_args, "--save", str(full_dir), world=2)
    out = res.stdout
    assert "megatron_taco: SAS pretraining" in out
    assert "world size 2 = tensor parallel 2 x data parallel 1" in out
    assert "variant: SAS^DA" in out and "train FLOPs (ELECTRA's convention)" in out
    full = train_records(full_dir / "metrics.jsonl")
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert all(set(SAS_METRIC_KEYS) <= set(r) for r in full.values())
    assert {r["rtd_weight"] for r in full.values()} <= {50.0, 87.5, 125.0, 162.5, 200.0}
    assert (full_dir / "loss_curve.png").stat().st_size > 0
    # What the demo's evaluation reads of it: loaded at tp=1 from tensor parallel 2, bf16
    # ZeRO-1 (the fp32 master weights in the optimizer's files).
    rows = demo_evaluate([full_dir], botchan_dataset, tmp_path / "evaluation.json")
    assert_pretrained_and_random_rows(rows, "SAS")

    res = launch(
        "pretrain_sas.py", *run_args, "--load", str(full_dir), "--ckpt-step", "3",
        "--save", str(resumed_dir), world=2,
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


def test_sigkill_mid_epoch_resumes_to_the_same_losses_and_store(botchan_dataset, tmp_path):
    # About 200 instances per epoch at global batch 16: E = 12 or 13 iterations per epoch
    # (the splitter decides); the kill at 16 and the save at 15 fall in epoch 2, the
    # checkpoint at 10 in epoch 1.
    base = sas_args(
        botchan_dataset,
        "--micro-batch-size", "8", "--global-batch-size", "16",
        "--eval-interval", "1000", "--save-interval", "5",
        "--deepspeed-config", "ds_configs/zero0_fp32.json", "--replacement-store-shards", "5",
    )  # fmt: skip
    common = [*base, "--train-epochs", "3"]
    full_dir, crash_dir = tmp_path / "full", tmp_path / "crash"
    launch("pretrain_sas.py", *common, "--save", str(full_dir), world=2, timeout=300)
    full = train_records(full_dir / "metrics.jsonl")
    e = max(i for i, r in full.items() if r["epoch"] == 1)
    assert 10 < e < 15 and sorted(full)[-1] == 3 * e
    assert [full[i]["epoch"] for i in (e, e + 1, 2 * e + 1)] == [1, 2, 3]
    assert full[e + 1]["self_augmented"] == 1.0 and full[e]["self_augmented"] == 0.0
    for it, record in full.items():  # lambda per epoch, read from the training log
        assert record["rtd_weight"] == {1: 50.0, 2: 125.0, 3: 200.0}[record["epoch"]], it

    cmd = deepspeed_command("pretrain_sas.py", *common, "--save", str(crash_dir), "--load",
                            str(crash_dir))  # fmt: skip
    metrics = crash_dir / "metrics.jsonl"  # killed, launcher and ranks, once 16 is logged
    kill_when(cmd, lambda: metrics.is_file() and 16 in train_records(metrics))
    assert (crash_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "15"
    launch("pretrain_sas.py", *common, "--save", str(crash_dir), "--load", str(crash_dir),
           world=2, timeout=300)  # fmt: skip
    resumed = train_records(crash_dir / "metrics.jsonl")
    for it in range(16, 3 * e + 1):
        for key in (*SAS_METRIC_KEYS, "lr", "epoch"):
            assert resumed[it][key] == full[it][key], (it, key)
    a, b = (
        _store_bytes(full_dir / "replacement_store"),
        _store_bytes(crash_dir / "replacement_store"),
    )
    assert sorted(a) == sorted(b) and any(name.endswith("manifest.json") for name in a)
    for name in a:
        assert a[name] == b[name], name

    # The finished run extended by a 4th epoch: it reads generation 2, which the last epoch
    # committed.
    launch("pretrain_sas.py", *base, "--train-epochs", "4", "--save", str(crash_dir),
           "--load", str(crash_dir), world=2, timeout=300)  # fmt: skip
    extended = train_records(crash_dir / "metrics.jsonl")
    assert sorted(extended)[-1] == 4 * e
    for it in range(3 * e + 1, 4 * e + 1):
        assert extended[it]["epoch"] == 4 and extended[it]["self_augmented"] == 1.0, it
        assert extended[it]["rtd_weight"] == 200.0, it
    # Back to the checkpoint at iteration 10, older than three epoch boundaries: the rows
    # generation 0 got before it were kept for it, so epoch 1 commits again, byte-identical.
    launch("pretrain_sas.py", *base, "--save", str(crash_dir), "--load", str(crash_dir),
           "--ckpt-step", "10", "--train-iters", "15", "--lr-decay-iters", str(3 * e),
           world=2, timeout=300)  # fmt: skip
    rewound = train_records(crash_dir / "metrics.jsonl")
    for it in range(11, e + 1):  # epoch 1: the same lambda and learning rates as the full run
        for key in (*SAS_METRIC_KEYS, "lr"):
            assert rewound[it][key] == full[it][key], (it, key)
    again = _store_bytes(crash_dir / "replacement_store" / "gen_00000")
    assert again == _store_bytes(full_dir / "replacement_store" / "gen_00000")


def test_plain_python_unigram_ablation_flags(botchan_dataset, tmp_path):
    """One process, no launcher: the paper's Unif-MLM-RTD^c ablation (cold start in every
    epoch, uniform replacements, constant lambda), no store written; with a lambda warm-up
    of 3 iterations (a departure) run as 2 iterations, an exit, and a resume: lambda is 0
    at logged iterations 1-3 and 50 from 4, across the resume."""
    import sys

    from tests.helpers import run

    args = sas_args(
        botchan_dataset,
        "--micro-batch-size", "16", "--global-batch-size", "16", "--train-epochs", "2",
        "--eval-interval", "1000", "--num-workers", "0", "--no-self-augmentation",
        "--cold-start", "uniform", "--rtd-weight-final", "50", "--rtd-weight-warmup-iters", "3",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
    )  # fmt: skip
    first = run([sys.executable, "pretrain_sas.py", *args, "--exit-interval", "2"])
    assert "0 for the first 3 iterations" in first.stdout
    res = run([sys.executable, "pretrain_sas.py", *args, "--load", str(tmp_path / "ckpt")])
    assert "world size 1 = tensor parallel 1 x data parallel 1" in res.stdout
    assert "cold start uniform" in res.stdout and "no self-augmentation" in res.stdout
    records = train_records(tmp_path / "ckpt" / "metrics.jsonl")
    samples, each = re.search(r"of ([\d,]+) samples \((\d+) iterations each\)", res.stdout).groups()
    assert int(each) == int(samples.replace(",", "")) // 16  # the partial last batch dropped
    assert sorted(records) == list(range(1, 2 * int(each) + 1))
    assert {r["epoch"] for r in records.values()} == {1, 2}
    weights = [records[it]["rtd_weight"] for it in sorted(records)]
    assert weights[:3] == [0.0, 0.0, 0.0] and set(weights[3:]) == {50.0}, weights
    assert {r["self_augmented"] for r in records.values() if "self_augmented" in r} <= {0.0}
    assert not (tmp_path / "ckpt" / "replacement_store").exists()
    # An earlier iteration's weights, as bench_sas_downstream's VARIANT=FOLDER@ITER reads them.
    import torch

    from megatron_taco.recipes.registry import load_pretraining_model

    early, info = load_pretraining_model(str(tmp_path / "ckpt"), ckpt_step=2)
    last, last_info = load_pretraining_model(str(tmp_path / "ckpt"))
    assert (info.iteration, last_info.iteration) == (2, 2 * int(each))
    assert not all(torch.equal(a, b) for a, b in zip(early.state_dict().values(),
                                                     last.state_dict().values()))  # fmt: skip


# ---------------------------------------------------------------------------------------
# What the model reads: the real driver (pretrain_sas's spec on gloo ranks from
# run_distributed), with one extra callback that records every training batch it is given.


class InputRecorder(Callback):
    """Saves, per rank and epoch, the batches the model received (after_micro_batch sees
    exactly the batch the forward pass read)."""

    name = "input_recorder"
    KEYS = ("epoch", "instance_ids", "input_ids", "mlm_labels", "rtd_labels", "replaced_positions")

    def __init__(self, directory: str) -> None:
        self.directory, self.batches = directory, []

    def after_micro_batch(self, trainer, state, batch, outputs) -> None:
        self.batches.append({k: batch[k].cpu().numpy() for k in self.KEYS})

    def on_epoch_end(self, trainer, state, epoch) -> None:
        import numpy as np

        merged = {k: np.concatenate([b[k] for b in self.batches]) for k in self.KEYS}
        np.savez(f"{self.directory}/rank{trainer.parallel.rank}_epoch{epoch}.npz", **merged)
        self.batches = []


def recorded_pretrain(rank: int, world: int, argv: list[str], record_dir: str) -> int:
    import dataclasses

    from megatron_taco.recipes.sas import SPEC, build_sas
    from megatron_taco.training.driver import main

    def build(ctx):
        parts = build_sas(ctx)
        parts.callbacks.append(InputRecorder(record_dir))
        return parts

    return main(dataclasses.replace(SPEC, build=build), argv)


def recorded_epochs(record_dir: Path, epochs: int) -> list[dict]:
    import numpy as np

    out = []
    for epoch in range(epochs):
        parts = [np.load(p) for p in sorted(record_dir.glob(f"rank*_epoch{epoch}.npz"))]
        out.append({k: np.concatenate([p[k] for p in parts]) for k in InputRecorder.KEYS})
    return out


def test_model_reads_the_committed_generation_and_logs_per_epoch_values(
    botchan_dataset, tmp_path, capfd
):
    """SAS on 2 ranks for 3 epochs: in epochs 2 and 3 the model's input at S of every
    instance is that instance's row of the generation committed in the epoch before; in
    epoch 1 the cold start; S never moves. With --drop-replacement-hits a stored token equal
    to the original loses its MLM label, and stays dropped in epoch 3. The log shows lambda
    50, 125, 200 per epoch, self_augmented 0, 1, 1 measured, and a log window closing at
    each epoch boundary."""
    import numpy as np

    from megatron_taco.data.replacement_store import GenerationReader
    from megatron_taco.data.sas_collator import ColdStart, ReplacementConfig, cold_start_probs
    from megatron_taco.data.tokenizer import Tokenizer
    from tests.helpers import run_distributed

    records_dir, save = tmp_path / "inputs", tmp_path / "ckpt"
    records_dir.mkdir()
    argv = sas_args(
        botchan_dataset,
        "--micro-batch-size", "8", "--global-batch-size", "16", "--train-epochs", "3",
        "--log-interval", "5", "--eval-iters", "0", "--save", str(save),
        "--save-interval", "12", "--deepspeed-config", "ds_configs/zero0_fp32.json",
        "--replacement-store-shards", "3", "--drop-replacement-hits",
    )  # fmt: skip
    assert run_distributed(recorded_pretrain, 2, argv, str(records_dir), timeout=600) == [0, 0]
    out = capfd.readouterr().out
    epochs = recorded_epochs(records_dir, 3)
    n = epochs[0]["instance_ids"].shape[0]
    steps = n // 16
    assert f"epochs: 3 of {n} samples ({steps} iterations each)" in out
    assert "lambda per epoch 50, 125, 200" in out
    for e, value in enumerate(("50", "125", "200")):
        assert f" epoch {e + 1}/3: lambda {value}\n" in out

    records = train_records(save / "metrics.jsonl")
    boundaries = [steps, 2 * steps, 3 * steps]
    assert set(boundaries) <= set(records)  # the window closes at every epoch boundary
    for it, r in records.items():
        epoch = -(-it // steps)  # 1-based epoch of iteration it
        assert r["epoch"] == epoch, it
        assert r["rtd_weight"] == {1: 50.0, 2: 125.0, 3: 200.0}[epoch], it
        assert r["self_augmented"] == (0.0 if epoch == 1 else 1.0), it

    tokenizer = Tokenizer(botchan_dataset["tokenizer"])
    probs = cold_start_probs(
        ReplacementConfig(), [botchan_dataset["prefix"]], [1.0], tokenizer.is_special_mask()
    )
    cold = ColdStart(probs, 1234)  # --seed's default
    by_instance = []
    for e, rec in enumerate(epochs):
        ids = rec["instance_ids"]
        assert sorted(ids.tolist()) == list(range(n)), e  # every instance once per epoch
        order = np.argsort(ids)
        by_instance.append({k: v[order] for k, v in rec.items()})
    store = save / "replacement_store"
    dropped = {}  # instance -> its slots dropped in the epoch before
    hits = 0
    for e, rec in enumerate(by_instance):
        rows = GenerationReader(str(store), e - 1).read(np.arange(n)) if e else None
        for i in range(n):
            slots = rec["replaced_positions"][i]
            where = slots[slots >= 0]
            np.testing.assert_array_equal(
                where, by_instance[0]["replaced_positions"][i][: where.size]
            )
            read = rec["input_ids"][i][where]
            expected = rows[i, : where.size] if e else cold.replacements(i, 0, where)
            np.testing.assert_array_equal(read, expected, err_msg=f"epoch {e + 1} instance {i}")
            # The original tokens at S: epoch 1's MLM labels (the cold start drops nothing).
            original = by_instance[0]["mlm_labels"][i][where]
            hit = (read == original) if e else np.zeros(where.size, dtype=bool)
            labels = rec["mlm_labels"][i][where]
            np.testing.assert_array_equal(labels[~hit], original[~hit])
            assert (labels[hit] == -100).all(), (e, i)
            assert hit[dropped.get(i, hit)].all(), (e, i)  # once dropped, dropped for good
            dropped[i], hits = hit, hits + int(hit.sum())
            # Outside S the original text, the same in every epoch.
            outside = np.ones(rec["input_ids"].shape[1], dtype=bool)
            outside[where] = False
            np.testing.assert_array_equal(
                rec["input_ids"][i][outside], by_instance[0]["input_ids"][i][outside]
            )
    assert hits > 0
    # Every epoch committed its generation, the last one's too (a finished run can be
    # extended), and each is kept: the checkpoints at the epoch ends need them all.
    assert all((store / f"gen_{g:05d}" / "manifest.json").is_file() for g in range(3))


def _by_instance(rec: dict) -> dict:
    import numpy as np

    order = np.argsort(rec["instance_ids"])
    return {k: v[order] for k, v in rec.items()}


def test_mlm_cold_start_then_the_models_own_samples_and_exact_resume_across_epochs(
    botchan_dataset, tmp_path
):
    """--cold-start mlm (the reference release) on 2 ranks for 2 epochs: in epoch 1 every
    position of S has its MLM label, ~80% of them read [MASK], the rest a non-special token,
    no token has an RTD label and the logged RTD loss is 0; in epoch 2 S reads the
    generation the model sampled in epoch 1 (no [MASK], no special token: the model's
    softmax, not the cold start) and RTD is back. A run resumed from a checkpoint in the
    middle of epoch 1 (--exit-interval) logs the same losses through the epoch boundary and
    commits the same store, byte for byte."""
    import numpy as np

    from megatron_taco.data.replacement_store import GenerationReader
    from megatron_taco.data.tokenizer import Tokenizer
    from tests.helpers import run_distributed

    def argv(save, *extra):
        return sas_args(
            botchan_dataset,
            "--cold-start", "mlm", "--micro-batch-size", "8", "--global-batch-size", "16",
            "--train-epochs", "2", "--eval-iters", "0", "--save", str(save),
            "--save-interval", "5", "--deepspeed-config", "ds_configs/zero0_fp32.json",
            "--replacement-store-shards", "3", *extra,
        )  # fmt: skip

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    records = tmp_path / "inputs"
    records.mkdir()
    assert run_distributed(recorded_pretrain, 2, argv(full), str(records), timeout=600) == [0, 0]
    epochs = [_by_instance(rec) for rec in recorded_epochs(records, 2)]
    tokenizer = Tokenizer(botchan_dataset["tokenizer"])
    special = tokenizer.is_special_mask()
    n = epochs[0]["instance_ids"].shape[0]
    rows = GenerationReader(str(full / "replacement_store"), 0).read(np.arange(n))
    masks = total = 0
    for i in range(n):
        slots = epochs[0]["replaced_positions"][i]
        where = slots[slots >= 0]
        first, second = epochs[0], epochs[1]
        original = first["mlm_labels"][i][where]
        assert (original >= 0).all() and not special[original].any()
        read = first["input_ids"][i][where]
        is_mask = read == tokenizer.mask_id
        assert not special[read[~is_mask]].any()
        masks, total = masks + int(is_mask.sum()), total + where.size
        assert (first["rtd_labels"][i] == -100).all()
        # Epoch 2: the model's own samples at the same S, RTD labels where they differ.
        sampled = rows[i, : where.size]
        assert not special[sampled].any()
        np.testing.assert_array_equal(second["input_ids"][i][where], sampled)
        np.testing.assert_array_equal(
            second["rtd_labels"][i][where], (sampled != original).astype(np.int64)
        )
    # Binomial(total, 0.8): 5 standard deviations either side.
    sd = (total * 0.8 * 0.2) ** 0.5
    assert abs(masks - 0.8 * total) < 5 * sd, (masks, total)

    logged = train_records(full / "metrics.jsonl")
    steps = n // 16
    for it, r in logged.items():
        if it <= steps:
            assert r["rtd_loss"] == 0.0 and r["rtd_tokens"] == 0, it
        else:
            assert r["rtd_loss"] > 0 and r["rtd_weight"] == 200.0, it

    assert steps > 5  # the exit at iteration 5 is in epoch 1
    for extra in (("--exit-interval", "5"), ("--load", str(resumed))):
        scratch = tmp_path / f"inputs{extra[0]}"
        scratch.mkdir()
        args = argv(resumed, *extra)
        assert run_distributed(recorded_pretrain, 2, args, str(scratch), timeout=600) == [0, 0]
    again = train_records(resumed / "metrics.jsonl")
    assert sorted(again) == list(range(1, 2 * steps + 1))
    for it in again:
        for key in (*SAS_METRIC_KEYS, "lr", "epoch"):
            assert again[it][key] == logged[it][key], (it, key)
    a = _store_bytes(full / "replacement_store")
    b = _store_bytes(resumed / "replacement_store")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name


def test_ablation_redraws_s_per_epoch_and_reports_blended_passes(botchan_dataset, tmp_path, capfd):
    """--no-self-augmentation: S drawn afresh every epoch, the cold start placed there (its
    first 3 iterations from unigram^0.5, --cold-start-warmup-iters). Two
    weighted copies of one dataset (0.8 / 0.2): the banner says how often an epoch sees
    each, with a warning for the one seen less than once. --train-iters ending inside the
    third epoch: a fractional epoch count, lambda 50 then the final 200 from the last whole
    epoch on."""
    import numpy as np

    from megatron_taco.data.sas_collator import (
        ColdStart,
        ReplacementConfig,
        cold_start_probs,
        tempered,
    )
    from megatron_taco.data.tokenizer import Tokenizer
    from tests.helpers import run_distributed

    records_dir, save = tmp_path / "inputs", tmp_path / "ckpt"
    records_dir.mkdir()
    prefix = botchan_dataset["prefix"]
    argv = sas_args(
        botchan_dataset,
        "--data-path", "0.8", prefix, "0.2", prefix,
        "--micro-batch-size", "16", "--global-batch-size", "16", "--train-iters", "60",
        "--no-self-augmentation", "--cold-start-warmup-iters", "3",
        "--log-interval", "7", "--eval-iters", "0",
        "--num-workers", "0", "--save", str(save), "--save-interval", "1000",
        "--deepspeed-config", "ds_configs/zero0_fp32.json",
    )  # fmt: skip
    assert run_distributed(recorded_pretrain, 1, argv, str(records_dir), timeout=600) == [0]
    out, err = capfd.readouterr()
    epochs = recorded_epochs(records_dir, 2)
    n = epochs[0]["instance_ids"].shape[0]
    steps = n // 16
    assert 2 * steps < 60 < 3 * steps, "the run must end inside its third epoch"
    tail = 60 / steps - 2
    assert f"epochs: {60 / steps:.4g} (2 whole + {tail:.2f})" in out
    assert f"lambda per epoch 50, 200, 200 (epoch 3 is {tail:.2f} of an epoch)" in out
    per_pass = [int(x) for x in re.findall(r"passes over its ([\d,]+) samples", out)]
    assert len(per_pass) == 2 and per_pass[0] == per_pass[1]
    passes = [float(x) for x in re.findall(r"instances, ([\d.]+) passes over", out)]
    assert passes == pytest.approx([0.8 * n / per_pass[0], 0.2 * n / per_pass[0]], abs=0.01)
    assert passes[0] > 1 > passes[1]
    assert f"WARNING {SAS_LOGGER}: --data-path: {prefix} is seen {passes[1]:.2f} times" in err
    assert "no self-augmentation (cold start in every epoch, S redrawn per epoch)" in out

    assert "cold start unigram; the first 3 iterations from unigram^0.5" in out
    tokenizer = Tokenizer(botchan_dataset["tokenizer"])
    probs = cold_start_probs(
        ReplacementConfig(), [prefix] * 2, [0.8, 0.2], tokenizer.is_special_mask()
    )
    # The first 3 iterations (48 samples of the stream) draw from unigram^0.5.
    cold = ColdStart(probs, 1234, warmup_probs=tempered(probs, 0.5), warmup_samples=48)
    moved = 0
    first = {}
    for e, rec in enumerate(epochs):
        for i, inst in enumerate(rec["instance_ids"]):  # one rank: row i is sample e * n + i
            slots = rec["replaced_positions"][i]
            where = slots[slots >= 0]
            read = rec["input_ids"][i][where]
            np.testing.assert_array_equal(read, cold.replacements(int(inst), e, where, e * n + i))
            if e == 0:
                first[int(inst)] = set(where.tolist())
            else:
                moved += first[int(inst)] != set(where.tolist())
    assert moved > 0.9 * n  # S redrawn: nearly every instance's S differs from epoch 1's
    records = train_records(save / "metrics.jsonl")
    assert {steps, 2 * steps, 60} <= set(records)
    for it, r in records.items():
        assert r["rtd_weight"] == (50.0 if it <= steps else 200.0), it
        assert "self_augmented" not in r

"""The training engine on real DeepSpeed engines and gloo process groups.

* ZeRO 0/1/2/3 x fp32/bf16 train a small model through the real loop (Trainer), the loss
  goes down, and a run resumed from the checkpoint of step 3 logs exactly (bitwise) the
  losses, learning rates and gradient norms of the uninterrupted run for steps 4-6.
(tp=2 x dp=2 with ZeRO-2 on tiny TACO and SAS, against tp=1: test_tp_dp_training.py.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.checkpoint.layout import TRACKER_FILENAME, TrainingState, rng_state_path
from megatron_taco.checkpoint.load import execute_plan, load_checkpoint
from megatron_taco.checkpoint.plan import ResumeRequest, RunLayout, plan_resume
from megatron_taco.parallel.state import init_parallel
from megatron_taco.training.callbacks import Callback
from megatron_taco.training.config import TrainingConfig
from megatron_taco.training.deepspeed_config import load_deepspeed_json, resolve_deepspeed_config
from megatron_taco.training.engine import initialize_engine
from megatron_taco.training.loop import Trainer
from megatron_taco.training.observability.log import TrainingLogger, read_metrics
from megatron_taco.training.spec import ModelParts
from tests.helpers import run_distributed

REPO = Path(__file__).resolve().parents[2]
DS_CONFIGS = REPO / "ds_configs"
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))

VOCAB, CLASSES, SEQ = 64, 8, 12


class ToyModel(nn.Module):
    """Learnable toy task (predict token % CLASSES) with dropout, so exact resumption needs
    the RNG states, and with biases/LayerNorm, so both weight-decay groups exist."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.norm = nn.LayerNorm(32)
        self.hidden = nn.Linear(32, 32)
        self.dropout = nn.Dropout(0.1)
        self.out = nn.Linear(32, CLASSES)

    def forward(self, batch):
        x = self.dropout(torch.relu(self.hidden(self.norm(self.embed(batch["tokens"])))))
        logits = self.out(x).float()
        labels = batch["tokens"] % CLASSES
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {
            "loss": loss,
            "acc": (logits.argmax(-1) == labels).float().mean(),
            "n_tokens": torch.full((), labels.numel(), device=labels.device),
        }


class ToyDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int):
        rng = np.random.default_rng(index)
        return {"tokens": torch.from_numpy(rng.integers(0, VOCAB, SEQ))}


def toy_collate(samples):
    return {"tokens": torch.stack([s["tokens"] for s in samples])}


@dataclass(frozen=True)
class Run:
    training: TrainingConfig
    checkpoint: CheckpointConfig

    def __getattr__(self, name):  # run.save, run.load, run.metrics_file, run.train_iters...
        source = self.checkpoint if hasattr(self.checkpoint, name) else self.training
        return getattr(source, name)


def _training(tmp: str, **overrides) -> Run:
    values = dict(
        train_iters=6,
        micro_batch_size=4,
        global_batch_size=16,  # 4 x 2 accumulation steps x dp 2
        lr=1e-2,
        lr_warmup_iters=1,
        lr_decay_iters=12,
        log_interval=1,
        eval_interval=3,
        eval_iters=1,
        progress_bar=False,
        metrics_file=os.path.join(tmp, "metrics.jsonl"),
    )
    ckpt = dict(save=os.path.join(tmp, "ckpt"), save_interval=3)
    for name in [k for k in overrides if k in {f.name for f in fields(CheckpointConfig)}]:
        ckpt[name] = overrides.pop(name)
    values.update(overrides)
    return Run(TrainingConfig(**values), CheckpointConfig(**ckpt))


def _run(parallel, run, ds_file, model_seed, state=None, load_step=None, device_type="cpu",
         **task_kwargs):  # fmt: skip
    training = run.training
    settings = resolve_deepspeed_config(
        training, parallel.dp_size, device_type=device_type, ds_json=load_deepspeed_json(ds_file)
    )
    torch.manual_seed(model_seed)
    model = ToyModel()
    engine = initialize_engine(model, training, settings, parallel)
    state = state or TrainingState()
    if load_step is not None:
        state = load_checkpoint(engine.model_engine, run.load, load_step, parallel)
    logger = TrainingLogger(
        rank=parallel.rank,
        train_iters=training.train_iters,
        start_iteration=state.iteration,
        metrics_file=training.metrics_file,
        progress_bar=False,
    )
    parts = ModelParts(
        model=model,
        collate_fn=toy_collate,
        train_dataset=ToyDataset(),
        valid_dataset=ToyDataset(),
        tokens_per_sample=SEQ,
        train_flops=lambda n: 6.0 * n * SEQ * 32 * 32,
        **task_kwargs,
    )
    trainer = Trainer(
        engine, parallel, training, parts, logger, checkpoint=run.checkpoint, seed=7, num_workers=0
    )
    state = trainer.train(state)
    logger.close()
    return engine, state


# Below every step's gradient norm (0.40-0.45), so each config clips every step with the
# norm it computes: a wrong one changes the trajectory (ZeRO-1 bf16 clipping with 0.83x the
# norm moves its losses 2e-4 from ZeRO-2 bf16's; see the comparison below).
ZERO_CLIP = 0.3


def _zero_worker(rank, world_size, tmp, configs, device_type="cpu"):
    """Each config's uninterrupted run and its resumption; ``device_type="cuda"``: the same
    on the GPUs over NCCL (tests/gpu/test_zero_matrix.py)."""
    parallel = init_parallel(1)
    out = {}
    for stage, precision in configs:
        name = f"zero{stage}_{precision}"
        ds_file = str(DS_CONFIGS / f"{name}.json")
        base = os.path.join(tmp, name)
        # Uninterrupted: 6 steps, checkpoints at 3 and 6.
        full = _training(os.path.join(base, "full"), clip_grad=ZERO_CLIP)
        torch.manual_seed(1)  # the dropout stream
        _, state = _run(parallel, full, ds_file, model_seed=0, device_type=device_type)
        assert (state.iteration, state.consumed_samples) == (6, 96)
        # Resumed from step 3 into a model initialised differently, with the RNG elsewhere:
        # everything must come from the checkpoint.
        resumed = _training(
            os.path.join(base, "resumed"),
            load=full.save,
            metrics_file=os.path.join(base, "resumed.jsonl"),
            clip_grad=ZERO_CLIP,
        )
        torch.manual_seed(999)
        _, state = _run(parallel, resumed, ds_file, model_seed=123, load_step=3,
                        device_type=device_type)  # fmt: skip
        assert (state.iteration, state.consumed_samples) == (6, 96)
        if rank == 0:
            out[name] = {
                "full": read_metrics(full.metrics_file),
                "resumed": read_metrics(resumed.metrics_file),
                "files": sorted(os.listdir(os.path.join(full.save, "iter_0000003"))),
                "tracker": Path(full.save, TRACKER_FILENAME).read_text(),
            }
        assert os.path.isfile(rng_state_path(os.path.join(full.save, "iter_0000003"), rank))
    return out


CONFIGS = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]


@pytest.fixture(scope="module")
def zero_results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero"))
    return run_distributed(_zero_worker, 2, tmp, CONFIGS, timeout=600)[0]


def _train_records(records, split="train"):
    return {r["iteration"]: r for r in records if r["split"] == split}


@pytest.mark.parametrize("stage,precision", CONFIGS, ids=[f"zero{s}_{p}" for s, p in CONFIGS])
def test_zero_trains_and_resumes_exactly(zero_results, stage, precision):
    res = zero_results[f"zero{stage}_{precision}"]
    full = _train_records(res["full"])
    resumed = _train_records(res["resumed"])
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert sorted(resumed) == [4, 5, 6]
    assert full[6]["loss"] < full[1]["loss"] - 0.1, [full[i]["loss"] for i in full]
    for it in (4, 5, 6):
        for key in ("loss", "acc", "n_tokens", "lr", "grad_norm", "consumed_samples"):
            assert resumed[it][key] == full[it][key], (it, key, resumed[it][key], full[it][key])
    # Logged values: counts are per iteration over all ranks, lr follows the schedule.
    assert full[1]["n_tokens"] == 16 * SEQ
    assert full[1]["lr"] == 0.0 and full[2]["lr"] == pytest.approx(1e-2)
    assert full[1]["skipped_iterations"] == 0
    assert full[1]["samples_per_s"] > 0 and full[1]["tflops_per_rank"] > 0
    # Evaluation at every --eval-interval, and the same batches each time.
    valid = _train_records(res["full"], "valid")
    assert sorted(valid) == [3, 6]
    assert valid[6]["loss"] < valid[3]["loss"]
    assert "metadata.json" in res["files"] and res["tracker"].strip() == "6"


# ZeRO stages against each other and against ZeRO-0 fp32 (DeepSpeed around torch's AdamW,
# the plain fp32 step), per iteration, on the same batches and dropout masks: relative
# differences of the logged loss and gradient norm (|a - b| / |b|). Iteration 1 runs at lr
# 0, so every fp32 config's first loss is the same forward. fp32 stages differ only in how
# they add (flat buckets, all-reduce or reduce-scatter, partitioned optimizer steps):
# measured on CPU at most 4.6e-8 (loss) and 1.5e-7 (gradient norm), against 1e-5. bf16
# rounds weights, activations and gradients to 8 bits of mantissa (2^-8 = 3.9e-3 per
# rounding): measured at most 1.2e-2 (loss; ZeRO-0 bf16, whose trajectory leaves the
# others' from iteration 3, while ZeRO 1-3 bf16 stay within 1e-3) and 1.4e-2 (gradient
# norm), against 2e-2 and 5e-2. A gradient reduced twice or not averaged over the
# data-parallel ranks doubles the norm; a shard the optimizer skips or a step taken twice
# moves the fp32 losses far beyond 1e-5 from the second applied step on.
ZERO_RTOL = {
    ("fp32", "loss"): 1e-5, ("fp32", "grad_norm"): 1e-5,
    ("bf16", "loss"): 2e-2, ("bf16", "grad_norm"): 5e-2,
}  # fmt: skip
ZERO_KEYS = ("loss", "grad_norm")


def zero_mismatches(full_runs: dict[str, dict[int, dict]], reference: str = "zero0_fp32"):
    """(relative difference, config, iteration, key) beyond ZERO_RTOL for every config's
    train records (iteration -> record) against ``reference``'s, and the largest difference
    per precision and key (for the report)."""
    ref = full_runs[reference]
    bad, largest = [], {}
    for name, records in full_runs.items():
        precision = name.rpartition("_")[2]
        assert sorted(records) == sorted(ref), (name, sorted(records))
        for it, record in records.items():
            for key in ZERO_KEYS:
                want, got = ref[it][key], record[key]
                err = abs(got - want) / abs(want)
                what = f"{precision} {key}"  # a string: the GPU report is JSON
                largest[what] = max(largest.get(what, 0.0), err)
                if not err <= ZERO_RTOL[precision, key]:  # "not <=" also catches NaN
                    bad.append((err, name, it, key))
    return sorted(bad, reverse=True), largest


def _full_runs(zero_results) -> dict[str, dict[int, dict]]:
    return {name: _train_records(res["full"]) for name, res in zero_results.items()}


def test_zero_stages_agree_with_each_other_and_with_fp32(zero_results):
    full = _full_runs(zero_results)
    bad, largest = zero_mismatches(full)
    print(f"largest relative differences from zero0_fp32: {largest}")
    assert not bad, bad[:10]
    # Iteration 1 (lr 0): one forward, the same in every fp32 config.
    assert len({full[f"zero{s}_fp32"][1]["loss"] for s in (0, 1, 2, 3)}) == 1
    # ZeRO-1 bf16 (BF16_Optimizer) and ZeRO-2 bf16 (DeepSpeedZeroOptimizer) sum the same bf16
    # gradients in fp32 and average them in fp32: the same steps, so a tolerance far below
    # bf16's: measured 1.5e-7 on CPU (the two norms' float32 sums). The loop once logged for
    # ZeRO-1 bf16 the norm of one rank's last micro-batch's .grad: 0.17 (and more) off; a clip
    # by 0.83x the norm there moves the losses 2e-4. (In fp32 the same clip error moves them
    # only 7.9e-6, under ZERO_RTOL's 1e-5: Adam undoes most of a gradient's scale.)
    diff = max(
        abs(full["zero1_bf16"][it][key] - want) / abs(want)
        for it, record in full["zero2_bf16"].items()
        for key, want in ((k, record[k]) for k in ZERO_KEYS)
    )
    print(f"ZeRO-1 bf16 against ZeRO-2 bf16: {diff:.2e}")
    assert diff <= 1e-6


def _edge_worker(rank, world_size, tmp):
    from megatron_taco.checkpoint.save import save_checkpoint
    from megatron_taco.errors import ConfigError

    parallel = init_parallel(1)
    training = _training(tmp, lr_decay_style="constant").training
    settings = resolve_deepspeed_config(training, 1, device_type="cpu")
    torch.manual_seed(0)
    engine = initialize_engine(ToyModel(), training, settings, parallel).model_engine

    def resume(load, **flags):  # as the driver does: plan, then load what it names
        request = ResumeRequest(CheckpointConfig(load=load, **flags), RunLayout(1, 1))
        plan = plan_resume(request)
        return execute_plan(engine, plan, request, parallel)[0] if plan.loads else None

    out = {}
    empty = os.path.join(tmp, "empty")
    os.makedirs(empty)
    out["no_tracker"] = resume(empty)
    save = os.path.join(tmp, "ckpt")
    save_checkpoint(engine, save, TrainingState(5, 80), parallel)
    out["saved_files"] = sorted(os.listdir(save)) + sorted(
        os.listdir(os.path.join(save, "iter_0000005"))
    )
    out["latest"] = resume(save)
    out["finetune"] = resume(save, finetune=True)
    out["no_optim"] = resume(save, no_load_optim=True, no_load_rng=True)
    errors = {}
    for name, tracker in (("missing_dir", "7\n"), ("garbage", "release\n")):
        Path(save, TRACKER_FILENAME).write_text(tracker)
        try:
            resume(save)
        except ConfigError as e:
            errors[name] = str(e)
    Path(save, TRACKER_FILENAME).write_text("5\n")
    # A rank whose RNG file is gone (what plan_resume refuses before any process group when
    # the world size changed): the loader names the flag too.
    os.remove(rng_state_path(os.path.join(save, "iter_0000005"), 0))
    try:
        load_checkpoint(engine, save, 5, parallel)
    except ConfigError as e:
        errors["rng"] = str(e)
    out["errors"] = errors
    return out


def test_checkpoint_tracker_and_partial_loads(tmp_path):
    out = run_distributed(_edge_worker, 1, str(tmp_path))[0]
    # No tracker: start from scratch (Megatron); the warning goes to the log.
    assert out["no_tracker"] is None
    assert out["saved_files"] == [
        "iter_0000005",
        TRACKER_FILENAME,
        "metadata.json",
        "mp_rank_00_model_states.pt",
        "rng_state_rank_00000.pt",
    ]  # no temporary files left behind
    assert out["latest"] == TrainingState(5, 80)
    assert out["finetune"] == TrainingState(0, 0)
    assert out["no_optim"] == TrainingState(5, 80)
    missing = out["errors"]["missing_dir"]
    assert missing.startswith("--load:") and str(tmp_path / "ckpt" / "iter_0000007") in missing
    assert TRACKER_FILENAME in missing
    assert "must hold an iteration number" in out["errors"]["garbage"]
    assert "--no-load-rng" in out["errors"]["rng"]


class Recorder(Callback):
    """Records every hook call; its state (a counter) must survive a checkpoint."""

    name = "recorder"

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.micro_batches = 0
        self.loaded = None

    def on_train_start(self, trainer, state):
        self.events.append(("train_start", state.iteration))

    def on_epoch_start(self, trainer, state, epoch):
        self.events.append(("epoch_start", epoch, state.iteration))

    def after_micro_batch(self, trainer, state, batch, outputs):
        assert trainer.model_engine.training, "after_micro_batch must never run during evaluation"
        assert batch["tokens"].shape == (4, SEQ) and outputs["loss"].requires_grad
        self.micro_batches += 1
        # A count the loop sums over the interval and the data-parallel ranks for us.
        outputs["recorded_tokens"] = torch.full(
            (), batch["tokens"].numel(), device=outputs["loss"].device
        )

    def on_epoch_end(self, trainer, state, epoch):
        self.events.append(("epoch_end", epoch, state.iteration))

    def on_save(self, trainer, state):
        self.events.append(("save", state.iteration))

    def metrics(self, sums):
        return {"recorded_micro_batches": float(self.micro_batches),
                "tokens_seen_by_metrics": sums["recorded_tokens"]}  # fmt: skip

    def state_dict(self):
        return {"micro_batches": self.micro_batches}

    def load_state_dict(self, state):
        self.loaded = dict(state)
        self.micro_batches = state["micro_batches"]


def _callbacks_worker(rank, world_size, tmp):
    parallel = init_parallel(1)
    ds_file = str(DS_CONFIGS / "zero1_fp32.json")
    # Global batch 16 (micro 4 x accumulation 2 x dp 2); epochs of 3 iterations.
    full = _training(os.path.join(tmp, "full"), train_iters=7, save_interval=4, eval_interval=2)
    recorder = Recorder()
    torch.manual_seed(1)
    _run(parallel, full, ds_file, 0, samples_per_epoch=48, callbacks=[recorder])
    resumed_cfg = _training(
        os.path.join(tmp, "resumed"), train_iters=7, load=full.save, eval_interval=2
    )
    resumed = Recorder()
    _run(parallel, resumed_cfg, ds_file, 5, load_step=4, samples_per_epoch=48, callbacks=[resumed])
    records = read_metrics(full.metrics_file) if rank == 0 else None
    return recorder.events, recorder.micro_batches, resumed.events, resumed.loaded, records


def test_callbacks_and_epochs_on_a_real_engine(tmp_path):
    events, micro, resumed_events, loaded, records = run_distributed(
        _callbacks_worker, 2, str(tmp_path)
    )[0]
    assert events == [
        ("train_start", 0), ("epoch_start", 0, 0), ("epoch_end", 0, 3), ("epoch_start", 1, 3),
        ("save", 4), ("epoch_end", 1, 6), ("epoch_start", 2, 6), ("save", 7),
    ]  # fmt: skip
    assert micro == 7 * 2  # accumulation steps per iteration, training only
    # Resumed mid-epoch 1 at iteration 4: the saved state comes back, epoch 1 restarts.
    assert loaded == {"micro_batches": 8}
    assert resumed_events[:2] == [("train_start", 4), ("epoch_start", 1, 4)]
    train = {r["iteration"]: r for r in records if r["split"] == "train"}
    assert [train[i]["epoch"] for i in range(1, 8)] == [1, 1, 1, 2, 2, 2, 3]
    assert train[7]["recorded_micro_batches"] == 14
    # Per iteration over both ranks: micro 4 x accumulation 2 x dp 2 rows of SEQ tokens.
    assert train[7]["recorded_tokens"] == train[7]["tokens_seen_by_metrics"] == 16 * SEQ


def _old_value_size_worker(rank, world_size, tmp):
    from megatron_taco.checkpoint.save import save_checkpoint
    from megatron_taco.errors import ConfigError
    from megatron_taco.models.taco.config import TacoConfig
    from megatron_taco.models.taco.model import TacoForPretraining

    parallel = init_parallel(1)
    run = _training(tmp, load=os.path.join(tmp, "ckpt"))
    training = run.training
    settings = resolve_deepspeed_config(training, 1, device_type="cpu")
    # Before the fix every value head was --kv-channels (8 in tiny) wide.
    for value_channels, save in ((8, True), (None, False)):
        config = TacoConfig.preset(
            "tiny", vocab_size=100, we_value_channels=value_channels,
            pe_value_channels=value_channels,
        )  # fmt: skip
        engine = initialize_engine(
            TacoForPretraining(config, parallel), training, settings, parallel
        )
        if save:
            save_checkpoint(engine.model_engine, run.save, TrainingState(3, 12), parallel)
    try:
        load_checkpoint(engine.model_engine, run.load, 3, parallel)
    except ConfigError as e:
        return str(e)
    return None


def test_checkpoint_of_another_shape_is_one_clear_error(tmp_path):
    message = run_distributed(_old_value_size_worker, 1, str(tmp_path))[0]
    assert message is not None and "\n" not in message
    assert "iter_0000003 was saved by a model of another shape" in message
    assert "taco.layers.0.attention.qkv_we.weight is torch.Size([96, 48]) there" in message
    assert "torch.Size([112, 48]) here" in message and "--we-value-channels" in message

"""The training loop's end-of-iteration checks, on real DeepSpeed engines in real gloo
process groups:

* a non-finite gradient norm with a finite loss stops every rank before the step is saved
  where DeepSpeed applies such a step (ZeRO-0 fp32), and counts as a skipped iteration where
  DeepSpeed skips it (ZeRO-1 fp32);
* an exit request is acted on before the iteration's validation and periodic save;
* the exit flags travel in one all-reduce per iteration, on the host; the non-finite flags
  and gradient norms stay on the device until a step that logs, saves, evaluates or exits.
"""

from __future__ import annotations

import os
import re
import signal
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_taco.checkpoint.layout import TRACKER_FILENAME, TrainingState
from megatron_taco.models.common.monitoring import monitoring_outputs
from megatron_taco.training.config import TrainingConfig
from tests.helpers import run_distributed

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
VOCAB, SEQ = 64, 12


class _InfGrad(torch.autograd.Function):
    """Identity forward, infinite gradient backward: a finite loss whose step is not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.out = nn.Linear(16, 8)
        self.poison_grad = False
        self.collapsed = False  # eval-mode vectors: one vector for every token

    def forward(self, batch):
        hidden = self.embed(batch["tokens"])
        if self.poison_grad:
            hidden = _InfGrad.apply(hidden)
        logits = self.out(hidden)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), (batch["tokens"] % 8).flatten())
        if self.training:
            return {"loss": loss}
        vectors = torch.ones_like(hidden) if self.collapsed else hidden
        return {"loss": loss, **monitoring_outputs(vectors, torch.ones_like(batch["tokens"]))}


class ToyDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int):
        return {"tokens": torch.from_numpy(np.random.default_rng(index).integers(0, VOCAB, SEQ))}


def _collate(samples):
    return {"tokens": torch.stack([s["tokens"] for s in samples])}


def _trainer(parallel, tmp, stage, *, exit_monitor=None, callbacks=(), valid=None,
             learning_monitor=None, collate=_collate, train=None, num_workers=0,
             **kw):  # fmt: skip
    from megatron_taco.checkpoint.config import CheckpointConfig
    from megatron_taco.training.deepspeed_config import (
        load_deepspeed_json,
        resolve_deepspeed_config,
    )
    from megatron_taco.training.engine import initialize_engine
    from megatron_taco.training.loop import Trainer
    from megatron_taco.training.observability.log import TrainingLogger
    from megatron_taco.training.spec import ModelParts

    values = dict(
        train_iters=5,
        micro_batch_size=2,
        global_batch_size=2 * parallel.dp_size,
        lr=1e-2,
        lr_warmup_iters=1,
        log_interval=1,
        eval_iters=0,
        progress_bar=False,
    )
    ckpt = {"save": os.path.join(tmp, "ckpt")}
    for key in ("save", "save_interval", "save_retain"):
        if key in kw:
            ckpt[key] = kw.pop(key)
    values.update(kw)
    training = TrainingConfig(**values)
    checkpoint = CheckpointConfig(**ckpt)
    ds_json = load_deepspeed_json(str(REPO / "ds_configs" / f"zero{stage}_fp32.json"))
    settings = resolve_deepspeed_config(training, parallel.dp_size, device_type="cpu",
                                        ds_json=ds_json)  # fmt: skip
    torch.manual_seed(0)
    engine = initialize_engine(ToyModel(), training, settings, parallel)
    logger = TrainingLogger(rank=parallel.rank, train_iters=training.train_iters,
                            progress_bar=False)  # fmt: skip
    parts = ModelParts(
        model=engine.model_engine.module,
        collate_fn=collate,
        train_dataset=train or ToyDataset(),
        valid_dataset=valid,
        callbacks=list(callbacks),
    )
    trainer = Trainer(
        engine,
        parallel,
        training,
        parts,
        logger,
        checkpoint=checkpoint,
        seed=1,
        exit_monitor=exit_monitor,
        learning_monitor=learning_monitor,
        num_workers=num_workers,
    )
    return trainer, logger


def _listing(path: str) -> list[str]:
    if not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path) if n.startswith(("iter_", TRACKER_FILENAME)))


# ---------------------------------------------------------------------------------------
# 1. A non-finite gradient norm with a finite loss


def _grad_worker(rank, world_size, tmp, stage, overrides=None):
    from megatron_taco.parallel.state import init_parallel
    from megatron_taco.training.callbacks import Callback
    from megatron_taco.training.loop import NonFiniteLossError

    parallel = init_parallel(1)
    holder = {}

    class PoisonGrad(Callback):
        name = "poison"

        def on_step_start(self, trainer, state):
            # Iteration 3 on rank 1 only: its gradient is infinite, its loss finite.
            holder["model"].poison_grad = state.iteration == 2 and parallel.rank == 1

        def after_micro_batch(self, trainer, state, batch, outputs):
            if state.iteration == 2:  # the poisoned iteration 3
                holder["losses"].append(float(outputs["loss"]))

    kw = {"save_interval": 1, **(overrides or {})}
    trainer, logger = _trainer(parallel, tmp, stage, callbacks=[PoisonGrad()], **kw)
    holder.update(model=trainer.model_engine.module, losses=[])
    records = []
    real_log = logger.log
    logger.log = lambda split, it, metrics: (records.append((split, it, metrics)),
                                             real_log(split, it, metrics))  # fmt: skip
    error = None
    try:
        trainer.train(TrainingState())
    except NonFiniteLossError as e:
        error = str(e)
    finally:
        logger.close()
    skipped = {it: m.get("skipped_iterations") for split, it, m in records if split == "train"}
    finite = all(np.isfinite(holder["losses"]))
    return error, _listing(trainer.checkpoint.save), skipped, finite


def test_non_finite_gradient_norm_stops_every_rank_before_the_step_is_saved(tmp_path):
    # ZeRO-0 fp32: DeepSpeed applies a step with an infinite gradient norm.
    results = run_distributed(_grad_worker, 2, str(tmp_path), 0)
    (msg0, listing, _, finite), (msg1, *_) = results
    assert finite  # iteration 3's loss itself was finite
    # Saved after iterations 1 and 2; the step with the infinite gradient was never saved.
    assert listing == ["iter_0000001", "iter_0000002", TRACKER_FILENAME]
    assert msg0 == msg1 and msg0 is not None, results
    assert msg0.startswith("iteration 3: non-finite gradient norm in fp32 training"), msg0


def test_non_finite_gradient_norm_is_found_at_the_next_read(tmp_path):
    # Iterations 1-4 neither log nor save (--log-interval 5): their flags and norms stay on
    # the device; the read at iteration 5 still names iteration 3, and nothing was saved.
    overrides = {"save_interval": None, "log_interval": 5}
    results = run_distributed(_grad_worker, 2, str(tmp_path), 0, overrides)
    (msg0, listing, _, finite), (msg1, *_) = results
    assert finite and listing == []
    assert msg0 == msg1 and msg0 is not None, results
    assert msg0.startswith("iteration 3: non-finite gradient norm in fp32 training"), msg0


def test_a_step_deepspeed_skips_is_counted_and_training_goes_on(tmp_path):
    # ZeRO-1 fp32: DeepSpeed's optimizer skips a step whose gradient norm is not finite.
    (msg, listing, skipped, _), _ = run_distributed(_grad_worker, 2, str(tmp_path), 1)
    assert msg is None
    assert skipped == {1: 0, 2: 0, 3: 1, 4: 0, 5: 0}
    assert listing[-1] == TRACKER_FILENAME and len(listing) == 6


# ---------------------------------------------------------------------------------------
# issue 27 item 5. A SAS store row that changed on disk, read mid-epoch by one rank (in its
# DataLoader worker): the same one line on every rank, before that step is saved


N_INSTANCES = 16


class SasSamples(torch.utils.data.Dataset):
    """Instances of an epoch that reads the store (epoch 1): sample i is instance i mod N."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int):
        tokens = np.random.default_rng(index % N_INSTANCES).integers(5, VOCAB, SEQ)
        tokens[0], tokens[-1] = 2, 3  # [CLS], [SEP]
        special = np.zeros(SEQ, dtype=bool)
        special[[0, -1]] = True
        return dict(tokens=tokens, length=SEQ, special=special, word_starts=np.ones(SEQ, bool),
                    index=index % N_INSTANCES, epoch=1)  # fmt: skip


class SasToyCollate:
    """The real SAS collator over the real store (StoreSource); the toy model reads tokens."""

    def __init__(self, collator) -> None:
        self.collator = collator

    def __call__(self, samples):
        batch = self.collator(samples)
        return {**batch, "tokens": batch["input_ids"]}


def _store_layout():
    from megatron_taco.data.replacement_store import StoreLayout
    from megatron_taco.data.sas_collator import ReplacementConfig

    width = ReplacementConfig().width(SEQ)
    return StoreLayout(num_instances=N_INSTANCES, width=width, vocab_size=VOCAB, num_shards=2)


def _corrupt_row_worker(rank, world_size, tmp, root):
    from megatron_taco.data.sas_collator import ColdStart, ReplacementConfig, SasCollator
    from megatron_taco.errors import RunError
    from megatron_taco.parallel.state import init_parallel
    from megatron_taco.recipes.sas_augmentation import StoreSource

    parallel = init_parallel(1)
    probs = np.r_[np.zeros(5), np.full(VOCAB - 5, 1.0 / (VOCAB - 5))]
    source = StoreSource(ColdStart(probs, 1), root)
    collate = SasToyCollate(SasCollator(pad_id=0, seq_length=SEQ, seed=1,
                                        config=ReplacementConfig(), source=source))  # fmt: skip
    trainer, logger = _trainer(parallel, tmp, 0, collate=collate, train=SasSamples(),
                               num_workers=1, save_interval=1)  # fmt: skip
    error = None
    try:
        trainer.train(TrainingState())
    except RunError as e:
        error = str(e)
    finally:
        logger.close()
    save = trainer.checkpoint.save
    return error, _listing(save) if os.path.isdir(save) else []


def test_a_store_row_changed_on_disk_read_by_one_rank_stops_every_rank_with_its_line(tmp_path):
    """Iteration 3's global batch is instances 8-11: rank 1 reads 10 and 11, rank 0 never
    reads instance 10, whose row is changed on disk (a valid id: only its checksum knows).
    Before: a DataLoader traceback on rank 1, rank 0 waiting in the next collective."""
    from megatron_taco.data.replacement_store import GenerationWriter, commit_generation

    root, layout = tmp_path / "store", _store_layout()
    rows = np.random.default_rng(3).integers(5, VOCAB, (N_INSTANCES, layout.width))
    with GenerationWriter(str(root), 0, layout, [0, 1]) as writer:
        writer.write(np.arange(N_INSTANCES), rows)
    commit_generation(str(root), 0, layout)
    shard, row = divmod(10, layout.rows_per_shard)
    path = root / "gen_00000" / layout.shard_file(shard)
    with open(path, "r+b") as f:
        f.seek(row * layout.record_bytes)
        f.write(np.array([rows[10, 0] % (VOCAB - 1) + 1], dtype=layout.dtype).tobytes())
    results = run_distributed(_corrupt_row_worker, 2, str(tmp_path), str(root))
    line = (
        f"iteration 3, rank 1: --replacement-store: {path}: row {row} (instance 10) does not "
        "match the checksum written with it (the shard changed on disk after the row was "
        "written); every rank stopped without saving this iteration (the last checkpoint is "
        "kept)"
    )
    assert results == [(line, ["iter_0000001", "iter_0000002", TRACKER_FILENAME])] * 2


# ---------------------------------------------------------------------------------------
# 8. The exit request comes before the iteration's validation and periodic save
# issue 16 item 6, issue 28 item 2. One all-reduce per iteration for the exit requests, on
# the host; the non-finite checks at the steps that log, save, evaluate or exit


def _exit_worker(rank, world_size, tmp):
    from megatron_taco.parallel.state import init_parallel
    from megatron_taco.training.callbacks import Callback
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor

    parallel = init_parallel(1)
    monitor = ExitMonitor(ExitConfig())

    class Signal(Callback):
        name = "signal"

        def after_micro_batch(self, trainer, state, batch, outputs):
            if state.iteration == 3 and parallel.rank == 1:  # during iteration 4
                monitor.received = int(signal.SIGTERM)

    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        # The frame that called parallel/comm.py, the package's one caller of collectives.
        caller = traceback.extract_stack(limit=3)[0]
        if os.sep + os.path.join("megatron_taco", "training") in caller.filename:
            calls.append((os.path.basename(caller.filename), caller.name))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    trainer, logger = _trainer(parallel, tmp, 1, exit_monitor=monitor, callbacks=[Signal()],
                               train_iters=8, log_interval=100, eval_iters=1, eval_interval=4,
                               save_interval=4, valid=ToyDataset())  # fmt: skip
    evaluated, saved = [], []
    trainer.evaluate = lambda split, dataset, it: evaluated.append(it) or {}
    real_save = trainer.save
    trainer.save = lambda state, **kw: saved.append(state.iteration) or real_save(state, **kw)
    try:
        state = trainer.train(TrainingState())
    finally:
        dist.all_reduce = real
        logger.close()
    return state.iteration, evaluated, saved, calls


def test_exit_before_validation_and_one_all_reduce_per_iteration(tmp_path):
    results = run_distributed(_exit_worker, 2, str(tmp_path))
    for stopped, evaluated, saved, calls in results:
        assert stopped == 4
        assert evaluated == []  # iteration 4's validation never ran
        assert saved == [4]  # one save, the exit's
        # Four iterations, one all-reduce of the host flags (data fault, exit requests) each;
        # the device's flags and gradient norms once, at iteration 4 (the exit's save reads
        # them first): no log line, save or validation was due before.
        assert calls == [("loop.py", "_agree_on_host")] * 4 + [("loop.py", "_read")], calls


# ---------------------------------------------------------------------------------------
# issue 27 item 9. Rank 0's file-system work (here the clean-up after a save's tracker, held
# 12 s by the documented MEGATRON_TACO_TEST_PAUSE_AT) is waited for outside the collectives'
# timeout (5 s here); an exit's save leaves its clean-up to the next save and says so


def _slow_cleanup_worker(rank, world_size, tmp):
    from datetime import timedelta

    from megatron_taco.parallel.state import init_parallel
    from megatron_taco.runtime.faults import PAUSE_ENV
    from megatron_taco.training.callbacks import Callback
    from megatron_taco.training.resilience.exit import ExitConfig, ExitMonitor

    parallel = init_parallel(1)
    monitor = ExitMonitor(ExitConfig())
    os.environ[PAUSE_ENV] = "after_tracker@2:12"  # read by rank 0, which finalizes

    class SlowFileSystem(Callback):
        name = "slow"

        def on_save(self, trainer, state):
            if state.iteration == 2:
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=5), None)

        def on_step_start(self, trainer, state):
            # Only around that save: elsewhere a loaded machine may hold a rank that long.
            dist.distributed_c10d._set_pg_timeout(timedelta(minutes=30), None)

        def after_micro_batch(self, trainer, state, batch, outputs):
            if state.iteration == 3 and parallel.rank == 1:  # during iteration 4
                monitor.received = int(signal.SIGTERM)

    trainer, logger = _trainer(parallel, tmp, 0, exit_monitor=monitor, callbacks=[SlowFileSystem()],
                               train_iters=8, save_interval=1, save_retain=1)  # fmt: skip
    lines = []
    real_print = logger.print
    logger.print = lambda text: (lines.append(text), real_print(text))
    try:
        state = trainer.train(TrainingState())
        after_exit = _listing(trainer.checkpoint.save)
        trainer.exiting, state.iteration = None, 5  # the next save (the resumed run's)
        trainer.save(state)
    finally:
        logger.close()
    exits = [line for line in lines if "exiting at" in line]
    return after_exit, _listing(trainer.checkpoint.save), exits


def test_rank0_file_work_outlasting_the_collective_timeout_and_an_exit_that_defers_it(tmp_path):
    results = run_distributed(_slow_cleanup_worker, 2, str(tmp_path))
    (after_exit, after_next, exits), _ = results
    # Retention (--save-retain 1) ran after the saves of 1-3 (the slow one included); the
    # exit's save at 4 left it to the next save, which removed 3.
    assert after_exit == ["iter_0000003", "iter_0000004", TRACKER_FILENAME]
    assert after_next == ["iter_0000005", TRACKER_FILENAME]
    assert len(exits) == 1 and re.fullmatch(
        r" exiting at iteration 4: .*; saving a checkpoint \(\d+\.\ds last time\); removing "
        r"old checkpoints and leftovers is left to the next save",
        exits[0],
    ), exits


# ---------------------------------------------------------------------------------------
# A run's output: DeepSpeed's deprecated all_gather_into_tensor warns nothing


def _gather_worker(rank, world_size, tmp):
    import warnings

    from megatron_taco.parallel.state import init_parallel

    parallel = init_parallel(1)
    # Where DeepSpeed would JIT-compile an op (make demo, make test and make bench share
    # build/torch_extensions): on this CPU path nothing is compiled at all.
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(tmp, f"ext{rank}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        _trainer(parallel, tmp, 1)  # initialize_engine
        out = torch.zeros(2 * world_size)
        dist.all_gather_into_tensor(out, torch.ones(2))  # what DeepSpeed's ZeRO calls
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    return future, os.path.exists(os.environ["TORCH_EXTENSIONS_DIR"])


def test_no_future_warning_and_no_op_compiled_by_an_engine(tmp_path):
    assert run_distributed(_gather_worker, 2, str(tmp_path)) == [([], False), ([], False)]


# ---------------------------------------------------------------------------------------
# issue 19 item 2. --exit-on-collapse: saves are held back from the first collapsed
# evaluation, the run stops at the second in a row; the last good checkpoint is kept


def _collapse_worker(rank, world_size, tmp):
    from megatron_taco.parallel.state import init_parallel
    from megatron_taco.training.callbacks import Callback
    from megatron_taco.training.observability.monitor import (
        CollapseError,
        LearningMonitor,
        LearningMonitorConfig,
    )

    parallel = init_parallel(1)
    lines = []
    monitor = LearningMonitor(LearningMonitorConfig(exit_on_collapse=True), 0, lines.append)

    class Collapse(Callback):
        name = "collapse"

        def after_micro_batch(self, trainer, state, batch, outputs):
            # From iteration 5 on, one vector for every token (on every rank).
            trainer.model_engine.module.collapsed = state.iteration >= 4

    trainer, logger = _trainer(parallel, tmp, 1, callbacks=[Collapse()], learning_monitor=monitor,
                               train_iters=8, eval_iters=4, eval_interval=2, save_interval=2,
                               valid=ToyDataset())  # fmt: skip
    seen = []
    real_log = logger.log
    logger.log = lambda split, it, m: (seen.append((split, it, m.get("collapse_cosine"))),
                                       real_log(split, it, m))  # fmt: skip
    error = None
    try:
        trainer.train(TrainingState())
    except CollapseError as e:
        error = str(e)
    finally:
        logger.close()
    return error, _listing(trainer.checkpoint.save), [s for s in seen if s[0] == "valid"]


def test_exit_on_collapse_stops_before_the_collapsed_iteration_is_saved(tmp_path):
    results = run_distributed(_collapse_worker, 2, str(tmp_path))
    (error, listing, valid), (error1, _, valid1) = results
    assert error == error1 and error.startswith("iteration 8: the encoder has collapsed"), error
    assert "since iteration 6" in error
    # Saved at 2 and 4; iteration 6's save held back (collapsed), 8's evaluation stopped it.
    assert listing == ["iter_0000002", "iter_0000004", TRACKER_FILENAME]
    assert [it for _, it, _ in valid] == [2, 4, 6, 8]
    cosines = [c for _, _, c in valid]
    assert cosines == [c for _, _, c in valid1]  # reduced: the same figure on every rank
    assert cosines[0] < 0.5 and cosines[2] == pytest.approx(1.0), cosines


def _collapse_resume_worker(rank, world_size, tmp):
    """An exit (--exit-interval) at the first collapsed evaluation still saves (it is what the
    run resumes from); the resumed run goes on counting the streak and stops at the next."""
    from megatron_taco.checkpoint.layout import read_tracker
    from megatron_taco.checkpoint.load import load_checkpoint
    from megatron_taco.parallel.state import init_parallel
    from megatron_taco.training.callbacks import Callback
    from megatron_taco.training.observability.monitor import (
        CollapseError,
        LearningMonitor,
        LearningMonitorConfig,
    )

    parallel = init_parallel(1)

    class Collapse(Callback):
        name = "collapse"

        def after_micro_batch(self, trainer, state, batch, outputs):
            trainer.model_engine.module.collapsed = (
                state.iteration >= 4
            )  # collapsed from iteration 5

    def trainer_for(**kw):
        lines = []
        monitor = LearningMonitor(LearningMonitorConfig(exit_on_collapse=True), 0, lines.append)
        trainer, logger = _trainer(parallel, tmp, 1, callbacks=[Collapse()], train_iters=8,
                                   learning_monitor=monitor, eval_iters=4, eval_interval=2,
                                   save_interval=2, valid=ToyDataset(), **kw)  # fmt: skip
        printed = []
        real_print = logger.print
        logger.print = lambda line: (printed.append(line), real_print(line))
        return trainer, logger, lines, printed

    first, logger, lines, printed = trainer_for(exit_interval=6)
    try:
        end = first.train(TrainingState())
    finally:
        logger.close()
    listing = _listing(first.checkpoint.save)
    second, logger, _, _ = trainer_for()
    save = second.checkpoint.save
    state = load_checkpoint(second.model_engine, save, read_tracker(save), parallel)
    error = None
    try:
        second.train(state)
    except CollapseError as e:
        error = str(e)
    finally:
        logger.close()
    exit_line = [p for p in printed if "exiting" in p]
    return end.iteration, listing, state.callback_states, exit_line, error


def test_a_collapse_streak_survives_an_exit_and_its_resume(tmp_path):
    results = run_distributed(_collapse_resume_worker, 2, str(tmp_path))
    end, listing, states, exit_line, error = results[0]
    assert results[1][4] == error
    assert end == 6
    # 6's periodic save held back, the exit's made (else a restart repeats 4..6 forever).
    assert listing == ["iter_0000002", "iter_0000004", "iter_0000006", TRACKER_FILENAME]
    assert states["learning_monitor"] == {"streak": 1, "first_collapsed": 6}
    assert len(exit_line) == 1 and "collapsed since iteration 6" in exit_line[0], exit_line
    assert error is not None and error.startswith("iteration 8: the encoder has collapsed"), error
    assert "2 evaluations in a row since iteration 6" in error

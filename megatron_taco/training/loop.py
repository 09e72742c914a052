"""The training loop: model-agnostic, for any ``forward(batch) -> dict`` with a scalar "loss".

Logged values: every 0-d tensor the model returns. Keys ending in ``_tokens`` are counts,
summed over micro-batches and data-parallel ranks and reported per iteration; every other
key (losses, accuracies) is averaged over the micro-batches of the logging interval and
over the data-parallel ranks. Tensor-parallel ranks compute identical values and are not
reduced over. Non-scalar outputs (e.g. SAS's MLM logits for its sampler) are left to
the callbacks (callbacks.py), which see every training micro-batch and its outputs.

Epochs: a task that defines ``samples_per_epoch`` (a multiple of the global batch size) is
trained epoch by epoch; each epoch gets its own data iterator, created only after the
previous epoch ended and its callbacks ran, so nothing prefetched reads across the boundary.
A log interval never spans two epochs: the last iteration of an epoch is always logged.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.checkpoint.layout import TrainingState
from megatron_taco.checkpoint.save import save_checkpoint
from megatron_taco.data.sampler import PretrainingSampler
from megatron_taco.errors import RunError
from megatron_taco.model_outputs import COUNT_SUFFIX, DATA_FAULT
from megatron_taco.parallel import comm
from megatron_taco.parallel.random import RNGTracker
from megatron_taco.parallel.state import ParallelState
from megatron_taco.training.callbacks import CallbackList
from megatron_taco.training.config import TrainingConfig
from megatron_taco.training.engine import (
    Engine,
    gradient_norm,
    reports_grad_norm,
    to_device,
    unscaled_grad_norm,
)
from megatron_taco.training.observability.log import TrainingLogger
from megatron_taco.training.observability.monitor import EvaluationStatistics, LearningMonitor
from megatron_taco.training.observability.peaks import device_peak, mfu
from megatron_taco.training.resilience.exit import ExitMonitor
from megatron_taco.training.spec import ModelParts


class NonFiniteLossError(RunError):
    pass


class DataFaultError(RunError):
    pass


def is_loss_key(key: str) -> bool:
    return key == "loss" or key.endswith("_loss")


class MetricAccumulator:
    """Sums of the model's scalar outputs; reduced over the data-parallel group on demand
    (one all-reduce per log, no host sync per micro-batch)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.micro_batches = 0

    def add(self, outputs: dict[str, Any]) -> None:
        for key, value in outputs.items():
            if torch.is_tensor(value) and value.dim() == 0:
                v = value.detach().reshape(()).to(torch.float64)
                self.sums[key] = self.sums[key] + v if key in self.sums else v
        self.micro_batches += 1

    def reduced(self, parallel: ParallelState) -> torch.Tensor | None:
        """The sums and the micro-batch count, reduced over the data-parallel group, still on
        the device (None: nothing added); ``finish`` turns their host values into metrics."""
        if self.micro_batches == 0:
            return None
        keys = sorted(self.sums)
        device = self.sums[keys[0]].device
        totals = torch.stack(
            [self.sums[k] for k in keys]
            + [torch.full((), float(self.micro_batches), dtype=torch.float64, device=device)]
        )
        if dist.is_initialized() and parallel.dp_size > 1:
            # gloo and nccl both reduce float64.
            comm.all_reduce(totals, parallel.get_data_parallel_group())
        return totals

    def finish(self, values: list[float], iterations: int) -> dict[str, float]:
        *totals, micro_batches = values
        return {
            key: total / (max(iterations, 1) if key.endswith(COUNT_SUFFIX) else micro_batches)
            for key, total in zip(sorted(self.sums), totals)
        }

    def reduce(self, parallel: ParallelState, iterations: int) -> dict[str, float]:
        totals = self.reduced(parallel)
        return {} if totals is None else self.finish(totals.tolist(), iterations)


def evaluate_batches(model, batches, parallel: ParallelState, iterations: int) -> dict[str, float]:
    """A model's evaluation over ``batches`` (it must be in eval mode): its scalar outputs
    averaged as training logs them, and monitor.py's collapse and baseline figures, over
    every data-parallel rank. ``iterations``: global batches evaluated (for the counts)."""
    acc, stats = MetricAccumulator(), EvaluationStatistics()
    with torch.no_grad():
        for batch in batches:
            outputs = model(batch)
            acc.add(outputs)
            stats.add(outputs)
    metrics = acc.reduce(parallel, iterations=iterations)
    metrics.update(stats.reduce(parallel))
    return metrics


@dataclass
class _Step:
    """One optimizer step's end-of-step values, kept where they are until the next read."""

    iteration: int
    loss_keys: list[str]  # the losses checked (none in fp16: an overflow is a skipped step)
    loss_flags: torch.Tensor | None  # on the device: 1.0 where a window's loss sum is not finite
    norm: torch.Tensor | float | None  # None: a skipped step


class _Interval:
    """What the loop accumulates between two log lines, and the steps not yet read."""

    def __init__(self) -> None:
        self.acc = MetricAccumulator()
        self.iterations = self.skipped = 0
        self.seconds = 0.0
        self.grad_norms: list[float] = []
        self.unread: list[_Step] = []

    def add(self, step: _Step, skipped: bool) -> None:
        self.iterations += 1
        self.skipped += int(skipped)
        self.unread.append(step)

    def mean_grad_norm(self) -> float:
        return sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else float("nan")


class Trainer:
    def __init__(
        self,
        engine: Engine,
        parallel: ParallelState,
        training: TrainingConfig,
        parts: ModelParts,
        logger: TrainingLogger,
        *,
        checkpoint: CheckpointConfig | None = None,
        seed: int,
        num_workers: int = 0,
        rng_tracker: RNGTracker | None = None,
        checkpoint_metadata: dict[str, Any] | None = None,
        exit_monitor: ExitMonitor | None = None,
        learning_monitor: LearningMonitor | None = None,
    ) -> None:
        self.engine = engine
        self.model_engine = engine.model_engine
        self.parallel = parallel
        self.training = training
        self.parts = parts
        self.checkpoint = checkpoint or CheckpointConfig()  # none: nothing saved
        self.logger = logger
        self.seed = seed
        self.num_workers = num_workers
        self.rng_tracker = rng_tracker
        self.checkpoint_metadata = checkpoint_metadata
        self.exit_monitor = exit_monitor
        self.learning_monitor = learning_monitor
        self.global_batch_size = engine.settings.global_batch_size
        # The data sheet's dense peak for this device and precision (None: no MFU logged).
        self.device_peak = device_peak(engine.device, engine.settings.precision)
        self.grad_accum_steps = engine.settings.grad_accum_steps
        self.last_saved_iteration: int | None = None
        # The reason to exit once an exit is under way (callbacks defer what can wait), and
        # how long the last save and the last epoch's end took (what an exit will take).
        self.exiting: str | None = None
        self.save_seconds: float | None = None
        self.epoch_end_seconds: float | None = None
        # The learning monitor is a callback for its state (its collapse streak) only.
        extra = [learning_monitor] if learning_monitor is not None else []
        self.callbacks = CallbackList([*parts.callbacks, *extra])
        spe = parts.samples_per_epoch
        if spe is not None and (spe <= 0 or spe % self.global_batch_size):
            raise ValueError(
                f"samples_per_epoch {spe} must be a positive multiple of the global batch size "
                f"{self.global_batch_size}"
            )
        self._own_grad_norm = not reports_grad_norm(self.model_engine.optimizer)
        self._host_buffer: torch.Tensor | None = None  # _host_values' staging buffer
        # The first DATA_FAULT line of this iteration's batches (this rank's), stopping
        # every rank at the iteration's end.
        self._data_fault: str | None = None

    # -- data ---------------------------------------------------------------------------

    def _loader(self, dataset, consumed_samples: int, total_samples: int) -> Iterator[dict]:
        sampler = PretrainingSampler(
            total_samples=total_samples,
            consumed_samples=consumed_samples,
            micro_batch_size=self.training.micro_batch_size,
            data_parallel_rank=self.parallel.dp_rank,
            data_parallel_size=self.parallel.dp_size,
            drop_last=True,
        )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=self.parts.collate_fn,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            # A DataLoader draws its workers' base seed from this generator when an iterator
            # is created; without one it draws from torch's global RNG, so creating the
            # validation loader (or the train loader after a resume) would shift the dropout
            # masks and break exact resumption. The batches themselves do not depend on it:
            # masking is seeded from (seed, sample index).
            generator=torch.Generator().manual_seed(self.seed),
            worker_init_fn=self.exit_monitor.worker_init_fn if self.exit_monitor else None,
        )
        return iter(loader)

    # -- steps --------------------------------------------------------------------------

    def train_step(
        self, data_iter: Iterator[dict], acc: MetricAccumulator, state: TrainingState
    ) -> tuple[float, bool, torch.Tensor | float | None]:
        """One optimizer step over ``grad_accum_steps`` micro-batches. Returns (learning
        rate used, whether DeepSpeed skipped the step, gradient norm: None for a skipped
        step, possibly inf/NaN for one DeepSpeed applied; a device tensor where it was
        computed on the device, read with the end-of-step flags)."""
        self.callbacks.on_step_start(self, state)
        lr = float(self.model_engine.get_lr()[0])
        skipped_before = self.model_engine.skipped_steps
        own_norm = None
        for micro in range(self.grad_accum_steps):
            batch = next(data_iter)
            fault = batch.pop(DATA_FAULT, None)
            self._data_fault = self._data_fault or fault
            batch = to_device(batch, self.model_engine.device)
            outputs = self.model_engine(batch)
            self.model_engine.backward(outputs["loss"])
            if micro == self.grad_accum_steps - 1:  # before the step may change it
                scale = float(getattr(self.model_engine.optimizer, "loss_scale", 1.0))
            if self._own_grad_norm and micro == self.grad_accum_steps - 1:
                # Gradients are complete (accumulated and data-parallel averaged) after the
                # last backward; the step clips them next.
                own_norm = gradient_norm(self.model_engine.module, self.parallel)
            # DeepSpeed applies the optimizer (and steps the LR scheduler, unless the step
            # overflowed) only at the gradient-accumulation boundary.
            self.model_engine.step()
            self.callbacks.after_micro_batch(self, state, batch, outputs)  # may add sums
            acc.add(outputs)
        # DeepSpeed skips a step whose gradient norm is not finite in fp16 and in its ZeRO
        # optimizers (fp32; bf16 with check_grad_overflow), and applies it with a plain torch
        # optimizer (ZeRO-0 fp32) and in bf16 ZeRO without the check.
        skipped = self.model_engine.skipped_steps != skipped_before
        norm = own_norm if self._own_grad_norm else self.model_engine.get_global_grad_norm()
        norm = unscaled_grad_norm(self.model_engine.optimizer, norm, scale)
        return lr, skipped, None if skipped else norm

    def _host_values(self, values: list[float]) -> torch.Tensor:
        """Host numbers on the device without a synchronising copy: a pageable host->device
        copy (torch.tensor(..., device=)) waits for the stream; this one goes through a host
        buffer, pinned on a GPU and reused at every read (its previous copy has finished:
        the read that followed it waited for it)."""
        device = self.model_engine.device
        if self._host_buffer is None or self._host_buffer.numel() != len(values):
            self._host_buffer = torch.empty(
                len(values), dtype=torch.float64, pin_memory=device.type == "cuda"
            )
        for i, value in enumerate(values):
            self._host_buffer[i].fill_(value)  # not [i] = value: a tensor made of each value
        return self._host_buffer.to(device, non_blocking=True)

    def _end_of_step(self, iteration: int, acc: MetricAccumulator, norm) -> _Step:
        """The step's checks, queued on the device and not read: whether the losses summed
        so far in this log interval are finite (a non-finite value stays non-finite in the
        sum, so the flags of the last step before a read cover the window) and the norm."""
        keys = []
        if self.engine.settings.precision != "fp16":  # fp16 overflows are skipped steps
            keys = sorted(k for k in acc.sums if is_loss_key(k))
        flags = None
        if keys:
            flags = (~torch.isfinite(torch.stack([acc.sums[k] for k in keys]))).to(torch.float64)
        return _Step(iteration, keys, flags, norm)

    def _read(self, interval: _Interval, log: bool) -> dict[str, float] | None:
        """The loop's one host read, at the steps that log, save, evaluate or exit (the others
        read nothing: their values stay queued on the device). Every unread step's non-finite
        flags and gradient norm in one all-reduce (MAX over the world), the log interval's
        sums (SUM over data parallel) when ``log``, one transfer. Raises NonFiniteLossError
        on every rank, for the first unread step where any rank saw a non-finite loss or an
        applied step's non-finite gradient norm.

        Why checking only here is safe: in fp32/bf16 a non-finite step is the run's end; the
        steps after it until this read train on (non-finite) weights, but nothing leaves the
        process before the read: every step that saves or evaluates reads first (fp16
        overflows are DeepSpeed's own host-side skips, counted at the step). Exit requests
        are agreed every step on the host (_agree_on_host), not here. Reading waits
        for the queued work, so the interval's time needs no other synchronisation.
        Returns the log interval's metrics (``log``) or None."""
        steps, interval.unread = interval.unread, []
        host = [float(s.norm) for s in steps if s.norm is not None and not torch.is_tensor(s.norm)]
        staged = self._host_values(host) if host else None
        parts, j = [], 0
        for s in steps:
            if s.loss_flags is not None:
                parts.append(s.loss_flags)
            if s.norm is None:
                continue
            if torch.is_tensor(s.norm):
                value = s.norm.detach().to(torch.float64).reshape(1)
            else:
                value, j = staged[j : j + 1], j + 1
            finite = torch.isfinite(value)
            parts += [(~finite).to(torch.float64), value.where(finite, 0.0)]
        device = self.model_engine.device
        flags = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1 and flags.numel():
            comm.all_reduce(flags, op="max")
        totals = interval.acc.reduced(self.parallel) if log else None
        values = (flags if totals is None else torch.cat([flags, totals])).tolist()
        i = 0
        for s in steps:
            names = [k for k, bad in zip(s.loss_keys, values[i : i + len(s.loss_keys)]) if bad]
            i += len(s.loss_keys)
            if s.norm is not None:
                bad_norm, norm = values[i : i + 2]
                i += 2
                if bad_norm:
                    names.append("gradient norm")
                else:
                    interval.grad_norms.append(norm)
            if names:
                raise NonFiniteLossError(
                    f"iteration {s.iteration}: non-finite {', '.join(names)} in "
                    f"{self.engine.settings.precision} training; stopped without saving it "
                    "(the last checkpoint is untouched): lower --lr, check the data, or resume "
                    "from the last checkpoint"
                )
        return None if totals is None else interval.acc.finish(values[i:], interval.iterations)

    def _stop_on_data_fault(self, iteration: int) -> None:
        """Some rank built a batch of this iteration around data it could not read: every
        rank stops with the first such rank's line, before this step is saved."""
        faults = [self._data_fault]
        if dist.is_initialized() and dist.get_world_size() > 1:
            faults = comm.all_gather_object(self._data_fault)  # on this error path only
        rank, fault = next((r, f) for r, f in enumerate(faults) if f is not None)
        raise DataFaultError(
            f"iteration {iteration}, rank {rank}: {fault}; every rank stopped without saving "
            "this iteration (the last checkpoint is kept)"
        )

    def _agree_on_host(self, iteration: int) -> str | None:
        """Every iteration's agreement on host values, one all-reduce of a CPU tensor over
        ParallelState.host_group (never waiting for the device): whether a batch carried a
        DATA_FAULT (DataFaultError on every rank) and the exit requests. Returns the reason
        to exit, the same on every rank, or None."""
        flags = [int(self._data_fault is not None)]
        flags += self.exit_monitor.local_flags() if self.exit_monitor else [0, 0, 0]
        if dist.is_initialized() and dist.get_world_size() > 1:
            reduced = torch.tensor(flags, dtype=torch.int64)
            flags = comm.all_reduce(reduced, self.parallel.host_group, op="max").tolist()
        if flags[0]:
            self._stop_on_data_fault(iteration)
        return self.exit_monitor.reason(flags[1:]) if self.exit_monitor else None

    # -- evaluation ---------------------------------------------------------------------

    def evaluate(self, split: str, dataset, iteration: int) -> dict[str, float]:
        """Loss/accuracy over the first --eval-iters global batches of ``dataset``, with the
        collapse and baseline figures of monitor.py where the model gives their inputs; the
        learning monitor reads the validation figures (and may stop the run)."""
        total = min(len(dataset), self.training.eval_samples(self.parallel.dp_size))
        chunk = self.training.micro_batch_size * self.parallel.dp_size
        total -= total % chunk
        if total == 0:
            self.logger.print(f" {split}: fewer samples than one micro-batch per rank; skipped")
            return {}
        self.model_engine.eval()
        try:
            batches = (
                to_device(b, self.model_engine.device) for b in self._loader(dataset, 0, total)
            )
            iterations = max(total // self.global_batch_size, 1)
            metrics = evaluate_batches(self.model_engine, batches, self.parallel, iterations)
        finally:
            self.model_engine.train()
        self.logger.log(split, iteration, metrics)
        if split == "valid" and self.learning_monitor is not None:
            self.learning_monitor.check(iteration, metrics)
        return metrics

    # -- checkpoints --------------------------------------------------------------------

    def save(self, state: TrainingState, *, for_exit: bool = False) -> None:
        if self.checkpoint.save is None or self.last_saved_iteration == state.iteration:
            return
        what = f"the {'exit ' if for_exit else ''}save of iteration {state.iteration}"
        with self.exit_monitor.doing(what) if self.exit_monitor else contextlib.nullcontext():
            self._save(state)

    def _save(self, state: TrainingState) -> None:
        start = time.perf_counter()
        self.callbacks.on_save(self, state)
        metadata = {
            **(self.checkpoint_metadata or {}),
            "epoch": self.epoch_of(state.consumed_samples),
            "callbacks": self.callbacks.state_dict(),
        }
        path = save_checkpoint(
            self.model_engine,
            self.checkpoint.save,
            state,
            self.parallel,
            self.rng_tracker,
            metadata=metadata,
            retain=self.checkpoint.save_retain,
            clean_up=self.exiting is None,
        )
        self.last_saved_iteration = state.iteration
        self.save_seconds = time.perf_counter() - start
        self.logger.print(
            f" saved checkpoint {path} (iteration {state.iteration}, {self.save_seconds:.1f}s)"
        )

    def _periodic_save(self, state: TrainingState) -> None:
        if self.checkpoint.save is None:
            return
        if self.learning_monitor is not None and self.learning_monitor.holds_saves:
            self.logger.print(
                f" not saving at iteration {state.iteration}: the encoder is collapsed "
                "(--exit-on-collapse keeps the last good checkpoint)"
            )
            return
        self.save(state)

    def _collapsed(self) -> str:
        """An exit's save is made even while --exit-on-collapse holds periodic saves back:
        it is what the run resumes from (not saving would repeat the same stretch at every
        restart), and it records the streak, which the resumed run goes on counting."""
        m = self.learning_monitor
        if m is None or not m.holds_saves or self.checkpoint.save is None:
            return ""
        return (
            f" (the encoder has been collapsed since iteration {m.first_collapsed}: resume from "
            "this one to go on counting, or from an earlier one to train it differently)"
        )

    # -- epochs -------------------------------------------------------------------------

    def epoch_of(self, consumed_samples: int) -> int:
        """0-based epoch of the step that starts after ``consumed_samples``."""
        spe = self.parts.samples_per_epoch
        return consumed_samples // spe if spe else 0

    def num_epochs(self) -> int:
        spe = self.parts.samples_per_epoch
        total = self.training.train_samples(self.parallel.dp_size)
        return -(-total // spe) if spe else 1

    def _train_iter(self, state: TrainingState) -> Iterator[dict]:
        """Batches from the current position to the end of its epoch (or of training)."""
        end = self.training.train_samples(self.parallel.dp_size)
        spe = self.parts.samples_per_epoch
        if spe:
            end = min(end, (self.epoch_of(state.consumed_samples) + 1) * spe)
        return self._loader(self.parts.train_dataset, state.consumed_samples, end)

    # -- the loop -----------------------------------------------------------------------

    def train(self, state: TrainingState) -> TrainingState:
        if self.exit_monitor is None:
            return self._train(state)
        # Exit requests become the flags each iteration ends with; outside, they end the rank.
        with self.exit_monitor.deferred("training"):
            return self._train(state)

    def _train(self, state: TrainingState) -> TrainingState:
        t, ck = self.training, self.checkpoint
        if state.iteration >= t.train_iters:
            self.logger.print(
                f" iteration {state.iteration} >= --train-iters {t.train_iters}: nothing to train"
            )
            return state
        self.callbacks.load_state_dict(state.callback_states)
        self.callbacks.on_train_start(self, state)
        epoch = self.epoch_of(state.consumed_samples)
        self.callbacks.on_epoch_start(self, state, epoch)
        data_iter = self._train_iter(state)
        self.model_engine.train()
        interval = _Interval()
        last_evaluated = None
        while state.iteration < t.train_iters:
            start = time.perf_counter()
            lr, skipped, norm = self.train_step(data_iter, interval.acc, state)
            interval.add(self._end_of_step(state.iteration + 1, interval.acc, norm), skipped)
            stop = self._agree_on_host(state.iteration + 1)
            state.iteration += 1
            state.consumed_samples += self.global_batch_size
            self.logger.advance()
            epoch_ended = self.epoch_of(state.consumed_samples) != epoch
            # The window also closes at an epoch boundary: values that change per epoch (a
            # loss weight scheduled by epoch, a data source) are never averaged across two.
            # Logged before the epoch's end work, so that a dev evaluation's line follows
            # the train line of the same iteration.
            log_now = state.iteration % t.log_interval == 0 or epoch_ended
            log_now = log_now or state.iteration == t.train_iters
            sums = None
            if log_now or stop is not None or self._saves_or_evaluates(state.iteration):
                sums = self._read(interval, log=log_now)
            interval.seconds += time.perf_counter() - start
            if log_now:
                metrics = self._train_metrics(state, interval, sums, lr, epoch)
                self.logger.log("train", state.iteration, metrics)
                interval = _Interval()
            if stop is not None:
                # Before this iteration's validation and periodic save: a launcher or a
                # scheduler allows a bounded time after its signal, and the epoch's end and
                # the save are what must fit in it; their clean-up waits (self.exiting).
                self.exiting = stop
                self.logger.print(
                    f" exiting at iteration {state.iteration}: {stop}"
                    f"{self._exit_plan(epoch_ended)}{self._collapsed()}"
                )
            if epoch_ended:
                began = time.perf_counter()
                self.callbacks.on_epoch_end(self, state, epoch)
                self.epoch_end_seconds = time.perf_counter() - began
                self.logger.print(
                    f" epoch {epoch + 1}/{self.num_epochs()} ended at iteration {state.iteration}"
                )
            if stop is not None:
                self.save(state, for_exit=True)
                return state
            if self._validates and state.iteration % t.eval_interval == 0:
                self.evaluate("valid", self.parts.valid_dataset, state.iteration)
                last_evaluated = state.iteration
            if ck.save_interval is not None and state.iteration % ck.save_interval == 0:
                self._periodic_save(state)
            if t.exit_interval is not None and state.iteration % t.exit_interval == 0:
                self.logger.print(
                    f" exiting at iteration {state.iteration} (--exit-interval){self._collapsed()}"
                )
                self.save(state, for_exit=True)
                return state
            if epoch_ended and state.iteration < t.train_iters:
                # A fresh iterator per epoch: nothing of the next epoch was prefetched
                # before this epoch's callbacks ran.
                epoch += 1
                self.callbacks.on_epoch_start(self, state, epoch)
                data_iter = self._train_iter(state)

        # Validation before the final save: with --exit-on-collapse a collapsed encoder is
        # not saved over the last good checkpoint.
        if self._validates and last_evaluated != state.iteration:
            self.evaluate("valid", self.parts.valid_dataset, state.iteration)
        if self.learning_monitor is not None:
            self.learning_monitor.check_end(state.iteration)
        self.save(state)
        if self.parts.test_dataset is not None and t.eval_iters > 0:
            self.evaluate("test", self.parts.test_dataset, state.iteration)
        return state

    def _exit_plan(self, epoch_ended: bool) -> str:
        """What an exit still does and how long that took last time: a scheduler's grace
        time must cover it."""
        if self.checkpoint.save is None:
            return ""

        def took(seconds: float | None) -> str:
            return "not timed yet" if seconds is None else f"{seconds:.1f}s last time"

        epoch = f"ending the epoch ({took(self.epoch_end_seconds)}), " if epoch_ended else ""
        return (
            f"; {epoch}saving a checkpoint ({took(self.save_seconds)}); removing old "
            "checkpoints and leftovers is left to the next save"
        )

    @property
    def _validates(self) -> bool:
        return self.parts.valid_dataset is not None and self.training.eval_iters > 0

    def _saves_or_evaluates(self, iteration: int) -> bool:
        """Whether the loop saves, evaluates or exits after ``iteration`` (not counting an
        exit request or the last iteration): its values must be read first."""
        t = self.training

        def due(interval: int | None) -> bool:
            return interval is not None and iteration % interval == 0

        return (
            (self.checkpoint.save is not None and due(self.checkpoint.save_interval))
            or (self._validates and due(t.eval_interval))
            or due(t.exit_interval)
        )

    def _train_metrics(
        self,
        state: TrainingState,
        interval: _Interval,
        sums: dict[str, float],
        lr: float,
        epoch: int,
    ) -> dict[str, Any]:
        metrics: dict[str, Any] = {
            "consumed_samples": state.consumed_samples,
            "elapsed_ms": 1000.0 * interval.seconds / interval.iterations,
            "lr": lr,
            "global_batch_size": self.global_batch_size,
            # Iterations whose step was skipped contribute their losses too: they are what
            # the model computed.
            **sums,
            "grad_norm": interval.mean_grad_norm(),
            "skipped_iterations": interval.skipped,
        }
        if self.parts.samples_per_epoch:
            metrics["epoch"] = epoch + 1  # 1-based, as the paper counts epochs
        metrics.update(self.callbacks.metrics(sums))
        if self.engine.settings.precision == "fp16":
            # DeepSpeed's dynamic loss scale: it halves on overflow (that step is skipped,
            # and the LR scheduler is not stepped for it).
            scale = getattr(self.model_engine.optimizer, "loss_scale", None)
            if scale is not None:
                metrics["loss_scale"] = float(scale)
        if self.training.log_throughput:
            metrics.update(self._throughput(interval.iterations, interval.seconds))
        return metrics

    def _throughput(self, iterations: int, seconds: float) -> dict[str, float]:
        if seconds <= 0:
            return {}
        samples = self.global_batch_size * iterations
        out = {"samples_per_s": samples / seconds}
        if self.parts.tokens_per_sample:
            out["tokens_per_s"] = samples * self.parts.tokens_per_sample / seconds
        if self.parts.train_flops is not None:
            # Model FLOPs per rank (Megatron's convention): the whole model's work divided
            # over every rank, tensor-parallel ones included.
            flops = self.parts.train_flops(self.global_batch_size) * iterations
            per_rank = flops / seconds / self.parallel.world_size
            out["tflops_per_rank"] = per_rank / 1e12
            utilisation = mfu(per_rank, self.device_peak)
            if utilisation is not None:
                out["mfu"] = utilisation
        return out

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

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_taco.data.sampler import PretrainingSampler
from megatron_taco.model_outputs import COUNT_SUFFIX, DATA_FAULT
from megatron_taco.parallel import comm
from megatron_taco.parallel.random import RNGTracker
from megatron_taco.parallel.state import ParallelState
from megatron_taco.training.callbacks import Callback, CallbackList
from megatron_taco.training.checkpointing import RunError, TrainingState, save_checkpoint
from megatron_taco.training.config import TrainingConfig
from megatron_taco.training.engine import Engine, gradient_norm, to_device, unscaled_grad_norm
from megatron_taco.training.logging import TrainingLogger
from megatron_taco.training.monitor import EvaluationStatistics, LearningMonitor
from megatron_taco.training.peaks import device_peak, mfu
from megatron_taco.training.signals import ExitMonitor


class NonFiniteLossError(RunError):
    pass


class DataFaultError(RunError):
    pass


def is_loss_key(key: str) -> bool:
    return key == "loss" or key.endswith("_loss")


@dataclass
class PretrainTask:
    """What the builder (e.g. recipes/taco.py) hands the loop."""

    model: nn.Module
    collate_fn: Callable[[list], dict[str, Any]]
    train_dataset: torch.utils.data.Dataset
    valid_dataset: torch.utils.data.Dataset | None = None
    test_dataset: torch.utils.data.Dataset | None = None
    tokens_per_sample: int = 0  # for tokens/s
    train_flops: Callable[[int], float] | None = None  # model FLOPs (fwd+bwd) of n samples
    samples_per_epoch: int | None = None  # None: one stream without epochs (TACO)
    callbacks: list[Callback] = field(default_factory=list)


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

    def reduce(self, parallel: ParallelState, iterations: int) -> dict[str, float]:
        if self.micro_batches == 0:
            return {}
        keys = sorted(self.sums)
        device = self.sums[keys[0]].device
        totals = torch.stack(
            [self.sums[k] for k in keys]
            + [torch.tensor(float(self.micro_batches), dtype=torch.float64, device=device)]
        )
        if dist.is_initialized() and parallel.dp_size > 1:
            # gloo and nccl both reduce float64.
            comm.all_reduce(totals, parallel.get_data_parallel_group())
        values = totals.tolist()
        micro_batches = values[-1]
        out = {}
        for key, total in zip(keys, values):
            if key.endswith(COUNT_SUFFIX):
                out[key] = total / max(iterations, 1)
            else:
                out[key] = total / micro_batches
        return out


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


class _Interval:
    """What the loop accumulates between two log lines."""

    def __init__(self) -> None:
        self.acc = MetricAccumulator()
        self.iterations = self.skipped = 0
        self.seconds = 0.0
        self.grad_norms: list[float] = []

    def add(self, seconds: float, skipped: bool, norm: float | None) -> None:
        self.iterations += 1
        self.seconds += seconds
        self.skipped += int(skipped)
        if norm is not None:
            self.grad_norms.append(norm)

    def mean_grad_norm(self) -> float:
        return sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else float("nan")


class Trainer:
    def __init__(
        self,
        engine: Engine,
        parallel: ParallelState,
        training: TrainingConfig,
        task: PretrainTask,
        logger: TrainingLogger,
        *,
        seed: int,
        num_workers: int = 0,
        rng_tracker: RNGTracker | None = None,
        checkpoint_metadata: dict[str, Any] | None = None,
        save_retain: int | None = None,
        exit_monitor: ExitMonitor | None = None,
        learning_monitor: LearningMonitor | None = None,
    ) -> None:
        self.engine = engine
        self.ds = engine.engine
        self.parallel = parallel
        self.training = training
        self.task = task
        self.logger = logger
        self.seed = seed
        self.num_workers = num_workers
        self.rng_tracker = rng_tracker
        self.checkpoint_metadata = checkpoint_metadata
        self.save_retain = save_retain
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
        self.callbacks = CallbackList([*task.callbacks, *extra])
        spe = task.samples_per_epoch
        if spe is not None and (spe <= 0 or spe % self.global_batch_size):
            raise ValueError(
                f"samples_per_epoch {spe} must be a positive multiple of the global batch size "
                f"{self.global_batch_size}"
            )
        # DeepSpeed reports the gradient norm from its ZeRO/mixed-precision optimizers only;
        # with a plain torch optimizer (ZeRO 0, fp32) it computes and discards it.
        self._own_grad_norm = not hasattr(self.ds.optimizer, "_global_grad_norm")
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
            collate_fn=self.task.collate_fn,
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
        lr = float(self.ds.get_lr()[0])
        skipped_before = self.ds.skipped_steps
        own_norm = None
        for micro in range(self.grad_accum_steps):
            batch = next(data_iter)
            fault = batch.pop(DATA_FAULT, None)
            self._data_fault = self._data_fault or fault
            batch = to_device(batch, self.ds.device)
            outputs = self.ds(batch)
            self.ds.backward(outputs["loss"])
            if micro == self.grad_accum_steps - 1:  # before the step may change it
                scale = float(getattr(self.ds.optimizer, "loss_scale", 1.0))
            if self._own_grad_norm and micro == self.grad_accum_steps - 1:
                # Gradients are complete (accumulated and data-parallel averaged) after the
                # last backward; the step clips them next.
                own_norm = gradient_norm(self.ds.module, self.parallel)
            # DeepSpeed applies the optimizer (and steps the LR scheduler, unless the step
            # overflowed) only at the gradient-accumulation boundary.
            self.ds.step()
            acc.add(outputs)
            self.callbacks.after_micro_batch(self, state, batch, outputs)
        # DeepSpeed skips a step whose gradient norm is not finite in fp16 and in its ZeRO
        # optimizers (fp32; bf16 with check_grad_overflow), and applies it with a plain torch
        # optimizer (ZeRO-0 fp32) and in bf16 ZeRO without the check.
        skipped = self.ds.skipped_steps != skipped_before
        norm = own_norm if self._own_grad_norm else self.ds.get_global_grad_norm()
        norm = unscaled_grad_norm(self.ds.optimizer, norm, scale)
        return lr, skipped, None if skipped else norm

    def _host_values(self, values: list[float]) -> torch.Tensor:
        """Host numbers on the device without a synchronising copy: a pageable host->device
        copy (torch.tensor(..., device=)) waits for the stream; this one goes through a host
        buffer, pinned on a GPU and reused every step (its previous copy has finished: the
        end-of-step read waited for it)."""
        device = self.ds.device
        if self._host_buffer is None or self._host_buffer.numel() != len(values):
            self._host_buffer = torch.empty(
                len(values), dtype=torch.float64, pin_memory=device.type == "cuda"
            )
        for i, value in enumerate(values):
            self._host_buffer[i].fill_(value)  # not [i] = value: a tensor made of each value
        return self._host_buffer.to(device, non_blocking=True)

    def _end_of_iteration(
        self, iteration: int, acc: MetricAccumulator, norm: torch.Tensor | float | None
    ) -> tuple[str | None, float | None]:
        """The one all-reduce (MAX over the world) and the one host read of every iteration:
        this iteration's non-finite losses and gradient norm, the norm's value, whether a
        batch carried a DATA_FAULT, and the exit requests (signal, launcher gone, time
        limit); reading them waits for the step's work to finish, so the loop's timing needs
        no other synchronisation. Raises DataFaultError on every rank when any rank's batch
        carried a fault, and NonFiniteLossError when any rank saw a non-finite value in a
        step that was applied: fp32/bf16 stop there, before a save can keep the weights it
        produced (the losses summed so far in this log interval were finite, so this
        iteration's is not). Returns (the reason to exit, the same on every rank; the gradient norm)."""
        keys = []
        if self.engine.settings.precision != "fp16":  # fp16 overflows are skipped steps
            keys = sorted(k for k in acc.sums if is_loss_key(k))
        host_norm = float(norm) if norm is not None and not torch.is_tensor(norm) else 0.0
        host = self._host_values(
            [host_norm, float(self._data_fault is not None), *self._exit_flags()]
        )
        value = norm.detach().to(host) if torch.is_tensor(norm) else host[0]
        finite = torch.isfinite(value)
        parts = [(~finite).to(torch.float64).reshape(1), value.where(finite, 0.0).reshape(1)]
        if keys:  # the losses join the flags on the device
            losses = torch.stack([acc.sums[k] for k in keys])
            parts.insert(0, (~torch.isfinite(losses)).to(torch.float64))
        flags = torch.cat([*parts, host[1:]])
        if dist.is_initialized() and dist.get_world_size() > 1:
            comm.all_reduce(flags, op="max")
        values = flags.tolist()
        if values[len(keys) + 2]:
            self._stop_on_data_fault(iteration)
        names = [k for k, bad in zip(keys, values) if bad]
        if values[len(keys)]:
            names.append("gradient norm")
        if names:
            raise NonFiniteLossError(
                f"iteration {iteration}: non-finite {', '.join(names)} in "
                f"{self.engine.settings.precision} training; stopped without saving it (the "
                "last checkpoint is untouched): lower --lr, check the data, or resume from the "
                "last checkpoint"
            )
        exit_flags = values[len(keys) + 3 :]
        stop = self.exit_monitor.reason(exit_flags) if self.exit_monitor else None
        return stop, None if norm is None else values[len(keys) + 1]

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

    def _exit_flags(self) -> list[int]:
        return self.exit_monitor.local_flags() if self.exit_monitor else [0, 0, 0]

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
        self.ds.eval()
        try:
            batches = (to_device(b, self.ds.device) for b in self._loader(dataset, 0, total))
            iterations = max(total // self.global_batch_size, 1)
            metrics = evaluate_batches(self.ds, batches, self.parallel, iterations)
        finally:
            self.ds.train()
        self.logger.log(split, iteration, metrics)
        if split == "valid" and self.learning_monitor is not None:
            self.learning_monitor.check(iteration, metrics)
        return metrics

    # -- checkpoints --------------------------------------------------------------------

    def save(self, state: TrainingState) -> None:
        if self.training.save is None or self.last_saved_iteration == state.iteration:
            return
        start = time.perf_counter()
        self.callbacks.on_save(self, state)
        metadata = {
            **(self.checkpoint_metadata or {}),
            "epoch": self.epoch_of(state.consumed_samples),
            "callbacks": self.callbacks.state_dict(),
        }
        path = save_checkpoint(
            self.ds,
            self.training.save,
            state,
            self.parallel,
            self.rng_tracker,
            metadata=metadata,
            retain=self.save_retain,
            clean_up=self.exiting is None,
        )
        self.last_saved_iteration = state.iteration
        self.save_seconds = time.perf_counter() - start
        self.logger.print(
            f" saved checkpoint {path} (iteration {state.iteration}, {self.save_seconds:.1f}s)"
        )

    def _periodic_save(self, state: TrainingState) -> None:
        if self.training.save is None:
            return
        if self.learning_monitor is not None and self.learning_monitor.holds_saves:
            self.logger.print(
                f" not saving at iteration {state.iteration}: the encoder is collapsed "
                "(--exit-on-collapse keeps the last good checkpoint)"
            )
            return
        self.save(state)

    def _exit_plan(self, epoch_ended: bool) -> str:
        """What an exit still does and how long that took last time: a scheduler's grace
        time must cover it."""
        if self.training.save is None:
            return ""

        def took(seconds: float | None) -> str:
            return "not timed yet" if seconds is None else f"{seconds:.1f}s last time"

        epoch = f"ending the epoch ({took(self.epoch_end_seconds)}), " if epoch_ended else ""
        return (
            f"; {epoch}saving a checkpoint ({took(self.save_seconds)}); removing old "
            "checkpoints and leftovers is left to the next save"
        )

    def _collapsed(self) -> str:
        """An exit's save is made even while --exit-on-collapse holds periodic saves back:
        it is what the run resumes from (not saving would repeat the same stretch at every
        restart), and it records the streak, which the resumed run goes on counting."""
        m = self.learning_monitor
        if m is None or not m.holds_saves or self.training.save is None:
            return ""
        return (
            f" (the encoder has been collapsed since iteration {m.first_collapsed}: resume from "
            "this one to go on counting, or from an earlier one to train it differently)"
        )

    # -- epochs -------------------------------------------------------------------------

    def epoch_of(self, consumed_samples: int) -> int:
        """0-based epoch of the step that starts after ``consumed_samples``."""
        spe = self.task.samples_per_epoch
        return consumed_samples // spe if spe else 0

    def num_epochs(self) -> int:
        spe = self.task.samples_per_epoch
        total = self.training.train_samples(self.parallel.dp_size)
        return -(-total // spe) if spe else 1

    def _train_iter(self, state: TrainingState) -> Iterator[dict]:
        """Batches from the current position to the end of its epoch (or of training)."""
        end = self.training.train_samples(self.parallel.dp_size)
        spe = self.task.samples_per_epoch
        if spe:
            end = min(end, (self.epoch_of(state.consumed_samples) + 1) * spe)
        return self._loader(self.task.train_dataset, state.consumed_samples, end)

    # -- the loop -----------------------------------------------------------------------

    def train(self, state: TrainingState) -> TrainingState:
        if self.exit_monitor is None:
            return self._train(state)
        # Exit requests become the flags each iteration ends with; outside, they end the rank.
        with self.exit_monitor.deferred("training"):
            return self._train(state)

    def _train(self, state: TrainingState) -> TrainingState:
        t = self.training
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
        self.ds.train()
        interval = _Interval()
        last_evaluated = None
        while state.iteration < t.train_iters:
            start = time.perf_counter()
            lr, skipped, norm = self.train_step(data_iter, interval.acc, state)
            stop, norm = self._end_of_iteration(state.iteration + 1, interval.acc, norm)
            interval.add(time.perf_counter() - start, skipped, norm)
            state.iteration += 1
            state.consumed_samples += self.global_batch_size
            self.logger.advance()
            epoch_ended = self.epoch_of(state.consumed_samples) != epoch
            # The window also closes at an epoch boundary: values that change per epoch (a
            # loss weight scheduled by epoch, a data source) are never averaged across two.
            # Logged before the epoch's end work, so that a dev evaluation's line follows
            # the train line of the same iteration.
            log_now = state.iteration % t.log_interval == 0 or epoch_ended
            if log_now or state.iteration == t.train_iters:
                metrics = self._train_metrics(state, interval, lr, epoch)
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
                self.save(state)
                return state
            if (
                self.task.valid_dataset is not None
                and t.eval_iters > 0
                and state.iteration % t.eval_interval == 0
            ):
                self.evaluate("valid", self.task.valid_dataset, state.iteration)
                last_evaluated = state.iteration
            if t.save_interval is not None and state.iteration % t.save_interval == 0:
                self._periodic_save(state)
            if t.exit_interval is not None and state.iteration % t.exit_interval == 0:
                self.logger.print(
                    f" exiting at iteration {state.iteration} (--exit-interval){self._collapsed()}"
                )
                self.save(state)
                return state
            if epoch_ended and state.iteration < t.train_iters:
                # A fresh iterator per epoch: nothing of the next epoch was prefetched
                # before this epoch's callbacks ran.
                epoch += 1
                self.callbacks.on_epoch_start(self, state, epoch)
                data_iter = self._train_iter(state)

        # Validation before the final save: with --exit-on-collapse a collapsed encoder is
        # not saved over the last good checkpoint.
        if (
            self.task.valid_dataset is not None
            and t.eval_iters > 0
            and last_evaluated != state.iteration
        ):
            self.evaluate("valid", self.task.valid_dataset, state.iteration)
        if self.learning_monitor is not None:
            self.learning_monitor.check_end(state.iteration)
        self.save(state)
        if self.task.test_dataset is not None and t.eval_iters > 0:
            self.evaluate("test", self.task.test_dataset, state.iteration)
        return state

    def _train_metrics(
        self, state: TrainingState, interval: _Interval, lr: float, epoch: int
    ) -> dict[str, Any]:
        metrics: dict[str, Any] = {
            "consumed_samples": state.consumed_samples,
            "elapsed_ms": 1000.0 * interval.seconds / interval.iterations,
            "lr": lr,
            "global_batch_size": self.global_batch_size,
            # Iterations whose step was skipped contribute their losses too: they are what
            # the model computed.
            **interval.acc.reduce(self.parallel, interval.iterations),
            "grad_norm": interval.mean_grad_norm(),
            "skipped_iterations": interval.skipped,
        }
        if self.task.samples_per_epoch:
            metrics["epoch"] = epoch + 1  # 1-based, as the paper counts epochs
        metrics.update(self.callbacks.metrics())
        if self.engine.settings.precision == "fp16":
            # DeepSpeed's dynamic loss scale: it halves on overflow (that step is skipped,
            # and the LR scheduler is not stepped for it).
            scale = getattr(self.ds.optimizer, "loss_scale", None)
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
        if self.task.tokens_per_sample:
            out["tokens_per_s"] = samples * self.task.tokens_per_sample / seconds
        if self.task.train_flops is not None:
            # Model FLOPs per rank (Megatron's convention): the whole model's work divided
            # over every rank, tensor-parallel ones included.
            flops = self.task.train_flops(self.global_batch_size) * iterations
            per_rank = flops / seconds / self.parallel.world_size
            out["tflops_per_rank"] = per_rank / 1e12
            utilisation = mfu(per_rank, self.device_peak)
            if utilisation is not None:
                out["mfu"] = utilisation
        return out

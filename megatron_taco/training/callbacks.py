"""Hooks into the training loop, with state that is saved in checkpoints.

A model's spec hands the trainer a list of callbacks (e.g. SAS's RTD-weight schedule and its
self-augmentation store). The trainer calls, in order:

    on_train_start                       once, after a checkpoint (if any) was loaded
    on_epoch_start(epoch)                before the first step of each epoch, including the
                                         epoch a resumed run restarts in the middle of
    after_micro_batch(batch, outputs)    after each training forward/backward (never in eval)
    on_epoch_end(epoch)                  after the last step of an epoch and that
                                         iteration's train log line, before its
                                         evaluation and checkpoint
    on_save                              before a checkpoint's files are written (flush)
    metrics()                            extra values for the training log line
    state_dict / load_state_dict         JSON-serialisable state, stored in the checkpoint's
                                         metadata.json under "callbacks"[name]

Epochs exist when the task defines ``samples_per_epoch`` (a multiple of the global batch
size); epoch e covers iterations [e * steps_per_epoch, (e + 1) * steps_per_epoch).
"""

from __future__ import annotations

from typing import Any

import torch


class Callback:
    name = "callback"  # key of this callback's state in checkpoints; unique per run

    def on_train_start(self, trainer, state) -> None:
        pass

    def on_epoch_start(self, trainer, state, epoch: int) -> None:
        pass

    def on_step_start(self, trainer, state) -> None:
        """Before the first micro-batch of iteration ``state.iteration`` (0-based)."""

    def after_micro_batch(self, trainer, state, batch: dict, outputs: dict) -> None:
        """After the micro-batch's backward. A callback may add 0-d tensors to ``outputs``
        (on the loss's device, under names of its own; CallbackList checks): the loop sums
        them with the model's over the log interval and the data-parallel ranks and reads
        them in its one transfer at a logging step ("<name>_tokens": a count per iteration,
        other names a mean per micro-batch), so a callback needs no read of its own."""

    def on_epoch_end(self, trainer, state, epoch: int) -> None:
        pass

    def on_save(self, trainer, state) -> None:
        pass

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Values for the log line, on every rank; ``sums`` are the interval's logged values
        read from the device (the model's and the callbacks' outputs), to derive from."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class CallbackList:
    """Calls every callback in order; checks that state keys are unique."""

    def __init__(self, callbacks: list[Callback] | None = None) -> None:
        self.callbacks = list(callbacks or [])
        names = [c.name for c in self.callbacks]
        if len(names) != len(set(names)):
            raise ValueError(f"callback names must be unique, got {names}")

    def __getattr__(self, hook: str):
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args, **kwargs) -> None:
            for callback in self.callbacks:
                getattr(callback, hook)(*args, **kwargs)

        return call

    def after_micro_batch(self, trainer, state, batch: dict, outputs: dict) -> None:
        # What a callback adds must be what the loop sums: anything else would be left out of
        # the log without a word, replace a value the model logs, or (a CPU count beside CUDA
        # sums) stop a GPU run at its first logging step. Host-side checks only.
        device = outputs["loss"].device
        for callback in self.callbacks:
            before = dict(outputs)
            callback.after_micro_batch(trainer, state, batch, outputs)
            for key, value in outputs.items():
                what = None
                if key in before:
                    if value is not before[key]:
                        what = "over the model's value of that name (it would not be logged)"
                elif not (torch.is_tensor(value) and value.dim() == 0):
                    shape = tuple(getattr(value, "shape", ()))
                    what = f"{type(value).__name__} {shape}, not a 0-d tensor"
                elif value.device != device:
                    what = f"a count on {value.device}, not {device} (the loss's device)"
                if what is not None:
                    raise TypeError(f"callback {callback.name!r} added {key!r}: {what}")

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for callback in self.callbacks:
            out.update(callback.metrics(sums))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {c.name: c.state_dict() for c in self.callbacks}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for callback in self.callbacks:
            if callback.name in states:
                callback.load_state_dict(states[callback.name])

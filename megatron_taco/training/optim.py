"""AdamW with Megatron/BERT weight-decay groups and Megatron's warmup + decay LR schedule.

Weight decay: every parameter with fewer than 2 dimensions, and every parameter of a
normalisation module, is excluded. That covers biases, LayerNorm gains (including the
embeddings' LayerNorms) and TACO's PReLU slopes and attention-convolution biases. The PReLU
slopes are excluded on purpose: decay would pull them towards 0, i.e. towards a plain ReLU,
which is a change of activation function rather than a regulariser. Embedding matrices and
all other weight matrices are decayed, as in BERT and Megatron.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from megatron_taco.param_groups import split_weight_decay
from megatron_taco.training.config import TrainingConfig

try:  # apex is optional; importing it can fail for many reasons (ABI, CUDA mismatch).
    # FusedAdam's kernel lives in the amp_C extension: apex built without its CUDA
    # extensions imports fine and raises only when FusedAdam() is constructed.
    import amp_C  # noqa: F401
    from apex.optimizers import FusedAdam as _ApexFusedAdam
except Exception:
    _ApexFusedAdam = None

APEX_ADAM = "apex.optimizers.FusedAdam"
TORCH_ADAMW = "torch.optim.AdamW"

logger = logging.getLogger(__name__)


def layer_lr_scales(model: nn.Module, decay: float) -> dict[str, float]:
    """ELECTRA's layer-wise LR decay: lr * decay^(D - depth) for every parameter, where the
    model's ``parameter_depth(name) -> (depth, D)`` says how deep a parameter sits (ELECTRA:
    embeddings 0, layer i (0-based) i + 1, task head D = layers + 2)."""
    depth_of = getattr(model, "parameter_depth", None)
    if depth_of is None:
        raise ValueError(
            f"--layerwise-lr-decay: {type(model).__name__} does not report its layers' depths"
        )
    scales = {}
    for name, _ in model.named_parameters():
        depth, deepest = depth_of(name)
        scales[name] = decay ** (deepest - depth)
    return scales


def param_groups(
    model: nn.Module, weight_decay: float, layerwise_lr_decay: float | None = None
) -> list[dict]:
    """AdamW groups: with and without weight decay, and with layer-wise decay one group per
    (decay, LR scale) pair; every group carries its ``lr_scale`` for the scheduler."""
    decay, no_decay = split_weight_decay(model)
    params = dict(model.named_parameters())
    scales = layer_lr_scales(model, layerwise_lr_decay) if layerwise_lr_decay is not None else None
    groups: list[dict] = []
    for names, wd, label in ((decay, weight_decay, "decay"), (no_decay, 0.0, "no_decay")):
        by_scale: dict[float, list[str]] = {}
        for n in names:
            by_scale.setdefault(scales[n] if scales else 1.0, []).append(n)
        for scale, members in sorted(by_scale.items(), reverse=True):
            name = label if scales is None else f"{label}_lr{scale:.4g}"
            groups.append(
                {
                    "params": [params[n] for n in members],
                    "weight_decay": wd,
                    "name": name,
                    "lr_scale": scale,
                }
            )
    return [g for g in groups if g["params"]]


def optimizer_implementation() -> str:
    """The Adam build_optimizer uses on this node, as recorded in checkpoints: apex's
    FusedAdam where apex and its CUDA extensions import and a GPU is there, else torch's
    AdamW. Their states differ (apex keeps ``step`` per parameter group, torch per
    parameter), so a resume must not mix them (checkpoint/reshard.py)."""
    return APEX_ADAM if _ApexFusedAdam is not None and torch.cuda.is_available() else TORCH_ADAMW


def build_optimizer(
    model: nn.Module, training: TrainingConfig
) -> tuple[torch.optim.Optimizer, str]:
    """(optimizer, a description of the implementation for the start-up banner)."""
    groups = param_groups(model, training.weight_decay, training.layerwise_lr_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    kwargs = dict(
        lr=training.lr,
        betas=(training.adam_beta1, training.adam_beta2),
        eps=training.adam_eps,
        weight_decay=training.weight_decay,
    )
    on_cuda = torch.cuda.is_available()
    if optimizer_implementation() == APEX_ADAM:
        return _ApexFusedAdam(
            groups, adam_w_mode=True, **kwargs
        ), "apex.optimizers.FusedAdam (AdamW mode)"
    if on_cuda:
        return torch.optim.AdamW(groups, fused=True, **kwargs), "torch.optim.AdamW (fused)"
    return torch.optim.AdamW(groups, foreach=False, **kwargs), "torch.optim.AdamW"


def annealing_lr(
    step: int,
    *,
    max_lr: float,
    min_lr: float,
    warmup_steps: int,
    decay_steps: int,
    decay_style: str,
) -> float:
    """Megatron's AnnealingLR/OptimizerParamScheduler: ``step`` optimizer steps have been
    taken, so the first iteration runs at step 0 (lr 0 when there is a warmup)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * step / warmup_steps
    if decay_style == "constant":
        return max_lr
    if step > decay_steps:
        return min_lr
    ratio = (step - warmup_steps) / (decay_steps - warmup_steps)
    if decay_style == "linear":
        coeff = 1.0 - ratio
    elif decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"unknown decay style {decay_style!r}")
    return min_lr + coeff * (max_lr - min_lr)


class AnnealingLR(LRScheduler):
    """The schedule above as a torch scheduler, so DeepSpeed steps it once per applied
    optimizer step (not on fp16 overflow skips) and saves/loads it with its checkpoints.
    ``last_epoch`` is the number of optimizer steps taken."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_lr: float,
        min_lr: float,
        warmup_steps: int,
        decay_steps: int,
        decay_style: str,
        step_size: int = 1,
        counts_samples: bool = False,
    ) -> None:
        self.max_lr = max_lr
        self.min_lr = min_lr
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.decay_style = decay_style
        self.step_size = step_size
        self.counts_samples = counts_samples
        # Set by load_state_dict when the checkpoint counted optimizer steps and this run
        # counts samples: the driver continues at resume_at() with the consumed samples.
        self.units_changed = False
        # Schedule units taken: optimizer steps (step_size 1) or, with --train-samples,
        # samples (Megatron's num_steps, stepped by the global batch size), which stay right
        # when a resumed run changes the global batch size.
        self.num_steps = 0
        super().__init__(optimizer)

    def step(self, epoch: int | None = None) -> None:
        if self.last_epoch >= 0:  # not torch's initial call from __init__
            self.num_steps += self.step_size
        super().step(epoch)

    def lr_at(self, step: int) -> float:
        return annealing_lr(
            step,
            max_lr=self.max_lr,
            min_lr=self.min_lr,
            warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps,
            decay_style=self.decay_style,
        )

    def get_lr(self) -> list[float]:
        lr = self.lr_at(self.num_steps)
        return [lr * g.get("lr_scale", 1.0) for g in self.optimizer.param_groups]

    _SCHEDULE = (
        "max_lr",
        "min_lr",
        "warmup_steps",
        "decay_steps",
        "decay_style",
        "step_size",
        "counts_samples",
    )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step count; the schedule itself comes from this run's flags, so a
        resumed run may e.g. train longer (--train-iters, --lr-decay-iters). A changed
        schedule is reported, not silently taken from the checkpoint."""
        ours = {k: getattr(self, k) for k in self._SCHEDULE}
        # A checkpoint from before num_steps was kept counted optimizer steps only.
        state_dict = {"num_steps": state_dict["last_epoch"], "step_size": 1, **state_dict}
        # One from before counts_samples was kept: sample-based where it stepped by more than 1.
        state_dict.setdefault("counts_samples", state_dict["step_size"] > 1)
        super().load_state_dict(state_dict)
        # A run switched between --train-iters and --train-samples: the count restored is in
        # the checkpoint's unit. Optimizer steps are known here; samples from the driver.
        other_unit = state_dict["counts_samples"] != ours["counts_samples"]
        if other_unit:
            self.num_steps = self.last_epoch
        self.units_changed = other_unit and ours["counts_samples"]  # not the checkpoint's
        changed = {k: (state_dict.get(k), v) for k, v in ours.items() if state_dict.get(k) != v}
        for k, v in ours.items():
            setattr(self, k, v)
        if changed:
            logger.warning(
                "LR schedule differs from the checkpoint's (checkpoint -> now): %s",
                ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()),
            )
        self.apply()

    def resume_at(self, optimizer_steps: int, consumed_samples: int) -> None:
        """Continue the schedule at a resumed run's position (when the checkpoint's scheduler
        state is not used, or counted in the other unit)."""
        self.last_epoch = optimizer_steps
        self.num_steps = consumed_samples if self.counts_samples else optimizer_steps
        self.units_changed = False
        self.apply()

    def apply(self) -> None:
        """Set every param group's lr for the current step. Needed after a checkpoint load:
        the optimizer state may be restored after the scheduler, with the lr it had then."""
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def build_scheduler(optimizer: torch.optim.Optimizer, training: TrainingConfig) -> AnnealingLR:
    warmup, decay, step_size = training.schedule()
    return AnnealingLR(
        optimizer,
        max_lr=training.lr,
        min_lr=training.min_lr,
        warmup_steps=warmup,
        decay_steps=decay,
        decay_style=training.lr_decay_style,
        step_size=step_size,
        counts_samples=training.sample_based,
    )

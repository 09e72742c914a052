"""Training flags (Megatron's spelling): length, batch layout, optimizer, LR schedule,
logging, numerics. training/deepspeed_config.py merges them into the DeepSpeed JSON.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_taco.arguments import (
    flag_of,
    option,
    require,
)
from megatron_taco.errors import ConfigError

# The default warm-up: 10% of the decay iterations, at most 10000. Long runs get the papers'
# 10000 (BERT; TACO Table 7; SAS Table 5); a short run gets the fine-tuning protocols' 0.1
# instead of a warm-up longer than itself (a few-hundred-iteration run that reaches its
# peak LR within 20-30 iterations collapsed its encoder in the measurements behind
# docs/recipes.md).
DEFAULT_WARMUP_ITERS = 10000
DEFAULT_WARMUP_FRACTION = 0.1
DECAY_STYLES = ("linear", "cosine", "constant")
WANDB_MODES = ("online", "offline", "disabled")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class TrainingConfig:
    train_iters: int | None = option(
        None,
        "Number of optimizer steps (iterations) to train for, counted from 0 (a resumed "
        "run continues up to this number). Give this, --train-samples or --train-epochs.",
        flag="--train-iters",
    )
    total_train_samples: int | None = option(
        None,
        "Megatron's sample-based training: --train-samples // global batch size iterations, "
        "and the LR schedule counts samples (--lr-warmup-samples, --lr-decay-samples), so a "
        "run resumed with another global batch size stays on its schedule. Exclusive with "
        "--train-iters and --train-epochs.",
        flag="--train-samples",
    )
    train_epochs: int | None = option(
        None,
        "Train this many epochs over the model's fixed instances (SAS); --train-iters then "
        "follows from the instances per epoch.",
        flag="--train-epochs",
    )
    micro_batch_size: int = option(
        8, "Samples per rank per forward/backward pass.", flag="--micro-batch-size"
    )
    global_batch_size: int | None = option(
        None,
        "Samples per optimizer step over all data-parallel ranks; must equal micro-batch "
        "size x gradient-accumulation steps x data-parallel size (default: micro-batch size "
        "x data-parallel size, no accumulation).",
        flag="--global-batch-size",
    )
    lr: float = option(1e-4, "Peak learning rate.", flag="--lr")
    min_lr: float = option(0.0, "Learning rate at the end of the decay.", flag="--min-lr")
    lr_warmup_iters: int | None = option(
        None,
        f"Linear warmup iterations from 0 to --lr (default: {DEFAULT_WARMUP_FRACTION:g} of "
        f"--lr-decay-iters, at most {DEFAULT_WARMUP_ITERS}, unless --lr-warmup-fraction is "
        "given).",
        flag="--lr-warmup-iters",
    )
    lr_warmup_fraction: float | None = option(
        None,
        "Warmup as a fraction of --lr-decay-iters (or --lr-decay-samples; exclusive with "
        "--lr-warmup-iters and --lr-warmup-samples).",
        flag="--lr-warmup-fraction",
    )
    lr_warmup_samples: int | None = option(
        None,
        f"With --train-samples: linear warmup over this many samples (default: "
        f"{DEFAULT_WARMUP_FRACTION:g} of --lr-decay-samples, at most {DEFAULT_WARMUP_ITERS} "
        "global batches).",
        flag="--lr-warmup-samples",
    )
    lr_decay_style: str = option(
        "linear", "Decay after warmup.", flag="--lr-decay-style", choices=DECAY_STYLES
    )
    lr_decay_iters: int | None = option(
        None,
        "Iteration at which the decay reaches --min-lr (default: --train-iters).",
        flag="--lr-decay-iters",
    )
    lr_decay_samples: int | None = option(
        None,
        "With --train-samples: sample at which the decay reaches --min-lr (default: "
        "--train-samples).",
        flag="--lr-decay-samples",
    )
    weight_decay: float = option(
        0.01,
        "AdamW weight decay (not applied to biases, norm weights and other 1-D parameters).",
        flag="--weight-decay",
    )
    layerwise_lr_decay: float | None = option(
        None,
        "Layer-wise learning-rate decay (ELECTRA's fine-tuning): a parameter at depth d of a "
        "model with D depths trains at lr * decay^(D - d) (embeddings deepest, task head at "
        "lr). Needs a model that reports its parameters' depths; default: none.",
        flag="--layerwise-lr-decay",
    )
    adam_beta1: float = option(0.9, "Adam beta1.", flag="--adam-beta1")
    adam_beta2: float = option(0.999, "Adam beta2.", flag="--adam-beta2")
    adam_eps: float = option(1e-6, "Adam epsilon.", flag="--adam-eps")
    clip_grad: float = option(
        1.0, "Clip the global gradient 2-norm to this value (0 disables).", flag="--clip-grad"
    )
    log_interval: int = option(100, "Log every this many iterations.", flag="--log-interval")
    log_throughput: bool = option(
        True, "Log samples/s, tokens/s and model TFLOP/s per rank.", flag="--log-throughput"
    )
    progress_bar: bool = option(
        True,
        "Show a tqdm progress bar on rank 0 (when stderr is a terminal).",
        flag="--progress-bar",
    )
    eval_interval: int = option(
        1000, "Evaluate on the validation split every this many iterations.", flag="--eval-interval"
    )
    eval_iters: int = option(
        100,
        "Global batches per evaluation (the same first batches of the split every time, so "
        "evaluations are comparable); 0 disables evaluation.",
        flag="--eval-iters",
    )
    bf16: bool = option(
        False,
        "Train in bf16: enables the DeepSpeed config's 'bf16' section (the default config's or "
        "--deepspeed-config's, which must not enable fp16).",
        flag="--bf16",
        switch=True,
    )
    fp16: bool = option(
        False,
        "Train in fp16 with a dynamic loss scale (GPUs only): enables the DeepSpeed config's "
        "'fp16' section (which must not enable bf16).",
        flag="--fp16",
        switch=True,
    )
    exit_interval: int | None = option(
        None,
        "Exit (after saving, when --save is given) once the iteration is a multiple of this.",
        flag="--exit-interval",
    )
    tensorboard_dir: str | None = option(
        None, "Write TensorBoard scalars here (rank 0).", flag="--tensorboard-dir"
    )
    wandb_project: str | None = option(
        None,
        "Log to this Weights & Biases project (rank 0): the TensorBoard scalars, the run's "
        "configuration and the loss- and learning-curve images; a resumed run continues the "
        "W&B run its checkpoint names. Needs the wandb extra (pip install "
        "'megatron_taco[wandb]').",
        flag="--wandb-project",
    )
    wandb_exp_name: str | None = option(
        None, "Name of the W&B run (default: one W&B makes up).", flag="--wandb-exp-name"
    )
    wandb_save_dir: str | None = option(
        None,
        "Directory W&B writes its wandb/ folder in (default: the metrics file's, i.e. "
        "--tensorboard-dir or --save).",
        flag="--wandb-save-dir",
    )
    wandb_entity: str | None = option(
        None, "W&B team or user that owns the run (default: the API key's).", flag="--wandb-entity"
    )
    wandb_mode: str | None = option(
        None,
        "online; offline (files only, uploaded later by `wandb sync`); or disabled (default: "
        "the WANDB_MODE environment variable, else online).",
        flag="--wandb-mode",
        choices=WANDB_MODES,
    )
    metrics_file: str | None = option(
        None,
        "JSON-lines metrics log, one line per logged step and evaluation (default: "
        "metrics.jsonl in --tensorboard-dir, else in --save; none without either). The "
        "loss-curve PNG is written beside it.",
        flag="--metrics-file",
    )
    deterministic: bool = option(
        False,
        "Deterministic GPU kernels (torch.use_deterministic_algorithms, a fixed cuBLAS "
        "workspace, CUBLAS_WORKSPACE_CONFIG=:4096:8): the bitwise-equal resume and replacement "
        "store hold on GPUs only with it; without it scatter-adds, index_select's backward and "
        "the memory-efficient attention backward add in an order that varies run to run. "
        "Some speed is lost.",
        flag="--deterministic",
    )
    tf32: bool = option(
        True,
        "TF32 tensor cores for float32 matmuls on Ampere and newer GPUs (fp32 configs: several "
        "times faster, 10-bit mantissa products with float32 sums); --no-tf32 computes them in "
        "full float32.",
        flag="--tf32",
    )
    deepspeed_config: str | None = option(
        None,
        "DeepSpeed JSON (precision, ZeRO stage, engine tuning), e.g. ds_configs/zero2_bf16.json; "
        "default: ZeRO stage 0 in fp32. Also accepted as --deepspeed_config.",
        flag="--deepspeed-config",
    )

    def __post_init__(self) -> None:
        cls = TrainingConfig

        def positive_int(name: str, value: Any, minimum: int = 1) -> None:
            require(
                is_int(value) and value >= minimum,
                cls,
                name,
                f"must be an integer >= {minimum}, got {value!r}",
            )

        def number(name: str, within: Callable[[float], bool], rule: str) -> None:
            value = getattr(self, name)
            ok = _is_number(value) and within(value)
            require(ok, cls, name, f"must be {rule}, got {value!r}")

        lengths = (self.train_iters, self.train_epochs, self.total_train_samples)
        require(
            sum(x is not None for x in lengths) == 1 or self._samples_resolved,
            cls,
            "train_iters",
            "give exactly one of --train-iters, --train-samples and --train-epochs",
        )
        for name, value in zip(("train_iters", "train_epochs", "total_train_samples"), lengths):
            if value is not None:
                positive_int(name, value)
        require(not (self.bf16 and self.fp16), cls, "fp16", "give --bf16 or --fp16, not both")
        positive_int("micro_batch_size", self.micro_batch_size)
        if self.global_batch_size is not None:
            positive_int("global_batch_size", self.global_batch_size)
            require(
                self.global_batch_size % self.micro_batch_size == 0,
                cls,
                "global_batch_size",
                f"{self.global_batch_size} is not a multiple of --micro-batch-size "
                f"{self.micro_batch_size}",
            )
        number("lr", lambda v: v > 0, "> 0")
        number("min_lr", lambda v: 0 <= v <= self.lr, f"in [0, --lr {self.lr}]")
        self._check_schedule_units()
        if self.lr_warmup_iters is not None:
            positive_int("lr_warmup_iters", self.lr_warmup_iters, 0)
        if self.lr_warmup_samples is not None:
            positive_int("lr_warmup_samples", self.lr_warmup_samples, 0)
        if self.lr_decay_samples is not None:
            positive_int("lr_decay_samples", self.lr_decay_samples)
        if self.lr_warmup_fraction is not None:
            warmup = "lr_warmup_samples" if self.sample_based else "lr_warmup_iters"
            require(
                getattr(self, warmup) is None,
                cls,
                "lr_warmup_fraction",
                f"give either --lr-warmup-fraction or {flag_of(cls, warmup)}, not both",
            )
            number("lr_warmup_fraction", lambda v: 0 <= v <= 1, "in [0, 1]")
        require(
            self.lr_decay_style in DECAY_STYLES,
            cls,
            "lr_decay_style",
            f"must be one of {DECAY_STYLES}, got {self.lr_decay_style!r}",
        )
        if self.lr_decay_iters is not None:
            positive_int("lr_decay_iters", self.lr_decay_iters)
        if self.sample_based:
            if self.lr_decay_style != "constant" and self.warmup_samples > 0:
                require(
                    self.warmup_samples < self.decay_samples,
                    cls,
                    "lr_warmup_samples",
                    f"{self.warmup_samples} warmup samples must be fewer than the "
                    f"{self.decay_samples} decay samples (--lr-decay-samples, default "
                    "--train-samples)",
                )
        elif self.decay_iters is None:
            pass  # --train-epochs: checked again once the iterations are known
        elif self.lr_decay_style != "constant" and self.warmup_iters > 0:
            # Megatron's scheduler divides by (decay - warmup).
            flag = flag_of(cls, "lr_warmup_iters")
            source = (
                f"{flag} {self.lr_warmup_iters}"
                if self.lr_warmup_iters is not None
                else f"{flag_of(cls, 'lr_warmup_fraction')} {self.lr_warmup_fraction}"
                if self.lr_warmup_fraction is not None
                else f"{flag} (default)"
            )
            require(
                self.warmup_iters < self.decay_iters,
                cls,
                "lr_warmup_iters",
                f"{self.warmup_iters} warmup iterations from {source} must be fewer than the "
                f"{self.decay_iters} decay iterations (--lr-decay-iters, default --train-iters)",
            )
        number("weight_decay", lambda v: v >= 0, ">= 0")
        if self.layerwise_lr_decay is not None:
            number("layerwise_lr_decay", lambda v: 0 < v <= 1, "in (0, 1]")
        for name in ("adam_beta1", "adam_beta2"):
            number(name, lambda v: 0 <= v < 1, "in [0, 1)")
        number("adam_eps", lambda v: v > 0, "> 0")
        number("clip_grad", lambda v: v >= 0, ">= 0 (0 disables clipping)")
        positive_int("log_interval", self.log_interval)
        positive_int("eval_interval", self.eval_interval)
        positive_int("eval_iters", self.eval_iters, 0)
        if self.exit_interval is not None:
            positive_int("exit_interval", self.exit_interval)
        self._check_wandb()
        for name in ("tensorboard_dir", "metrics_file", "deepspeed_config", "wandb_save_dir"):
            value = getattr(self, name)
            if value is not None:
                require(
                    isinstance(value, (str, os.PathLike)) and str(value) != "",
                    cls,
                    name,
                    f"expected a path, got {value!r}",
                )
                object.__setattr__(self, name, os.fspath(value))

    def _check_wandb(self) -> None:
        cls = TrainingConfig
        if self.wandb_project is None:
            for name in ("wandb_exp_name", "wandb_save_dir", "wandb_entity", "wandb_mode"):
                require(getattr(self, name) is None, cls, name, "needs --wandb-project")
            return
        require(
            isinstance(self.wandb_project, str) and self.wandb_project.strip() != "",
            cls,
            "wandb_project",
            f"expected a project name, got {self.wandb_project!r}",
        )
        require(
            self.wandb_mode is None or self.wandb_mode in WANDB_MODES,
            cls,
            "wandb_mode",
            f"must be online, offline or disabled, got {self.wandb_mode!r}",
        )
        require(
            importlib.util.find_spec("wandb") is not None,
            cls,
            "wandb_project",
            "the wandb package is not installed: pip install 'megatron_taco[wandb]'",
        )

    def wandb_dir(self, save: str | None) -> str | None:
        """--wandb-save-dir, else the metrics file's directory (``save``: --save)."""
        if self.wandb_save_dir is not None:
            return self.wandb_save_dir
        metrics = self.metrics_path(save)  # W&B adds its own wandb/ below it
        return None if metrics is None else os.path.dirname(metrics)

    def _check_schedule_units(self) -> None:
        """Megatron's rule: iteration-based runs take the -iters forms of the schedule,
        sample-based runs (--train-samples) the -samples forms."""
        cls = TrainingConfig
        wrong = (
            ("lr_warmup_iters", "lr_decay_iters")
            if self.sample_based
            else ("lr_warmup_samples", "lr_decay_samples")
        )
        for name in wrong:
            right = name.replace("iters", "samples") if self.sample_based else None
            require(
                getattr(self, name) is None,
                cls,
                name,
                f"the schedule counts samples with --train-samples: give {flag_of(cls, right)}"
                if right
                else "needs --train-samples (with --train-iters or --train-epochs the schedule "
                f"counts iterations: give {flag_of(cls, name.replace('samples', 'iters'))})",
            )

    @property
    def _samples_resolved(self) -> bool:
        """--train-samples turned into iterations at a known global batch (resolve_length)."""
        return (
            self.total_train_samples is not None
            and self.train_epochs is None
            and self.global_batch_size is not None
            and self.train_iters == self.total_train_samples // self.global_batch_size
        )

    # -- derived values -----------------------------------------------------------------

    @property
    def sample_based(self) -> bool:
        return self.total_train_samples is not None

    @property
    def decay_iters(self) -> int | None:
        if self.sample_based:
            return (
                None
                if self.global_batch_size is None
                else -(-self.decay_samples // self.global_batch_size)
            )
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters

    @property
    def decay_samples(self) -> int | None:
        if not self.sample_based:
            return None
        return (
            self.lr_decay_samples if self.lr_decay_samples is not None else self.total_train_samples
        )

    @property
    def warmup_samples(self) -> int | None:
        if not self.sample_based:
            return None
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * self.decay_samples)
        if self.lr_warmup_samples is not None:
            return self.lr_warmup_samples
        default = int(DEFAULT_WARMUP_FRACTION * self.decay_samples)
        if self.global_batch_size is not None:
            default = min(default, DEFAULT_WARMUP_ITERS * self.global_batch_size)
        return default

    def schedule(self) -> tuple[int, int, int]:
        """The LR schedule in its units: (warmup, decay, units per optimizer step): iterations
        and 1, or with --train-samples samples and the global batch size (Megatron's
        OptimizerParamScheduler stepped by the samples of each step)."""
        if not self.sample_based:
            return self.warmup_iters, self.decay_iters, 1
        if self.global_batch_size is None:
            raise ValueError("--train-samples: call resolve_length(data_parallel_size) first")
        return self.warmup_samples, self.decay_samples, self.global_batch_size

    def describe_schedule(self) -> str:
        warmup, decay, _ = self.schedule()
        unit = "samples" if self.sample_based else "iters"
        return f"warmup {warmup} {unit}, {self.lr_decay_style} decay over {decay} {unit}"

    def resolve_length(self, data_parallel_size: int) -> TrainingConfig:
        """--train-samples as Megatron turns it into iterations (train_samples // global
        batch size), with the global batch size made explicit; other configs unchanged."""
        if not self.sample_based or self._samples_resolved:
            return self
        global_batch = self.batch_layout(data_parallel_size)[0]
        iters = self.total_train_samples // global_batch
        if iters == 0:
            raise ConfigError(
                f"--train-samples: {self.total_train_samples} is fewer than one global batch "
                f"({global_batch})"
            )
        return dataclasses.replace(self, train_iters=iters, global_batch_size=global_batch)

    def with_train_iters(self, train_iters: int) -> TrainingConfig:
        """--train-epochs resolved into iterations (validated again)."""
        return dataclasses.replace(self, train_iters=train_iters, train_epochs=None)

    @property
    def warmup_iters(self) -> int:
        if self.sample_based:  # whole iterations that cover the warmup samples
            gbs = self.global_batch_size or 1
            return -(-self.warmup_samples // gbs)
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * self.decay_iters)
        if self.lr_warmup_iters is not None:
            return self.lr_warmup_iters
        if self.decay_iters is None:  # --train-epochs, until resolved into iterations
            return DEFAULT_WARMUP_ITERS
        return min(DEFAULT_WARMUP_ITERS, int(DEFAULT_WARMUP_FRACTION * self.decay_iters))

    def metrics_path(self, save: str | None) -> str | None:
        """--metrics-file, else metrics.jsonl in --tensorboard-dir, else in ``save``."""
        if self.metrics_file is not None:
            return self.metrics_file
        for directory in (self.tensorboard_dir, save):
            if directory is not None:
                return os.path.join(directory, "metrics.jsonl")
        return None

    def batch_layout(self, data_parallel_size: int) -> tuple[int, int]:
        """(global batch size, gradient-accumulation steps) for this data-parallel size."""
        dp = data_parallel_size
        mb = self.micro_batch_size
        global_batch = self.global_batch_size if self.global_batch_size is not None else mb * dp
        per_step = mb * dp
        if global_batch % per_step != 0:
            raise ConfigError(
                f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
                f"{mb} x data-parallel size {dp} (= world size / --tensor-model-parallel-size) "
                f"= {per_step}: the global batch must be micro-batch size x "
                "gradient-accumulation steps x data-parallel size"
            )
        return global_batch, global_batch // per_step

    def train_samples(self, data_parallel_size: int) -> int:
        if self.train_iters is None:
            raise ConfigError(
                "--train-epochs: this model has no fixed epochs; give --train-iters instead"
            )
        return self.train_iters * self.batch_layout(data_parallel_size)[0]

    def eval_samples(self, data_parallel_size: int) -> int:
        return self.eval_iters * self.batch_layout(data_parallel_size)[0]

"""The DeepSpeed JSON our training flags are merged into.

Batch sizes, gradient clipping, the optimizer and the LR schedule are set by OUR flags only;
the DeepSpeed JSON contributes precision (fp32/bf16/fp16), the ZeRO stage and engine tuning.
A JSON that also sets one of our values to something else is an error naming the file and
the key, so a run never silently trains with a batch size nobody asked for.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any

from megatron_taco.errors import ConfigError
from megatron_taco.training.config import TrainingConfig, is_int

# Keys whose values our flags own: (JSON key, the flag(s) that set it).
_OWNED_BATCH_KEYS = (
    ("train_batch_size", "--global-batch-size"),
    ("train_micro_batch_size_per_gpu", "--micro-batch-size"),
    ("gradient_accumulation_steps", "--global-batch-size / --micro-batch-size"),
    ("gradient_clipping", "--clip-grad"),
)
# Sections we build ourselves (so that they share one set of flags across ZeRO stages and
# the scheduler follows Megatron's schedule).
_OWNED_SECTIONS = (
    ("optimizer", "--lr, --weight-decay, --adam-beta1/2, --adam-eps"),
    (
        "scheduler",
        "--lr-warmup-iters/-samples, --lr-decay-style, --lr-decay-iters/-samples, --min-lr",
    ),
)
# Large enough that DeepSpeed never prints its own progress lines; the loop logs instead.
_QUIET_STEPS_PER_PRINT = 2**31 - 1


@dataclass(frozen=True)
class DeepSpeedSettings:
    config: dict[str, Any]  # the dict handed to deepspeed.initialize
    source: str  # the JSON's path, or "<default>"
    zero_stage: int
    precision: str  # fp32 | bf16 | fp16
    global_batch_size: int
    grad_accum_steps: int


def load_deepspeed_json(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed-config: {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--deepspeed-config: {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"--deepspeed-config: {path} must hold a JSON object, got {type(data).__name__}"
        )
    return data


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def resolve_deepspeed_config(
    training: TrainingConfig,
    data_parallel_size: int,
    *,
    device_type: str,
    ds_json: dict[str, Any] | None = None,
) -> DeepSpeedSettings:
    """Merge our flags into the DeepSpeed JSON (``training.deepspeed_config``, or ``ds_json``
    when given) and check it. ``device_type`` is the accelerator's name ("cpu", "cuda", ...):
    fp16 is refused on CPU here, before any process group exists."""
    source = training.deepspeed_config or "<default>"
    raw = load_deepspeed_json(training.deepspeed_config) if ds_json is None else ds_json
    config = copy.deepcopy(raw)
    global_batch, accum = training.batch_layout(data_parallel_size)
    ours = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": float(training.clip_grad),
    }
    for key, flag in _OWNED_BATCH_KEYS:
        if key in config and config[key] != "auto" and config[key] != ours[key]:
            raise ConfigError(
                f"--deepspeed-config: {source}: key {key!r} = {config[key]!r} conflicts with "
                f"{ours[key]!r} from {flag}; batch sizes and clipping are set by the flags only "
                "(remove the key from the JSON or make it match)"
            )
        config[key] = ours[key]
    for key, flags in _OWNED_SECTIONS:
        if key in config:
            raise ConfigError(
                f"--deepspeed-config: {source}: key {key!r} is not allowed: the {key} is built "
                f"from {flags} (remove the section from the JSON)"
            )
    if "wandb" in config:
        # DeepSpeed's own monitor would log only samples and lr (and needs wandb on every rank).
        raise ConfigError(
            f"--deepspeed-config: {source}: key 'wandb' is not supported: Weights & Biases is "
            "set with --wandb-project, --wandb-exp-name, --wandb-save-dir, --wandb-entity, "
            "--wandb-mode (remove the section from the JSON)"
        )
    _apply_precision_flag(config, source, training)
    if _enabled(config.get("amp")):
        raise ConfigError(
            f"--deepspeed-config: {source}: key 'amp' (apex AMP) is not supported; use 'bf16' or 'fp16'"
        )
    fp16, bf16 = _enabled(config.get("fp16")), _enabled(config.get("bf16"))
    if fp16 and bf16:
        raise ConfigError(
            f"--deepspeed-config: {source}: keys 'fp16' and 'bf16' are both enabled; choose one"
        )
    precision = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    if precision == "fp16" and device_type == "cpu":
        where = "--fp16" if training.fp16 else f"--deepspeed-config: {source}"
        raise ConfigError(
            f"{where}: fp16 needs a GPU; use a bf16 or fp32 config (--bf16, or e.g. "
            "ds_configs/zero2_bf16.json)"
        )
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(
            f"--deepspeed-config: {source}: key 'zero_optimization' must be an object"
        )
    stage = zero.get("stage", 0)
    if not is_int(stage) or stage not in (0, 1, 2, 3):
        raise ConfigError(
            f"--deepspeed-config: {source}: key 'zero_optimization.stage' must be 0, 1, 2 or 3, "
            f"got {stage!r}"
        )
    _check_grad_accum_dtype(config, source, precision, stage)
    if zero.get("compute_grad_norm", True) is False and training.clip_grad > 0:
        # DeepSpeed would raise this inside the engine build, after the process group.
        raise ConfigError(
            f"--deepspeed-config: {source}: 'zero_optimization.compute_grad_norm' false leaves "
            f"no norm to clip with: set --clip-grad 0 (then no gradient norm is logged or "
            f"checked), or remove the key (--clip-grad is {training.clip_grad:g})"
        )
    # Our optimizer is torch's AdamW (or apex FusedAdam), which ZeRO wraps fine but DeepSpeed
    # calls "untested" unless told otherwise.
    config["zero_allow_untested_optimizer"] = True
    config.setdefault("steps_per_print", _QUIET_STEPS_PER_PRINT)
    # DeepSpeed's throughput timer (on by default) brackets every micro-batch with a device
    # synchronize when the engine has no DataLoader of its own, as here; the loop logs its own
    # throughput. A JSON that sets it keeps its value.
    timers = config.setdefault("timers", {})
    if isinstance(timers, dict) and isinstance(timers.setdefault("throughput", {}), dict):
        timers["throughput"].setdefault("enabled", False)
    return DeepSpeedSettings(
        config=config,
        source=source,
        zero_stage=stage,
        precision=precision,
        global_batch_size=global_batch,
        grad_accum_steps=accum,
    )


def _apply_precision_flag(config: dict[str, Any], source: str, training: TrainingConfig):
    """--bf16/--fp16 enable their section of the DeepSpeed config (keeping its other keys,
    e.g. fp16's loss-scale settings), overriding a JSON in fp32; a JSON that enables the
    other half precision contradicts the flag."""
    flag = "bf16" if training.bf16 else "fp16" if training.fp16 else None
    if flag is None:
        return
    other = "fp16" if flag == "bf16" else "bf16"
    if _enabled(config.get(other)):
        raise ConfigError(
            f"--{flag}: --deepspeed-config {source} enables {other}; drop the flag or use a "
            f"{flag} config (e.g. ds_configs/zero2_{flag}.json)"
        )
    section = config.get(flag)
    config[flag] = {**(section if isinstance(section, dict) else {}), "enabled": True}


def _check_grad_accum_dtype(config: dict[str, Any], source: str, precision: str, stage: int):
    """DeepSpeed accumulates in another dtype than the model's only under ZeRO 1-3 (at stage
    0 it stops with NotImplementedError after the rendezvous): say so now, in one line."""
    data_types = config.get("data_types")
    accum = data_types.get("grad_accum_dtype") if isinstance(data_types, dict) else None
    if accum is None or stage > 0:
        return
    from deepspeed.runtime.config import DtypeEnum

    try:
        accum_dtype = DtypeEnum(accum).value
    except ValueError:
        raise ConfigError(
            f"--deepspeed-config: {source}: 'data_types.grad_accum_dtype' {accum!r} is not a "
            "dtype DeepSpeed knows (fp32, bf16, fp16)"
        ) from None
    model = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
    if str(accum_dtype) != f"torch.{model}":
        raise ConfigError(
            f"--deepspeed-config: {source}: 'data_types.grad_accum_dtype' {accum!r} differs "
            f"from the model's {precision}, which DeepSpeed supports only with ZeRO stage 1-3 "
            "(remove the key, or use e.g. ds_configs/zero1_bf16.json)"
        )

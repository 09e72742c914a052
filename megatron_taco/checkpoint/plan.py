"""What a run does with its --load and --save, decided once, before any process group exists.

``plan_resume(request) -> ResumePlan`` is the one place that decides "may this run use that
directory, and how": every refusal (a ConfigError, one line) and every fall-back comes from
here, for pretraining, fine-tuning, taco-convert-checkpoint and taco-export-hf alike:

    fresh      nothing to load (no --load, or no tracker in it yet)
    resume     iteration N of --load, everything restored (model, optimizer, RNG, data)
    fallback   resume from M: the checkpoint the tracker names is incomplete or corrupt and
               --load-fallback is given (M is the newest older one that verifies)
    weights    --finetune: the model weights of iteration N only, from iteration 0
    read       a tool reads iteration N (conversion, export, a fine-tuning's pretrained model)

The plan is computed on every rank from the same flags and files; the verification that
reads every byte runs once per node (``once``), and after the rendezvous the ranks compare
their plans (rendezvous.agree_on_load), so a stale network-file-system view cannot make two
ranks load different checkpoints. Executing it is load.load_checkpoint's; a checkpoint that
verifies but whose tensors misfit the model is only found then, and its fall-back is
decided by ``ResumeRequest.check`` here as well.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.checkpoint.deepspeed_files import (
    CONVERTER,
    CheckpointInfo,
    describe_checkpoint,
    ds_format,
)
from megatron_taco.checkpoint.errors import (
    CheckpointError,
    CheckpointInvalid,
    CheckpointTooNew,
    CheckpointUnreadable,
)
from megatron_taco.checkpoint.layout import (
    checkpoint_tag,
    complete_iterations,
    read_tracker,
    tracker_path,
)
from megatron_taco.checkpoint.manifest import read_metadata, verify_checkpoint
from megatron_taco.checkpoint.ownership import (
    check_new_save,
    check_own_save,
    check_own_stores,
    check_save_dir,
)
from megatron_taco.errors import ConfigError

FRESH, RESUME, FALLBACK, WEIGHTS, READ = "fresh", "resume", "fallback", "weights", "read"

# DeepSpeed checkpoint options that bypass this package's writer or loader.
_UNSUPPORTED_DS_CHECKPOINT_KEYS = {
    "writer": "checkpoints are written by megatron_taco's own writer",
    "use_node_local_storage": "every rank must see the same checkpoint directory",
    "load_universal": "DeepSpeed loads universal checkpoints with unrestricted pickle",
}


@dataclass(frozen=True)
class RunLayout:
    """What a checkpoint must fit to be resumed by this run."""

    world_size: int
    tp_size: int
    zero_stage: int = 0
    precision: str = "fp32"
    optimizer: str | None = None  # training.optim.optimizer_implementation()
    ds_config: Mapping[str, Any] = field(default_factory=dict)
    deepspeed_config: str | None = None  # the JSON's path, named in the convert command

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size


@dataclass(frozen=True)
class Candidate:
    """A checkpoint of --load under consideration, as per-checkpoint checks see it."""

    load_dir: str
    iteration: int
    meta: dict[str, Any]

    @property
    def iter_dir(self) -> str:
        return os.path.join(self.load_dir, checkpoint_tag(self.iteration))


Check = Callable[[Candidate], None]


@dataclass(frozen=True)
class ResumeRequest:
    checkpoint: CheckpointConfig
    # None: a reader (conversion, export, a fine-tuning's pretrained model): nothing of the
    # checkpoint is restored into a run, so no layout is checked.
    layout: RunLayout | None = None
    models: tuple[str, ...] | None = None  # metadata.json "model" names accepted (None: any)
    # The configs that name this run's tokenizer (data.config.DataConfig or alike): a
    # checkpoint trained with another one is refused.
    tokenizer: Any = None
    checks: tuple[Check, ...] = ()  # the recipe's own (SAS: the store's origin)
    # (flag, directory) of the stores outside the checkpoints that the run writes and its
    # checkpoints need (SAS: the replacement store).
    stores: tuple[tuple[str, str], ...] = ()
    required: bool = False  # a reader: no checkpoint is an error, not a fresh start

    def check(self, candidate: Candidate) -> None:
        """Every check of one chosen checkpoint beyond its own integrity: the layout it can be
        resumed at, the tokenizer, the recipe's. Also for a fall-back chosen after the
        engine exists (load.execute_plan)."""
        if self.layout is not None:
            _check_layout(self.checkpoint, self.layout, candidate)
        if self.tokenizer is not None:
            _check_tokenizer(self.tokenizer, candidate)
        for check in self.checks:
            check(candidate)


@dataclass(frozen=True)
class ResumePlan:
    action: str  # FRESH, RESUME, FALLBACK, WEIGHTS, READ
    load_dir: str | None = None
    iteration: int | None = None
    checksum: str | None = None  # metadata.json's: what the ranks compare
    note: str = ""  # one line: what the run does and why
    warning: str | None = None  # what rank 0 warns of (a fall-back, a --load with nothing)
    restore_optimizer: bool = False
    restore_rng: bool = False

    @property
    def loads(self) -> bool:
        return self.iteration is not None

    @property
    def starts_fresh(self) -> bool:
        """Restores no training state: nothing of an earlier run of this one is resumed."""
        return self.action in (FRESH, WEIGHTS, READ)

    @property
    def iter_dir(self) -> str | None:
        return (
            None
            if self.iteration is None
            else os.path.join(self.load_dir, checkpoint_tag(self.iteration))
        )

    def agreement(self) -> str:
        """What every rank must see alike (rendezvous.agree_on_load)."""
        if self.iteration is None:
            return "no checkpoint (a fresh start)"
        return f"iteration {self.iteration} (metadata.json checksum {self.checksum})"


def plan_resume(
    request: ResumeRequest, *, once: Callable[[Callable[[], Any]], Any] = lambda fn: fn()
) -> ResumePlan:
    """The checks every rank runs before the rendezvous, and what the run will load.
    ``once(fn)`` runs the verification, which reads every byte of the checkpoint, once for
    the ranks that share it (the driver: once per node) and hands every rank its result."""
    ck, layout = request.checkpoint, request.layout
    if layout is not None:
        _check_deepspeed_section(layout.ds_config)
    if ck.save is not None and layout is None:
        check_new_save(ck.save)  # a reader writing a new checkpoint (conversion)
    elif ck.save is not None:
        check_save_dir(ck.save)
        check_own_save(ck)
    if ck.load is None:
        plan = ResumePlan(FRESH, note="starting from scratch")
    else:
        if layout is not None and layout.zero_stage == 3 and (ck.finetune or ck.no_load_optim):
            flag = "--finetune" if ck.finetune else "--no-load-optim"
            raise ConfigError(
                f"{flag}: not supported with ZeRO stage 3, where DeepSpeed rebuilds the weights "
                "without the optimizer files through zero_to_fp32, which unpickles them "
                "unsafely; load with a ZeRO stage 0-2 config"
            )
        plan = _plan_for(request, once(functools.partial(_choose, request)))
    if request.stores:
        check_own_stores(ck, request.stores, fresh=plan.starts_fresh)
    return plan


def _plan_for(request: ResumeRequest, chosen: tuple[int, str, str | None] | None) -> ResumePlan:
    ck = request.checkpoint
    if chosen is None:
        if request.required:
            raise CheckpointError(
                f"--load: {tracker_path(ck.load)} does not exist; give --ckpt-step"
            )
        line = f"--load {ck.load}: no {os.path.basename(tracker_path(ck.load))} found"
        return ResumePlan(
            FRESH,
            load_dir=ck.load,
            note="starting from scratch",
            warning=f"{line}, training from scratch",
        )
    iteration, checksum, fell_back = chosen
    candidate = Candidate(
        ck.load, iteration, read_metadata(os.path.join(ck.load, checkpoint_tag(iteration)))
    )
    request.check(candidate)
    if request.layout is None:
        action, note = READ, f"reading {candidate.iter_dir}"
    elif ck.finetune:
        action, note = WEIGHTS, f"fine-tuning from {ck.load}"
    else:
        action = RESUME if fell_back is None else FALLBACK
        note = f"resumed from {ck.load} at iteration {iteration}" + (
            "" if fell_back is None else " (--load-fallback)"
        )
    restore = action in (RESUME, FALLBACK)
    warning = None
    if fell_back is not None:
        warning = f"{fell_back}; --load-fallback: loading iteration {iteration} instead"
    return ResumePlan(
        action,
        ck.load,
        iteration,
        checksum,
        note,
        warning,
        restore_optimizer=restore and not ck.no_load_optim,
        restore_rng=restore and not ck.no_load_rng,
    )


def _check_deepspeed_section(ds_config: Mapping[str, Any]) -> None:
    section = ds_config.get("checkpoint")
    for key, why in _UNSUPPORTED_DS_CHECKPOINT_KEYS.items():
        if isinstance(section, dict) and section.get(key):
            raise ConfigError(f"--deepspeed-config: key 'checkpoint.{key}' is not supported: {why}")


# -- choosing the checkpoint --------------------------------------------------------------


def newest_verified(
    load_dir: str,
    below: int | None,
    *,
    tp_size: int | None = None,
    models: tuple[str, ...] | None = None,
) -> tuple[int, str] | None:
    """(iteration, checksum) of the newest complete checkpoint in ``load_dir`` older than
    ``below`` that verifies."""
    for iteration in reversed(complete_iterations(load_dir)):
        if below is not None and iteration >= below:
            continue
        try:
            meta = verify_checkpoint(load_dir, iteration, tp_size=tp_size, models=models)
        except (CheckpointUnreadable, CheckpointTooNew):
            raise  # not proven corrupt: never skipped
        except ConfigError:
            continue
        return iteration, meta["checksum"]
    return None


def _choose(request: ResumeRequest) -> tuple[int, str, str | None] | None:
    """(iteration, checksum, why it is a fall-back or None) of the checkpoint --load will
    restore, verified; None: no tracker, a fresh start."""
    ck = request.checkpoint
    load_dir = ck.load
    if request.required and not os.path.isdir(load_dir):
        raise CheckpointError(f"--load: {load_dir} is not a directory")
    # The checkpoint the tracker or --ckpt-step names is not checked for its tensor-parallel
    # size here: _check_layout refuses it with the command that converts it. The fall-back
    # search skips other sizes, as load._agreed_newest_verified does.
    kw = dict(models=request.models)
    tp = None if request.layout is None else request.layout.tp_size
    try:
        iteration = ck.ckpt_step if ck.ckpt_step is not None else read_tracker(load_dir)
    except CheckpointUnreadable:
        raise
    except ConfigError as e:
        older = newest_verified(load_dir, None, tp_size=tp, **kw)
        if older is None:
            raise
        if not ck.load_fallback:
            raise ConfigError(f"{e}; {_way_on(request, older[0])}") from None
        return (*older, str(e))
    if iteration is None:
        return None
    try:
        meta = verify_checkpoint(load_dir, iteration, **kw)
        return iteration, meta["checksum"], None
    except CheckpointInvalid as e:
        named = "--ckpt-step" if ck.ckpt_step is not None else tracker_path(load_dir)
        problem = (
            f"--load: checkpoint iteration {iteration} (named by {named}) is incomplete or "
            f"corrupt: {e}"
        )
        older = newest_verified(load_dir, iteration, tp_size=tp, **kw)
    if older is None:
        raise CheckpointInvalid(f"{problem}; no older checkpoint in {load_dir} verifies either")
    if ck.load_fallback:
        return (*older, problem)
    raise CheckpointInvalid(f"{problem}; {_way_on(request, older[0])}")


def _way_on(request: ResumeRequest, iteration: int) -> str:
    # A reader (conversion, export, a fine-tuning's pretrained model) has no --load-fallback.
    fallback = "" if request.layout is None else ", or --load-fallback to fall back automatically"
    return (
        f"the last complete checkpoint there is iteration {iteration}: pass --ckpt-step "
        f"{iteration}{fallback}"
    )


# -- resuming at this run's layout ---------------------------------------------------------


def _check_layout(ck: CheckpointConfig, layout: RunLayout, candidate: Candidate) -> None:
    """Refuse a checkpoint DeepSpeed cannot restore at this run's layout (tensor/data-parallel
    sizes, ZeRO stage, precision, world size for the RNG states; --finetune: the
    tensor-parallel size only), with the command that converts it."""
    meta, iter_dir = candidate.meta, candidate.iter_dir
    tp_size, dp = layout.tp_size, layout.dp_size
    zero_stage, precision = layout.zero_stage, layout.precision
    saved_ds = (meta.get("configs") or {}).get("deepspeed")
    saved_stage, saved_precision = ds_format(saved_ds)
    saved_tp = meta.get("tensor_model_parallel_size", tp_size)
    saved_dp = meta.get("data_parallel_size", dp)
    convert = (
        f"{CONVERTER} --load {ck.load} --ckpt-step {candidate.iteration} "
        f"--save NEW_DIR --tensor-model-parallel-size {tp_size} --data-parallel-size {dp} "
        f"--deepspeed-config {layout.deepspeed_config or 'DS_JSON'}, then --load NEW_DIR"
        + ("" if (saved_tp, saved_dp) == (tp_size, dp) else " --no-load-rng")
    )
    if saved_tp != tp_size:
        raise ConfigError(
            f"--tensor-model-parallel-size: {iter_dir} was saved with tensor parallel size "
            f"{saved_tp}, this run uses {tp_size}; convert it: {convert}"
        )
    if ck.finetune:
        return  # the module only: another data-parallel layout and ZeRO stage load as well
    if 3 in (saved_stage, zero_stage) and (saved_stage, saved_dp) != (zero_stage, dp):
        # The converter reads ZeRO-3 checkpoints but writes only stages 0-2.
        how = (
            f"; convert it: {convert}"
            if zero_stage != 3
            else f"; convert it into ZeRO stage 0-2 ({CONVERTER}) and resume with a stage 0-2 "
            "config"
        )
        raise ConfigError(
            f"--load: {iter_dir} (ZeRO stage {saved_stage}, data parallel {saved_dp}) cannot be "
            f"resumed with ZeRO stage {zero_stage} at data parallel {dp}: ZeRO-3 checkpoints "
            f"resume only at their own layout{how}"
        )
    # A checkpoint that does not say how it was saved is left to DeepSpeed.
    if not ck.no_load_optim and isinstance(saved_ds, dict):
        _check_optimizer_layout(
            iter_dir, (saved_stage, saved_precision, saved_dp), (zero_stage, precision, dp), convert
        )
    saved_optimizer = meta.get("optimizer")
    optimizer = layout.optimizer
    if not ck.no_load_optim and optimizer and saved_optimizer not in (None, optimizer):
        raise ConfigError(
            f"--load: {iter_dir} holds the state of {saved_optimizer}, this run uses "
            f"{optimizer} (apex's FusedAdam is used where apex and its CUDA extensions import), "
            "whose state it cannot load: resume where the same one is used, or pass "
            "--no-load-optim to restart the optimizer moments, keeping the LR schedule"
        )
    if not ck.no_load_rng:
        _check_rng_layout(iter_dir, meta, layout.world_size)


def _check_optimizer_layout(iter_dir: str, saved: tuple, now: tuple, convert: str) -> None:
    (saved_stage, saved_precision, saved_dp), (stage, precision, dp) = saved, now
    if (saved_stage > 0) != (stage > 0) or saved_precision != precision:
        raise ConfigError(
            f"--load: {iter_dir} holds the optimizer state of ZeRO stage {saved_stage} in "
            f"{saved_precision}, which DeepSpeed cannot load into ZeRO stage {stage} in "
            f"{precision}; convert it: {convert} (or pass --no-load-optim to restart the "
            "optimizer moments, keeping the LR schedule)"
        )
    if stage > 0 and saved_dp != dp:
        raise ConfigError(
            f"--load: {iter_dir} was saved at data parallel size {saved_dp} with ZeRO stage "
            f"{saved_stage}, which partitions the optimizer state over the data-parallel "
            f"ranks; this run has data parallel size {dp}. Convert it: {convert} (or pass "
            "--no-load-optim to restart the optimizer moments, keeping the LR schedule)"
        )


def _check_rng_layout(iter_dir: str, meta: dict[str, Any], world_size: int) -> None:
    if "converted_from" in meta and meta.get("rng_states") is False:
        raise ConfigError(
            f"--load: {iter_dir} was written by {CONVERTER} at a new layout and holds no RNG "
            "states (they are per rank); pass --no-load-rng"
        )
    saved = meta.get("world_size", world_size)
    if saved != world_size:
        raise ConfigError(
            f"--load: {iter_dir} holds the RNG states of {saved} ranks, this run has "
            f"{world_size}; pass --no-load-rng to resume without them"
        )


def _check_tokenizer(data: Any, candidate: Candidate) -> None:
    """The checkpoint was trained with the tokenizer this run reads, by content: its
    embedding rows are that tokenizer's ids, and another vocabulary of the same size would
    load without an error. Also with --finetune, which keeps the embeddings too."""
    from megatron_taco.data.tokenizer import WORDPIECE_TYPES, check_checkpoint_tokenizer

    record = candidate.meta.get("tokenizer")
    if not isinstance(record, dict):
        return
    # the copy in the checkpoint's --save, else the file its configs name (as readers look)
    saved_data = (candidate.meta.get("configs") or {}).get("data") or {}
    named = saved_data.get(
        "vocab_file" if record.get("type") in WORDPIECE_TYPES else "tokenizer_model"
    )
    copy = record.get("file")
    copy = os.path.join(candidate.load_dir, *copy.split("/")) if isinstance(copy, str) else None
    recorded = next((f for f in (copy, named) if f and os.path.isfile(f)), None)
    check_checkpoint_tokenizer(data, record, candidate.iter_dir, recorded)


def with_initialisation(plan: ResumePlan, source: ResumePlan, what: str) -> ResumePlan:
    """A fresh plan of a run whose weights start from ``source`` (fine-tuning's pretrained
    model): said so in its note."""
    if not plan.starts_fresh:
        return plan
    return dataclasses.replace(plan, note=f"{what} from {source.iter_dir}", warning=None)


def find_checkpoint(
    load_dir: str, ckpt_step: int | None = None, *, verify: bool = True
) -> CheckpointInfo:
    """A reader's checkpoint (conversion, export, evaluation): iteration ``ckpt_step`` of
    ``load_dir`` or the one its tracker names, planned (and verified) by plan_resume; with
    ``verify`` False, one a plan of this process verified already."""
    if verify:
        request = ResumeRequest(CheckpointConfig(load=load_dir, ckpt_step=ckpt_step), required=True)
        ckpt_step = plan_resume(request).iteration
    elif ckpt_step is None:
        ckpt_step = read_tracker(load_dir)
        if ckpt_step is None:
            raise CheckpointError(
                f"--load: {tracker_path(load_dir)} does not exist; give --ckpt-step"
            )
    meta = read_metadata(os.path.join(load_dir, checkpoint_tag(ckpt_step)))
    return describe_checkpoint(load_dir, ckpt_step, meta)

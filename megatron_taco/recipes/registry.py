"""The model kinds a checkpoint's metadata.json can name, and how to rebuild each one."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from megatron_taco.checkpoint.deepspeed_files import (
    CheckpointInfo,
    TrainingStates,
    read_states,
)
from megatron_taco.checkpoint.errors import CheckpointError
from megatron_taco.checkpoint.layout import METADATA_FILENAME as METADATA
from megatron_taco.checkpoint.plan import find_checkpoint
from megatron_taco.checkpoint.reshard import ModelBuilder, ModelLayout
from megatron_taco.data.tokenizer import SENTENCEPIECE, WORDPIECE_TYPES, file_sha256, load_tokenizer
from megatron_taco.errors import ConfigError
from megatron_taco.parallel.state import single_process_state

FINETUNED = "finetune"  # metadata.json's "model" in a fine-tuning run's checkpoints


@dataclass(frozen=True)
class ModelKind:
    name: str  # as metadata.json's "model" says it
    config_cls: type
    pretraining_cls: type  # forward(batch) -> dict with "loss"


def model_kind(name: str, where: str = "metadata.json") -> ModelKind:
    if name == "TACO":
        from megatron_taco.models.taco.config import TacoConfig
        from megatron_taco.models.taco.model import TacoForPretraining

        return ModelKind("TACO", TacoConfig, TacoForPretraining)
    if name == "SAS":
        from megatron_taco.models.sas.config import SasConfig
        from megatron_taco.models.sas.model import SasForPretraining

        return ModelKind("SAS", SasConfig, SasForPretraining)
    raise CheckpointError(f"{where}: unknown model {name!r} (expected TACO or SAS)")


@dataclass(frozen=True)
class FinetunedTask:
    """What a fine-tuned checkpoint's metadata.json says about its task head."""

    encoder: str  # "TACO" | "SAS"
    task: str
    kind: str  # tasks.KINDS
    num_labels: int  # TaskModel's: classes; regression 1; span 2; choices per question
    labels: tuple[str, ...]  # class names in label-id order (classification)


def finetuned_task(info: CheckpointInfo) -> FinetunedTask:
    from megatron_taco.tasks import TASKS

    where = f"{info.iter_dir}/{METADATA}"
    task = info.meta.get("task")
    encoder = (info.meta.get("pretrained") or {}).get("model")
    if task not in TASKS:
        raise CheckpointError(f"{where}: unknown task {task!r} (expected one of {sorted(TASKS)})")
    model_kind(str(encoder), f"{where} 'pretrained'")
    known = TASKS[task]
    labels = tuple(info.meta.get("labels") or known.labels)
    if known.kind == "classification" and not labels:
        raise CheckpointError(
            f"{where}: no label names for task {task} (checkpoints record them since the "
            "fine-tuned export exists); fine-tune it again to export it"
        )
    num_labels = len(labels) if known.kind == "classification" else known.num_labels
    return FinetunedTask(str(encoder), task, known.kind, num_labels, labels)


def checkpoint_tokenizer(
    info: CheckpointInfo, tokenizer_model: str | None, flag: str = "--tokenizer-model"
) -> tuple[str, str]:
    """(file, --tokenizer-type) of a checkpoint's tokenizer: ``tokenizer_model`` (the
    ``flag``'s) when given, else the copy in the checkpoint's --save directory, else the file
    its configs name (checkpoints written before the copy). A file whose content is not the
    one the checkpoint recorded is refused."""
    data = info.configs.get("data") or {}
    record = info.meta.get("tokenizer")
    record = record if isinstance(record, dict) else {}
    kind = record.get("type") or data.get("tokenizer_type") or SENTENCEPIECE
    named = data.get("vocab_file" if kind in WORDPIECE_TYPES else "tokenizer_model")
    if tokenizer_model:
        candidates = [tokenizer_model]
    else:
        copy = record.get("file")
        root = os.path.dirname(os.path.abspath(info.iter_dir))
        candidates = [os.path.join(root, *copy.split("/")) if copy else None, named]
    found = [c for c in candidates if c and os.path.isfile(c)]
    if not found:
        tried = ", ".join(c for c in candidates if c) or "none recorded"
        raise ConfigError(
            f"{flag}: the tokenizer named by {info.iter_dir}/metadata.json is missing "
            f"({tried}); give the one the checkpoint was trained with"
        )
    want = record.get("sha256")
    if not want:
        return found[0], kind
    # a damaged copy in --save falls back to the original file while that one is intact
    path = next((c for c in found if file_sha256(c) == want), None)
    if path is None:
        raise ConfigError(
            f"{flag}: {', '.join(found)} {'is' if len(found) == 1 else 'are'} not the tokenizer "
            f"{info.iter_dir} was trained with (its metadata.json records {kind}, "
            f"{record.get('vocab_size')} pieces, sha256 {want[:12]})"
        )
    return path, kind


def checkpoint_model_config(info: CheckpointInfo, tokenizer_model: str | None) -> tuple[Any, Any]:
    """(ModelKind, model config with its vocabulary size) from a checkpoint's metadata."""
    name = finetuned_task(info).encoder if info.model == FINETUNED else info.model
    kind = model_kind(name, f"{info.iter_dir}/{METADATA}")
    path, tokenizer_type = checkpoint_tokenizer(info, tokenizer_model)
    try:
        vocab_size = load_tokenizer(path, tokenizer_type).vocab_size
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer-model: {e}") from None
    names = {f.name for f in dataclasses.fields(kind.config_cls)}
    saved = info.configs.get("model") or {}
    try:
        config = kind.config_cls(**{k: v for k, v in saved.items() if k in names})
        config = config.with_vocab_size(vocab_size)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{info.iter_dir}/metadata.json: bad model config ({e})") from None
    return kind, config


def model_builder(info: CheckpointInfo, tokenizer_model: str | None):
    """(model config with its vocabulary size, builder(parallel, vocab_size) of the
    pretraining model, or of the fine-tuned TaskModel) from the checkpoint's metadata."""
    kind, config = checkpoint_model_config(info, tokenizer_model)
    task = finetuned_task(info) if info.model == FINETUNED else None

    def build(parallel, vocab_size: int):
        # Dropout changes no parameter, and at tp > 1 it would need the RNG tracker; the
        # tools that read weights gain nothing from compiled layers.
        cfg = dataclasses.replace(
            config.with_vocab_size(vocab_size),
            hidden_dropout=0.0,
            attention_dropout=0.0,
            compile=False,
        )
        if task is not None:
            from megatron_taco.models.finetune import TaskModel

            return TaskModel(
                kind.name,
                cfg,
                parallel,
                task_kind=task.kind,
                num_labels=task.num_labels,
                classifier_dropout=0.0,
            )
        return kind.pretraining_cls(cfg, parallel)

    return config, build


def read_checkpoint(
    load: str | CheckpointInfo,
    ckpt_step: int | None = None,
    tokenizer_model: str | None = None,
    *,
    optimizer: bool = True,
) -> tuple[TrainingStates, Any, ModelBuilder]:
    """(every tensor of the checkpoint merged to full size, model config, builder), whatever
    tensor-parallel size and ZeRO stage (0-3) wrote it; ``load`` is a --load directory or a
    checkpoint already found. ``optimizer=False`` reads only the model files (the fp32
    master weights of ZeRO 1-2 live in the optimizer files)."""
    info = load if isinstance(load, CheckpointInfo) else find_checkpoint(load, ckpt_step)
    config, build = model_builder(info, tokenizer_model)
    states = read_states(
        info, ModelLayout(build, info.tp_size, config.vocab_size), optimizer=optimizer
    )
    return states, config, build


def load_pretraining_model(
    path: str, tokenizer_model: str | None = None, ckpt_step: int | None = None
):
    """(the pretraining model of a --load directory, at its latest iteration or
    ``ckpt_step``, whatever tensor-parallel size and ZeRO stage wrote it, rebuilt at tp=1 in
    eval mode without dropout; the checkpoint's info). Reads the optimizer files too: under
    ZeRO 1-2 with bf16 the fp32 master weights live there, the model files hold only bf16
    copies."""
    states, config, build = read_checkpoint(path, ckpt_step, tokenizer_model=tokenizer_model)
    (state_dict,) = ModelLayout(build, 1, config.vocab_size).split(states.full_state_dict())
    model = build(single_process_state(), config.vocab_size)
    model.load_state_dict(state_dict, strict=True)
    return model.eval(), states.info


def model_size_of(load: str | None, ckpt_step: int | None) -> str | None:
    """The preset size ("small", "base", ...) a checkpoint's metadata records (for the
    fine-tuning protocols' size-dependent grids); verified later, when its run starts."""
    if not load:
        raise ConfigError("--load: the pretrained checkpoint directory is required")
    try:
        info = find_checkpoint(load, ckpt_step, verify=False)
    except (CheckpointError, ConfigError) as e:  # as the --load flag's one line
        message = str(e)
        raise ConfigError(
            message if message.startswith("--load") else f"--load: {message}"
        ) from None
    return (info.configs.get("model") or {}).get("model_size")

"""The fine-tuned half of export_hf.py: a checkpoint of tools/finetune.py (metadata.json
"model": "finetune") as the transformers task class of its encoder's family, with the
task's labels, and a model card.

    config.json         architectures, id2label / label2id, problem_type (classification,
                        regression), the head's config fields (models/finetune_hf.py)
    model.safetensors   encoder + task head
    README.md           the model card: base model, task and data, recipe, the dev scores
                        the run measured (its results.json), the commands

TACO -> TacoFor{SequenceClassification, QuestionAnswering, MultipleChoice} (its remote code,
trust_remote_code=True); SAS -> ElectraFor...; SAS^DA -> DebertaV2For.... The matching
AutoModelFor... class and ``transformers.pipeline`` load the folder; the logits are ours.
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

import torch

from megatron_taco.checkpoint.errors import CheckpointError
from megatron_taco.models.finetune import PRETRAINING_ENCODER_PREFIX
from megatron_taco.models.finetune_hf import (
    AUTO_CLASS,
    HF_CLASS,
    PIPELINE_TAG,
    label_kwargs,
    task_head,
)
from megatron_taco.recipes.finetune_eval import RESULTS_FILE

FAMILY_PREFIX = {"taco": "Taco", "electra": "Electra", "deberta-v2": "DebertaV2"}
FAMILY_NAME = {
    "taco": "TACO (trust_remote_code=True)",
    "electra": "ELECTRA (SAS)",
    "deberta-v2": "DeBERTa-v2 (SAS^DA)",
}


def family_of(encoder: str, config) -> str:
    if encoder == "TACO":
        return "taco"
    return "deberta-v2" if config.disentangled_attention else "electra"


def hf_class_name(family: str, task_kind: str) -> str:
    return FAMILY_PREFIX[family] + HF_CLASS[task_kind]


def save_task_model(
    config,
    task,
    state_dict: dict[str, torch.Tensor],
    out: str,
    special_ids: dict[str, int],
    classifier_dropout: float | None = None,
) -> str:
    """config.json + model.safetensors of ``task`` (registry.FinetunedTask) from a TaskModel's
    full state dict (``special_ids``: export_hf.special_token_ids of the run's tokenizer);
    returns the transformers class name."""
    family = family_of(task.encoder, config)
    prefix = PRETRAINING_ENCODER_PREFIX[task.encoder]
    encoder = {
        prefix + k[len("encoder.") :]: v for k, v in state_dict.items() if k.startswith("encoder.")
    }
    try:
        head_kwargs, head = task_head(
            family, task.kind, state_dict["head.weight"], state_dict["head.bias"]
        )
    except ValueError as e:  # a head transformers' class cannot hold: the checkpoint's, one line
        raise CheckpointError(f"--load: {task.task} cannot be exported: {e}") from None
    dropout = config.hidden_dropout if classifier_dropout is None else classifier_dropout
    kwargs = {**head_kwargs, **label_kwargs(task.kind, task.labels)}
    kwargs["cls_dropout" if family == "deberta-v2" else "classifier_dropout"] = dropout
    name = hf_class_name(family, task.kind)
    if family == "taco":
        from megatron_taco.cli.export_taco_hf import save_taco_model as save
    else:
        from megatron_taco.cli.export_hf import save_model as save
    save(config, encoder, out, special_ids, task=(name, kwargs, head))
    return name


def describe(task, config) -> str:
    family = family_of(task.encoder, config)
    return f"{hf_class_name(family, task.kind)}, {FAMILY_NAME[family]}"


def save_finetuned(
    info, config, task, state_dict, out: str, argv: list[str], special_ids: dict[str, int]
) -> None:
    """The task model and its model card into ``out`` (which holds the tokenizer)."""
    dropout = (info.configs.get("finetune") or {}).get("classifier_dropout")
    name = save_task_model(config, task, state_dict, out, special_ids, dropout)
    files = sorted([*os.listdir(out), "README.md"])
    card = model_card(info, task, config, name, files, argv)
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)


def read_results(load: str, task: str) -> tuple[dict[str, Any] | None, str]:
    """The run's results.json (beside --load, the run's checkpoints/ folder), if it is this
    task's; and where it was looked for."""
    path = os.path.join(os.path.dirname(os.path.abspath(load)), RESULTS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    except (OSError, ValueError):
        return None, path
    ok = isinstance(results, dict) and results.get("task") == task
    return (results if ok else None), path


def _table(rows: dict[str, Any]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows.items())]


def _scores(results: dict[str, Any] | None, iteration: int, where: str) -> list[str]:
    if results is None:
        return [f"No {RESULTS_FILE} of this task was found at {where}: no scores are recorded."]
    epochs = [e for e in results.get("epochs", []) if isinstance(e, dict)]
    if not epochs:
        return [f"{where} holds no evaluated epoch."]
    metrics = sorted({k for e in epochs for k in e if k not in ("epoch", "iteration")})
    lines = [
        f"Dev scores per epoch ({where}; the main metric is {results.get('main_metric')}):",
        "",
        "| epoch | iteration | " + " | ".join(metrics) + " | |",
        "|---" * (len(metrics) + 3) + "|",
    ]
    for e in epochs:
        values = [
            f"{e[m]:.4g}" if isinstance(e.get(m), float) else str(e.get(m, "")) for m in metrics
        ]
        mark = "this model" if e.get("iteration") == iteration else ""
        lines.append(f"| {e.get('epoch')} | {e.get('iteration')} | {' | '.join(values)} | {mark} |")
    chosen = results.get("chosen_epoch")
    exported = [e.get("epoch") for e in epochs if e.get("iteration") == iteration]
    lines += [
        "",
        f"The run reports epoch {chosen} (`--epoch-selection {results.get('selection')}`).",
    ]
    if exported and exported[0] != chosen:
        lines.append(
            f"This model is epoch {exported[0]}'s (the run keeps only its newest checkpoint), "
            "not the reported one."
        )
    return lines


def finetune_command(info, results: dict[str, Any] | None) -> str:
    """The taco-finetune command of the run, as its recorded settings give it."""
    configs = info.configs
    data, ft = configs.get("data") or {}, configs.get("finetune") or {}
    hyper = (results or {}).get("hyperparameters") or {}
    args = [
        "taco-finetune",
        "--load",
        ft.get("load"),
        "--task",
        data.get("task"),
        "--data-dir",
        data.get("data_dir"),
        "--output",
        ft.get("output"),
    ]
    flags = {
        "--lr": "lr",
        "--epochs": "epochs",
        "--global-batch-size": "global_batch_size",
        "--micro-batch-size": "micro_batch_size",
        "--seq-length": "seq_length",
        "--seed": "seed",
        "--weight-decay": "weight_decay",
    }
    for flag, key in flags.items():
        if hyper.get(key) is not None:
            args += [flag, hyper[key]]
    if hyper.get("tensor_model_parallel_size", 1) != 1:
        args += ["--tensor-model-parallel-size", hyper["tensor_model_parallel_size"]]
    ds = (configs.get("training") or {}).get("deepspeed_config")
    if ds:
        args += ["--deepspeed-config", ds]
    return shlex.join(str(a) for a in args if a is not None)


def model_card(info, task, config, class_name: str, files: list[str], argv: list[str]) -> str:
    """README.md of the exported folder."""
    results, where = read_results(os.path.dirname(info.iter_dir), task.task)
    family = family_of(task.encoder, config)
    pretrained = info.meta.get("pretrained") or {}
    data = info.configs.get("data") or {}
    hyper = (results or {}).get("hyperparameters") or {}
    examples = ((results or {}).get("data") or {}).get("examples") or {}
    remote = family == "taco"
    trust = ", trust_remote_code=True" if remote else ""
    encoder = "SAS^DA" if family == "deberta-v2" else task.encoder
    front = [
        "---",
        "library_name: transformers",
        f"pipeline_tag: {PIPELINE_TAG[task.kind]}",
        f"tags: [megatron_taco, {encoder.lower().replace('^', '-')}, {task.task}]",
        "---",
    ]
    if task.kind in ("classification", "regression"):
        usage = [
            "from transformers import pipeline",
            "",
            f'pipe = pipeline("text-classification", model="PATH/TO/THIS/FOLDER"{trust})',
            'pipe("A sentence.")  # pairs: pipe({"text": "...", "text_pair": "..."})',
        ]
    else:  # transformers 5 has no question-answering or multiple-choice pipeline
        usage = [
            f"from transformers import {AUTO_CLASS[task.kind]}, AutoTokenizer",
            "",
            f'model = {AUTO_CLASS[task.kind]}.from_pretrained("PATH/TO/THIS/FOLDER"{trust})',
            f'tokenizer = AutoTokenizer.from_pretrained("PATH/TO/THIS/FOLDER"{trust})',
        ]
        if task.kind == "span":
            usage += [
                'batch = tokenizer("Question?", "Context.", return_tensors="pt")',
                "out = model(**batch)  # start_logits, end_logits per token",
            ]
        else:
            usage += [
                'batch = tokenizer(["Question? Option A", "Question? Option B"], padding=True,',
                '                  return_tensors="pt")',
                "out = model(**{k: v[None] for k, v in batch.items()})  # logits [1, options]",
            ]
    usage = ["```python", *usage, "```"]
    body = [
        f"# {encoder} fine-tuned on {task.task}",
        "",
        f"A {encoder} encoder (megatron_taco) fine-tuned on **{task.task}** ({task.kind}), "
        f"exported as transformers' `{class_name}` ({FAMILY_NAME[family]}); "
        f"load it with `{AUTO_CLASS[task.kind]}`{' and trust_remote_code=True' if remote else ''}.",
        "",
        "## Base model",
        "",
        *_table(
            {
                "pretrained checkpoint": f"`{pretrained.get('load')}`",
                "iteration": pretrained.get("iteration"),
                "model": f"{encoder} ({pretrained.get('model_size') or 'custom'} size)",
                "tokenizer": f"`{data.get('vocab_file') or data.get('tokenizer_model')}` "
                f"({data.get('tokenizer_type') or 'SentencePiece'}, exported as tokenizer.json)",
            }
        ),
        "",
        "## Data",
        "",
        *_table(
            {
                "task": task.task,
                "data": f"`{data.get('data_dir')}`",
                "labels": ", ".join(task.labels) if task.labels else task.kind,
                **{f"{k} examples": v for k, v in examples.items()},
            }
        ),
        "",
        "## Recipe",
        "",
        *(_table(hyper) if hyper else ["Not recorded (no results.json)."]),
        "",
        "## Scores",
        "",
        *_scores(results, info.iteration, where),
        "",
        "## Commands",
        "",
        "Fine-tuned with (from the run's recorded settings):",
        "",
        "```bash",
        finetune_command(info, results),
        "```",
        "",
        "Exported with:",
        "",
        "```bash",
        shlex.join(["taco-export-hf", *argv]),
        "```",
        "",
        "## Use",
        "",
        *usage,
        "",
        f"Files: {', '.join(files)}.",
    ]
    return "\n".join([*front, *body]) + "\n"

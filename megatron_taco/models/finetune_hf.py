"""A fine-tuned TaskModel's head (models/finetune.py) as the head of transformers' task
classes, computing the same logits.

Ours is one linear layer: on [CLS] (classification, regression, every multiple-choice row)
or on every token (span). The classes that load an export, by family:

| family | sequence classification | question answering | multiple choice |
|---|---|---|---|
| TACO (remote code) | ``classifier`` | ``qa_outputs`` | ``classifier`` |
| ELECTRA (SAS) | ``classifier.dense`` -> GELU -> ``classifier.out_proj`` | ``qa_outputs`` | ``classifier`` |
| DeBERTa-v2 (SAS^DA) | ``pooler.dense`` -> activation -> ``classifier`` | ``qa_outputs`` | ``pooler`` + ``classifier`` |

ELECTRA's classification head has a GELU between two linears that no config field turns
off. A linear map passes through it exactly: GELU(z) = z Phi(z) and Phi(z) + Phi(-z) = 1, so
GELU(z) - GELU(-z) = z. ``dense``'s first C rows are our W, the next C rows -W, the others
zero; ``out_proj`` is [I_C, -I_C, 0] with our bias (needs 2C <= hidden size). Inference is
ours up to rounding; fine-tuning the export further would train that parametrisation.
ELECTRA's multiple-choice summary is the [CLS] vector itself (``summary_use_proj`` False,
a "linear" activation). DeBERTa-v2's pooler takes a ``pooler_hidden_act`` of "linear" and an
identity ``dense``.

transformers is not imported here: the caller builds the config from the kwargs.
"""

from __future__ import annotations

from typing import Any

import torch

Tensors = dict[str, torch.Tensor]

FAMILIES = ("taco", "electra", "deberta-v2")
# transformers' class name after the family's prefix (TacoFor..., ElectraFor..., ...).
HF_CLASS = {
    "classification": "ForSequenceClassification",
    "regression": "ForSequenceClassification",
    "span": "ForQuestionAnswering",
    "multiple_choice": "ForMultipleChoice",
}
AUTO_CLASS = {kind: f"AutoModel{suffix}" for kind, suffix in HF_CLASS.items()}
PIPELINE_TAG = {
    "classification": "text-classification",
    "regression": "text-classification",
    "span": "question-answering",
    "multiple_choice": "multiple-choice",
}


def label_kwargs(task_kind: str, labels: tuple[str, ...]) -> dict[str, Any]:
    """id2label / label2id / problem_type for the config (transformers' conventions: a
    regression has one output, labels in output order)."""
    if task_kind == "regression":
        names: tuple[str, ...] = ("score",)
    elif task_kind == "span":
        names = ("start", "end")
    else:
        names = labels
    out: dict[str, Any] = {
        "id2label": dict(enumerate(names)),
        "label2id": {name: i for i, name in enumerate(names)},
    }
    if task_kind in ("classification", "regression"):
        out["problem_type"] = (
            "regression" if task_kind == "regression" else "single_label_classification"
        )
    return out


def _gelu_passthrough(weight: torch.Tensor, bias: torch.Tensor) -> Tensors:
    classes, hidden = weight.shape
    if 2 * classes > hidden:
        raise ValueError(
            f"ELECTRA's classification head passes {classes} classes through its GELU with "
            f"2 x {classes} of its {hidden} hidden units; the model is too narrow"
        )
    dense = weight.new_zeros(hidden, hidden)
    dense[:classes], dense[classes : 2 * classes] = weight, -weight
    eye = torch.eye(classes, dtype=weight.dtype)
    out_proj = weight.new_zeros(classes, hidden)
    out_proj[:, :classes], out_proj[:, classes : 2 * classes] = eye, -eye
    return {
        "classifier.dense.weight": dense,
        "classifier.dense.bias": weight.new_zeros(hidden),
        "classifier.out_proj.weight": out_proj,
        "classifier.out_proj.bias": bias.clone(),
    }


def task_head(
    family: str, task_kind: str, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[dict[str, Any], Tensors]:
    """Our head's ``weight`` [C, H] and ``bias`` [C] -> (config kwargs, the head's tensors
    in ``family``'s task class for ``task_kind``)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    weight, bias = weight.detach().clone(), bias.detach().clone()
    if task_kind == "span":
        return {}, {"qa_outputs.weight": weight, "qa_outputs.bias": bias}
    linear = {"classifier.weight": weight, "classifier.bias": bias}
    if family == "taco":
        return {}, linear
    if family == "electra":
        if task_kind == "multiple_choice":
            summary = {"summary_type": "first", "summary_use_proj": False}
            return {**summary, "summary_activation": "linear"}, linear
        return {}, _gelu_passthrough(weight, bias)
    hidden = weight.shape[1]
    pooler = {
        "pooler.dense.weight": torch.eye(hidden, dtype=weight.dtype),
        "pooler.dense.bias": weight.new_zeros(hidden),
    }
    kwargs = {"pooler_hidden_size": hidden, "pooler_hidden_act": "linear", "pooler_dropout": 0.0}
    return kwargs, {**pooler, **linear}

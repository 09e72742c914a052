"""The TACO half of export_hf.py: a transformers directory with TACO's own modeling code.

    config.json                 hf_remote TacoConfig, with ``auto_map`` naming the classes
    configuration_taco.py       copied from megatron_taco/models/taco/hf_remote/
    modeling_taco.py            (plain torch + transformers; loaded with trust_remote_code=True)
    model.safetensors           TacoForMaskedLM: encoder ``taco.*`` + MLM/MPM heads

AutoModel, AutoModelForMaskedLM (MLM and MPM heads), AutoModelForSequenceClassification,
AutoModelForQuestionAnswering and AutoModelForMultipleChoice load it; the task models start
their new head from scratch.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from megatron_taco.models.taco.config import TacoConfig
from megatron_taco.models.taco.hf import hf_config_kwargs, hf_state_dict

REMOTE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "taco", "hf_remote")
REMOTE_FILES = ("configuration_taco.py", "modeling_taco.py")
AUTO_MAP = {
    "AutoConfig": "configuration_taco.TacoConfig",
    "AutoModel": "modeling_taco.TacoModel",
    "AutoModelForMaskedLM": "modeling_taco.TacoForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_taco.TacoForSequenceClassification",
    "AutoModelForQuestionAnswering": "modeling_taco.TacoForQuestionAnswering",
    "AutoModelForMultipleChoice": "modeling_taco.TacoForMultipleChoice",
}


def save_taco_model(
    config: TacoConfig,
    state_dict: dict[str, torch.Tensor],
    out: str,
    special_ids: dict[str, int],
    *,
    task: tuple[str, dict[str, Any], dict[str, torch.Tensor]] | None = None,
) -> None:
    """TacoForMaskedLM from a TacoForPretraining state dict; with ``task`` = (class name,
    config kwargs, head tensors), that task class from a fine-tuned encoder's state dict.
    ``special_ids``: export_hf.special_token_ids of the run's tokenizer."""
    from safetensors.torch import save_file

    # configuration_taco imports only transformers; importing it here lets transformers
    # serialise config.json exactly as it will read it back.
    from megatron_taco.models.taco.hf_remote.configuration_taco import TacoConfig as HfConfig

    state = hf_state_dict(config, state_dict, heads=task is None)
    architecture, kwargs = "TacoForMaskedLM", {}
    if task is not None:
        architecture, kwargs, head = task
        state.update(head)
    hf = HfConfig(**hf_config_kwargs(config), **special_ids, **kwargs, architectures=[architecture])
    hf.auto_map = dict(AUTO_MAP)
    hf.save_pretrained(out)
    for name in REMOTE_FILES:
        shutil.copyfile(os.path.join(REMOTE_DIR, name), os.path.join(out, name))
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def restrict_tokenizer_inputs(out: str) -> None:
    """TACO has no segment embeddings: the tokenizer then returns no token_type_ids."""
    path = os.path.join(out, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["model_input_names"] = ["input_ids", "attention_mask"]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)

"""The fine-tuning model (models/finetune.py) and layer-wise LR decay (training/optim.py).

* SAS / SAS^DA task heads on the encoder equal a linear layer on transformers' ELECTRA /
  DeBERTa-v2 encoder loaded with the same weights (float64, padded batch): an independent
  reference for the whole fine-tuning forward, encoder included.
* A padded row scores exactly as the same row without padding (TACO and SAS): padding never
  leaks into the [CLS] representation or the span logits.
* Multiple choice scores each option as its own row; the span head never puts a boundary
  on padding; the losses are the textbook ones computed by hand.
* ELECTRA's layer-wise LR decay: lr * decay^(L + 2 - depth), checked on the optimizer groups
  against the formula written out by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_taco.models.finetune import TaskModel, encoder_state_from_pretraining
from megatron_taco.parallel.state import single_process_state
from tests.helpers import VOCAB, build_sas, tiny_config, tiny_sas_config

transformers = pytest.importorskip("transformers")
RTOL = 1e-10


def _close(ours, theirs, what, rtol=RTOL):
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= rtol * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _task_model(kind, config, task_kind="classification", num_labels=3, seed=0):
    torch.manual_seed(seed)
    model = TaskModel(
        kind, config, single_process_state(), task_kind=task_kind, num_labels=num_labels
    )
    model = model.double().eval()
    _randomise(model, seed + 1)
    return model


def _ids_and_mask(b=3, s=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (b, s), generator=g)
    ids[:, 0] = 2  # [CLS]
    mask = torch.ones(b, s, dtype=torch.bool)
    for r in range(1, b):
        mask[r, s - 4 * r :] = False
        ids[r, s - 4 * r :] = 0
    return ids, mask


# ---------------------------------------------------------------------------------------
# SAS against transformers


@pytest.mark.parametrize("da", [False, True], ids=["electra", "deberta_v2"])
def test_sas_classification_equals_transformers_encoder_plus_linear(da):
    from megatron_taco.models.sas.hf import deberta_v2_config_and_state, electra_config_and_state

    config = tiny_sas_config(disentangled_attention=da)
    pretrained = build_sas(config).double()
    _randomise(pretrained, 7)
    model = _task_model("SAS", config)
    model.encoder.load_state_dict(
        encoder_state_from_pretraining("SAS", pretrained.state_dict()), strict=True
    )
    ids, mask = _ids_and_mask()
    labels = torch.tensor([0, 2, 1])
    with torch.no_grad():
        out = model({"input_ids": ids, "attention_mask": mask, "labels": labels})
    if da:
        kwargs, state, _ = deberta_v2_config_and_state(config, pretrained.state_dict())
        ref = transformers.DebertaV2Model(transformers.DebertaV2Config(**kwargs)).double()
        state = {k.removeprefix("deberta."): v for k, v in state.items()}
    else:
        kwargs, state = electra_config_and_state(config, pretrained.state_dict())
        ref = transformers.ElectraModel(
            transformers.ElectraConfig(**kwargs, attn_implementation="eager")
        ).double()
        state = {k.removeprefix("electra."): v for k, v in state.items()}
    result = ref.eval().load_state_dict(state, strict=False)
    assert not result.missing_keys
    with torch.no_grad():
        cls = ref(input_ids=ids, attention_mask=mask.long()).last_hidden_state[:, 0]
    logits = F.linear(cls, model.head.weight, model.head.bias)
    _close(out["logits"], logits, "classification logits")
    _close(out["loss"], F.cross_entropy(logits, labels), "loss")


# ---------------------------------------------------------------------------------------
# Padding, span and multiple choice


@pytest.mark.parametrize("kind", ["TACO", "SAS", "SAS^DA"])
def test_padding_does_not_change_a_rows_scores(kind):
    enc = "TACO" if kind == "TACO" else "SAS"
    config = (
        tiny_config() if enc == "TACO" else tiny_sas_config(disentangled_attention=kind != "SAS")
    )
    for task_kind in ("classification", "span"):
        model = _task_model(enc, config, task_kind, num_labels=2)
        ids, mask = _ids_and_mask(b=2)
        n = int(mask[1].sum())
        with torch.no_grad():
            padded = model({"input_ids": ids, "attention_mask": mask})
            alone = model({"input_ids": ids[1:, :n], "attention_mask": mask[1:, :n]})
        if task_kind == "classification":
            _close(padded["logits"][1:], alone["logits"], f"{kind} [CLS] logits")
        else:
            for key in ("start_logits", "end_logits"):
                _close(padded[key][1:, :n], alone[key], f"{kind} {key}")
                lowest = torch.finfo(padded[key].dtype).min
                assert (padded[key][1, n:] == lowest).all(), "a boundary on padding"


def test_span_loss_is_the_mean_of_start_and_end_cross_entropies():
    model = _task_model("SAS", tiny_sas_config(), "span")
    ids, mask = _ids_and_mask()
    start, end = torch.tensor([3, 0, 5]), torch.tensor([6, 0, 5])
    batch = {"input_ids": ids, "attention_mask": mask, "start_positions": start,
             "end_positions": end}  # fmt: skip
    with torch.no_grad():
        out = model(batch)
    by_hand = 0.5 * (
        F.cross_entropy(out["start_logits"], start) + F.cross_entropy(out["end_logits"], end)
    )
    _close(out["loss"], by_hand, "span loss")


def test_span_head_is_a_plain_linear_layer_without_dropout():
    """BERT's span head (and the exported TacoForQuestionAnswering): in training mode, with
    the encoder's dropout off and the head's dropout high, the logits are still exactly the
    linear layer on the encoder's output; the classification head keeps its dropout."""
    import dataclasses

    config = dataclasses.replace(tiny_sas_config(), hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    span = TaskModel("SAS", config, single_process_state(), task_kind="span", num_labels=2,
                     classifier_dropout=0.9).double().train()  # fmt: skip
    ids, mask = _ids_and_mask()
    with torch.no_grad():
        out = span({"input_ids": ids, "attention_mask": mask})
        start, end = span.head(span.encode(ids, mask)).unbind(-1)
    _close(out["start_logits"][mask], start[mask], "start logits")
    _close(out["end_logits"][mask], end[mask], "end logits")
    classifier = TaskModel("SAS", config, single_process_state(), task_kind="classification",
                           num_labels=2, classifier_dropout=0.9).double().train()  # fmt: skip
    with torch.no_grad():
        logits = classifier({"input_ids": ids, "attention_mask": mask})["logits"]
        plain = classifier.head(classifier.encode(ids, mask)[:, 0])
    assert not torch.allclose(logits, plain)  # the comparison can see a dropout


def test_multiple_choice_scores_every_option_as_its_own_row():
    config = tiny_config()
    mc = _task_model("TACO", config, "multiple_choice", num_labels=4)
    ids, mask = _ids_and_mask(b=4, seed=3)  # 4 options of one question, padded differently
    labels = torch.tensor([2])
    with torch.no_grad():
        out = mc({"input_ids": ids[None], "attention_mask": mask[None], "labels": labels})
        rows = torch.cat(
            [mc.head(mc.encode(ids[i : i + 1], mask[i : i + 1])[:, 0]) for i in range(4)]
        ).view(1, 4)
    _close(out["logits"], rows, "option scores")
    _close(out["loss"], F.cross_entropy(rows, labels), "multiple-choice loss")


def test_regression_is_mean_squared_error_on_the_cls_output():
    model = _task_model("SAS", tiny_sas_config(), "regression", num_labels=1)
    ids, mask = _ids_and_mask()
    target = torch.tensor([0.5, 3.0, 4.25], dtype=torch.float32)
    with torch.no_grad():
        out = model({"input_ids": ids, "attention_mask": mask, "labels": target})
        cls = model.encode(ids, mask)[:, 0]
    by_hand = model.head(cls).squeeze(-1)
    _close(out["predictions"], by_hand, "predictions")
    _close(out["loss"], ((by_hand - target.double()) ** 2).mean(), "MSE")


# ---------------------------------------------------------------------------------------
# Layer-wise LR decay


@pytest.mark.parametrize("kind", ["TACO", "SAS"])
def test_layerwise_lr_decay_follows_electra(kind):
    from megatron_taco.training.config import TrainingConfig
    from megatron_taco.training.optim import build_optimizer, build_scheduler

    config = tiny_config() if kind == "TACO" else tiny_sas_config()
    layers = config.num_layers
    model = TaskModel(kind, config, single_process_state(), task_kind="classification",
                      num_labels=2)  # fmt: skip
    decay = 0.8
    training = TrainingConfig(train_iters=10, lr=1e-3, lr_warmup_iters=0,
                              layerwise_lr_decay=decay, lr_decay_style="constant")  # fmt: skip
    optimizer, _ = build_optimizer(model, training)
    build_scheduler(optimizer, training).apply()
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}

    # ELECTRA's _get_layer_lrs: embeddings depth 0, layer i depth i + 1, task head L + 2;
    # lr * decay ** (L + 2 - depth).
    def expected(name: str) -> float:
        if name.startswith("head."):
            depth = layers + 2
        elif name.startswith("encoder.layers."):
            depth = int(name.split(".")[2]) + 1
        elif name.startswith("encoder.embeddings."):
            depth = 0
        else:  # a parameter ELECTRA's rule does not place: this test must be told where
            raise AssertionError(f"{name}: no ELECTRA depth")
        return 1e-3 * decay ** (layers + 2 - depth)

    names = dict(model.named_parameters())
    assert any(n.startswith("encoder.embeddings.") for n in names)
    for name, p in names.items():
        assert lr_of[id(p)] == pytest.approx(expected(name), rel=1e-12), name
    # Every parameter is in exactly one group, with its weight decay unchanged.
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(names)


def test_layerwise_lr_decay_needs_model_depths():
    from megatron_taco.training.config import TrainingConfig
    from megatron_taco.training.optim import build_optimizer

    training = TrainingConfig(train_iters=10, layerwise_lr_decay=0.9, lr_warmup_iters=0)
    with pytest.raises(ValueError, match="--layerwise-lr-decay"):
        build_optimizer(torch.nn.Linear(3, 3), training)

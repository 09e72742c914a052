"""Fine-tuning at tensor-parallel size 2 equals size 1 (TACO, SAS, SAS^DA encoders under the
classification, span and multiple-choice heads).

The pretrained encoder comes from one full (tp=1) state dict, loaded into the tp=2 model
through the same re-splitting the recipe uses for a checkpoint of any layout
(recipes/finetune.load_encoder_state). float64, init std 0.3 plus noise on every 1-D
parameter, so every gradient tensor is far above the comparison's floor; each tensor is
compared relative to its own largest entry.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megatron_taco.models.finetune import TaskModel
from megatron_taco.parallel.random import model_parallel_seed
from megatron_taco.parallel.state import init_parallel, single_process_state
from megatron_taco.recipes.finetune import load_encoder_state
from tests.helpers import (
    VOCAB,
    assert_tensors_match,
    full_tensor,
    run_distributed,
    tiny_config,
    tiny_sas_config,
)

RTOL = 1e-9
ENCODERS = {
    "taco": ("TACO", lambda: tiny_config()),
    "sas": ("SAS", lambda: tiny_sas_config()),
    "sas_da": ("SAS", lambda: tiny_sas_config(disentangled_attention=True)),
}
TASKS = {"classification": 3, "span": 2, "multiple_choice": 3}
PADDED = ("encoder.embeddings.word_embeddings.weight",)


def _config(make):
    return dataclasses.replace(
        make(), hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3
    )


def _batch(task: str, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3, 16) if task == "multiple_choice" else (3, 16)
    ids = torch.randint(5, VOCAB, shape, generator=g)
    mask = torch.ones(shape, dtype=torch.bool)
    mask[..., -3:] = False
    mask[0, ..., -6:] = False
    ids[~mask] = 0
    ids[..., 0] = 2
    if task == "span":
        return dict(input_ids=ids, attention_mask=mask, start_positions=torch.tensor([1, 4, 0]),
                    end_positions=torch.tensor([2, 7, 0]))  # fmt: skip
    labels = torch.tensor([2, 0]) if task == "multiple_choice" else torch.tensor([1, 2, 0])
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _source(kind, config, task):
    """The 'pretrained' full model at tp=1, with noise on every parameter (1-D ones too)."""
    torch.manual_seed(11)
    model = TaskModel(kind, config, single_process_state(), task_kind=task,
                      num_labels=TASKS[task]).double()  # fmt: skip
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    state = model.state_dict()
    encoder = {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
    encoder["embeddings.word_embeddings.weight"] = encoder["embeddings.word_embeddings.weight"][
        :VOCAB
    ]
    head = {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")}
    return encoder, head


def _case(parallel, encoder_name: str, task: str) -> dict:
    kind, make = ENCODERS[encoder_name]
    config = _config(make)
    encoder, head = _source(kind, config, task)
    tracker = model_parallel_seed(1234, parallel, device="cpu")
    model = TaskModel(kind, config, parallel, tracker, task_kind=task,
                      num_labels=TASKS[task]).double()  # fmt: skip
    load_encoder_state(model, kind, config, encoder, parallel)
    model.head.load_state_dict(head)
    out = model(_batch(task))
    out["loss"].backward()
    group = parallel.tp_group

    def trim(name, t):
        return (t[:VOCAB] if name in PADDED else t).numpy()

    outputs = {k: v.numpy() for k, v in out.items() if k in ("logits", "start_logits")}
    return dict(
        loss=out["loss"].item(),
        outputs=outputs,
        grads={n: trim(n, full_tensor(p, p.grad, group)) for n, p in model.named_parameters()},
    )


def _run(rank, world_size, tp):
    parallel = init_parallel(tp)
    return {(e, t): _case(parallel, e, t) for e in ENCODERS for t in TASKS}


@pytest.fixture(scope="module")
def tp1():
    return run_distributed(_run, 1, 1)[0]


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(_run, 2, 2)


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("task", TASKS)
def test_finetuning_tp2_equals_tp1(tp1, tp2, encoder, task):
    ref = tp1[(encoder, task)]
    # Every tolerance is relative, not the absolute floor, except for gradients that are zero
    # by an exact invariance: the span (multiple-choice) losses do not change when every
    # token's start/end logit (every option's logit) moves by the same amount, so the head's
    # bias and the biases of the last layer's output LayerNorms (added to every token and
    # option alike) get none.
    invariant = ("head.bias", "output_layernorm.bias") if task != "classification" else ()
    smallest = min(np.abs(g).max() for n, g in ref["grads"].items() if not n.endswith(invariant))
    assert RTOL * smallest > 1e3 * 1e-15, smallest
    for rank in tp2:
        got = rank[(encoder, task)]
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-12)
        assert_tensors_match(got["outputs"], ref["outputs"], rtol=1e-12)
        assert_tensors_match(got["grads"], ref["grads"], rtol=RTOL)


def test_the_comparison_catches_a_wrong_slice(tp1):
    """A load that gave tp rank 1 rank 0's slice of one split tensor would differ by far
    more than RTOL: the comparison is sharp enough to see it."""
    grads = tp1[("sas", "classification")]["grads"]
    checked = 0
    for name, g in grads.items():
        if g.ndim == 2 and g.shape[0] % 2 == 0:
            wrong = dict(grads)
            half = g.shape[0] // 2
            wrong[name] = np.concatenate([g[:half], g[:half]])
            if not np.allclose(wrong[name], g, rtol=RTOL, atol=0):
                with pytest.raises(AssertionError, match=name):
                    assert_tensors_match(wrong, grads, rtol=RTOL)
                checked += 1
    assert checked >= 10, checked  # every split weight of the encoder and head, not none


# ---------------------------------------------------------------------------------------
# The dev evaluation over data-parallel ranks


def _predict(rank, world_size):
    """Every rank evaluates its share of 7 features (sorted by length, dealt round-robin,
    the last padded): the gathered outputs, back in feature order, on every rank."""
    from types import SimpleNamespace

    from megatron_taco.recipes.finetune_eval import predict
    from megatron_taco.tasks.base import Collate
    from tests.helpers import EngineLike, finetune_features, finetune_model

    parallel = init_parallel(1)
    out = {}
    for task in ("classification", "span"):
        model = finetune_model("TACO", task, seed=4)
        trainer = SimpleNamespace(parallel=parallel, model_engine=EngineLike(model))
        out[task] = predict(trainer, finetune_features(task, n=7, seed=9), 2, Collate())
    return out


def test_evaluation_over_data_parallel_ranks_returns_every_feature_in_order():
    from tests.helpers import finetune_features, finetune_model

    ranks = run_distributed(_predict, 2)
    for task, key in (("classification", "logits"), ("span", "start_logits")):
        features = finetune_features(task, n=7, seed=9)
        model = finetune_model("TACO", task, seed=4)
        for i in range(len(features)):
            item = {k: v[None] for k, v in features[i].items() if not k.endswith("positions")}
            with torch.no_grad():
                want = model(item)[key][0].float().numpy()
            n = int(features.lengths[i]) if task == "span" else len(want)
            for got in ranks:
                assert got[task][key].shape[0] == len(features)
                np.testing.assert_allclose(got[task][key][i, :n], want[:n], rtol=1e-5)

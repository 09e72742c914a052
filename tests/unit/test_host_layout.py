"""The host numbers a collated batch carries (models/common/host.py) give exactly the
losses, metrics and gradients of the forms that read them from the device (nonzero for the
labelled rows, .tolist() for the position span, bool() for padding): float64, bitwise."""

from __future__ import annotations

import pytest
import torch

from megatron_taco.models.common.host import HOST_KEY, WithHost
from megatron_taco.models.common.lm_head import gather_labelled
from tests.helpers import build, build_sas, make_batch, make_sas_batch, tiny_config, tiny_sas_config


def _run(model, batch, seed):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(batch)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in out.items()}, grads


def _collated(make, **kw):
    # What the recipes hand the loop: the collator's batch plus its host numbers.
    return lambda layout: WithHost(lambda samples: make(**kw), layout)([])


@pytest.mark.parametrize("kind", ["taco", "sas", "sas_da", "taco_full_rows"])
def test_host_numbers_change_nothing(kind):
    torch.set_default_dtype(torch.float64)
    try:
        if kind.startswith("taco"):
            model = build(tiny_config()).double()
            s = 32 if kind == "taco" else 16
            with_host = _collated(make_batch, b=3, s=s, seed=4)(type(model).host_layout)
            if kind == "taco_full_rows":  # no padding: the masking pass is skipped
                with_host["attention_mask"][:] = True
                with_host[HOST_KEY] = type(model).host_layout(with_host)
        else:
            config = tiny_sas_config(disentangled_attention=kind == "sas_da")
            model = build_sas(config).double()
            with_host = _collated(make_sas_batch, b=3, seed=5)(type(model).host_layout)
        plain = {k: v for k, v in with_host.items() if k != HOST_KEY}
        got_out, got_grads = _run(model, with_host, seed=9)
        want_out, want_grads = _run(model, plain, seed=9)
    finally:
        torch.set_default_dtype(torch.float32)
    assert got_out.keys() == want_out.keys() and got_grads.keys() == want_grads.keys()
    for key in want_out:
        assert torch.equal(got_out[key], want_out[key]), key
    for name in want_grads:
        assert torch.equal(got_grads[name], want_grads[name]), name


def test_gather_labelled_with_a_count_equals_nonzero():
    hidden = torch.randn(2 * 7, 5, dtype=torch.float64)
    labels = torch.full((2, 7), -100)
    labels[0, [1, 4]] = torch.tensor([3, 9])
    labels[1, [0, 6]] = torch.tensor([2, 1])
    counted = gather_labelled(hidden, labels, count=4)
    synced = gather_labelled(hidden, labels)
    for a, b in zip(counted, synced):
        assert torch.equal(a, b)
    assert counted[2].tolist() == [1, 4, 7, 13]
    none = gather_labelled(hidden, torch.full((2, 7), -100), count=0)
    assert [t.shape[0] for t in none] == [0, 0, 0]


@pytest.mark.parametrize("case", ["classification", "classification_full_rows", "span",
                                  "multiple_choice"])  # fmt: skip
@pytest.mark.parametrize("encoder", ["TACO", "SAS", "SAS^DA"])
def test_finetuning_host_numbers_change_nothing(encoder, case):
    """TaskModel with the fine-tuning collator's host numbers (TACO's bucket range from the
    length alone) against the forms that read them from the device."""
    from megatron_taco.recipes.finetune import finetune_collate
    from tests.helpers import finetune_features, finetune_model

    task_kind = case.removesuffix("_full_rows")
    features = finetune_features(task_kind, n=4)
    with_host = finetune_collate(dynamic=True)([features[i] for i in range(4)])
    if case.endswith("_full_rows"):
        with_host["attention_mask"][:] = 1
        with_host[HOST_KEY] = {"has_padding": False}
    assert with_host[HOST_KEY]["has_padding"] is not case.endswith("_full_rows")
    plain = {k: v for k, v in with_host.items() if k != HOST_KEY}
    model = finetune_model(encoder, task_kind).train()
    got_out, got_grads = _run(model, with_host, seed=9)
    want_out, want_grads = _run(model, plain, seed=9)
    assert got_out.keys() == want_out.keys() and got_grads.keys() == want_grads.keys()
    for key in want_out:
        assert torch.equal(got_out[key], want_out[key]), key
    for name in want_grads:
        assert torch.equal(got_grads[name], want_grads[name]), name

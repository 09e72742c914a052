"""Tensor parallelism of the full TACO pre-training model: tp=2 must equal tp=1."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_taco.models.taco.model import TacoForPretraining
from megatron_taco.parallel.layers import (
    gather_full_weight,
    merge_partitions,
    param_is_tensor_parallel,
)
from megatron_taco.parallel.random import model_parallel_seed
from megatron_taco.parallel.state import init_parallel
from tests.helpers import VOCAB, make_batch, run_distributed, tiny_config

# Parameters whose rows beyond the real vocabulary are padding (the padded size depends on tp).
VOCAB_PADDED = ("taco.embeddings.word_embeddings.weight", "heads.mlm_bias")


def _full_grad(param: torch.Tensor, group) -> torch.Tensor:
    grad = param.grad.detach().contiguous()
    if not param_is_tensor_parallel(param) or dist.get_world_size(group) == 1:
        return grad.clone()
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, grad, group=group)
    return merge_partitions(parts, param.partition_dim, param.partition_stride)


def _trim(name: str, t: torch.Tensor) -> np.ndarray:
    return (t[:VOCAB] if name in VOCAB_PADDED else t).numpy()


def _run_model(rank, world_size, tp, recompute):
    parallel = init_parallel(tp)
    tracker = model_parallel_seed(1234, parallel)
    cfg = tiny_config(hidden_dropout=0.0, attention_dropout=0.0, recompute_activations=recompute)
    model = TacoForPretraining(cfg, parallel, tracker)
    weights = {
        n: _trim(n, gather_full_weight(p, parallel.tp_group)) for n, p in model.named_parameters()
    }
    out = model(make_batch(b=2, seed=7))
    out["loss"].backward()
    grads = {n: _trim(n, _full_grad(p, parallel.tp_group)) for n, p in model.named_parameters()}
    replicated = {
        n: p.grad.detach().clone().numpy()
        for n, p in model.named_parameters()
        if not param_is_tensor_parallel(p)
    }
    scalars = {k: v.item() for k, v in out.items()}
    return dict(weights=weights, grads=grads, replicated=replicated, scalars=scalars)


@pytest.fixture(scope="module")
def tp1():
    return run_distributed(_run_model, 1, 1, False)[0]


@pytest.mark.parametrize("recompute", [False, True])
def test_tp2_equals_tp1(tp1, recompute):
    ranks = run_distributed(_run_model, 2, 2, recompute)
    for r in ranks:
        # Init: the full model is the same whatever tp is (bitwise: same CPU RNG stream).
        assert r["weights"].keys() == tp1["weights"].keys()
        for name, w in tp1["weights"].items():
            np.testing.assert_array_equal(r["weights"][name], w, err_msg=name)
        for key in (
            "loss",
            "mlm_loss",
            "mpm_loss",
            "mlm_acc",
            "mpm_acc",
            "mlm_tokens",
            "mpm_tokens",
        ):
            assert r["scalars"][key] == pytest.approx(tp1["scalars"][key], rel=1e-5, abs=1e-6), key
        for name, g in tp1["grads"].items():
            np.testing.assert_allclose(r["grads"][name], g, rtol=1e-4, atol=1e-6, err_msg=name)
    # Replicated parameters must see identical gradients on every tp rank, or they drift apart.
    for name, g in ranks[0]["replicated"].items():
        np.testing.assert_array_equal(ranks[1]["replicated"][name], g, err_msg=name)


def _recompute_with_dropout(rank, world_size, tp):
    parallel = init_parallel(tp)
    results = []
    for recompute in (False, True):
        tracker = model_parallel_seed(99, parallel)
        cfg = dataclasses.replace(tiny_config(), recompute_activations=recompute)
        model = TacoForPretraining(cfg, parallel, tracker)
        loss = model(make_batch(seed=3))["loss"]
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, msg=name)
    return loss_a


def test_recompute_reproduces_tensor_parallel_dropout():
    """Attention dropout on local heads uses the tracker stream; the recompute must replay
    both it and the default stream, or the gradients differ from the plain run."""
    losses = run_distributed(_recompute_with_dropout, 2, 2)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)  # both tp ranks compute one loss

"""Tensor parallelism of the SAS pre-training model: tp=2 must equal tp=1 (SAS and SAS^DA).

float64 with a large init (std 0.3), so every gradient tensor is far above the comparison's
floor, and each tensor is compared relative to its own largest entry: a wrong gradient in
any one parameter, however small that parameter's gradients are, fails.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_taco.models.sas.model import SasForPretraining
from megatron_taco.parallel.layers import (
    gather_full_weight,
    merge_partitions,
    param_is_tensor_parallel,
)
from megatron_taco.parallel.random import model_parallel_seed
from megatron_taco.parallel.state import init_parallel
from tests.helpers import SAS_METRIC_KEYS, VOCAB, make_sas_batch, run_distributed, tiny_sas_config

VARIANTS = {"sas": {}, "sas_da": {"disentangled_attention": True}}
# Parameters whose rows beyond the real vocabulary are padding (the padded size depends on tp).
VOCAB_PADDED = ("sas.embeddings.word_embeddings.weight", "heads.mlm_bias")
RTOL = 1e-9  # of each tensor's own max |value|
ATOL = 1e-15  # absolute floor (only matters for an all-zero tensor)


def _full(param: torch.Tensor, tensor: torch.Tensor, group) -> torch.Tensor:
    data = tensor.detach().contiguous()
    if not param_is_tensor_parallel(param) or dist.get_world_size(group) == 1:
        return data.clone()
    parts = [torch.empty_like(data) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, data, group=group)
    return merge_partitions(parts, param.partition_dim, param.partition_stride)


def _trim(name: str, t: torch.Tensor) -> np.ndarray:
    return (t[:VOCAB] if name in VOCAB_PADDED else t).numpy()


def _run_variant(parallel, overrides: dict) -> dict:
    tracker = model_parallel_seed(1234, parallel, device="cpu")
    cfg = tiny_sas_config(
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3, **overrides
    )
    model = SasForPretraining(cfg, parallel, tracker).double()
    group = parallel.tp_group
    weights = {n: _trim(n, gather_full_weight(p, group)) for n, p in model.named_parameters()}
    out = model(make_sas_batch(b=2, seed=7))
    out["loss"].backward()
    grads = {n: _trim(n, _full(p, p.grad, group)) for n, p in model.named_parameters()}
    replicated = {
        n: p.grad.detach().clone().numpy()
        for n, p in model.named_parameters()
        if not param_is_tensor_parallel(p)
    }
    # The sampler's view: this rank's vocabulary slice, gathered over tp = the tp=1 logits.
    logits = _full(model.heads.mlm_bias, out["mlm_logits"].t(), group).t()[:, :VOCAB]
    return dict(
        weights=weights,
        grads=grads,
        replicated=replicated,
        logits=logits.numpy(),
        positions=out["mlm_positions"].tolist(),
        scalars={k: out[k].item() for k in SAS_METRIC_KEYS},
    )


def _recompute_with_dropout(parallel, overrides: dict) -> float:
    """Attention dropout on local heads uses the tracker stream; the recompute must replay it
    and the default stream, or the gradients differ from the plain run."""
    results = []
    for recompute in (False, True):
        tracker = model_parallel_seed(99, parallel, device="cpu")
        cfg = tiny_sas_config(hidden_dropout=0.2, recompute_activations=recompute, **overrides)
        model = SasForPretraining(cfg, parallel, tracker).double()
        loss = model(make_sas_batch(seed=3))["loss"]
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-12)
    assert_grads_match(
        {n: g.numpy() for n, g in grads_a.items()}, {n: g.numpy() for n, g in grads_b.items()}
    )
    return loss_a


def _run(rank, world_size, tp):
    parallel = init_parallel(tp)
    out = {name: _run_variant(parallel, o) for name, o in VARIANTS.items()}
    if tp > 1:
        out["recompute"] = {
            name: _recompute_with_dropout(parallel, o) for name, o in VARIANTS.items()
        }
    return out


def assert_grads_match(got: dict, want: dict, rtol: float = RTOL) -> None:
    """Per tensor: |got - want| <= rtol * max|want| + ATOL, elementwise."""
    assert got.keys() == want.keys()
    bad = []
    for name, w in want.items():
        tol = rtol * np.abs(w).max() + ATOL
        err = np.abs(got[name] - w).max()
        if not err <= tol:
            bad.append(f"{name}: max error {err:.3g} > {tol:.3g}")
    assert not bad, "gradients differ:\n" + "\n".join(bad)


@pytest.fixture(scope="module")
def tp1():
    return run_distributed(_run, 1, 1)[0]


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(_run, 2, 2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_equals_tp1(tp1, tp2, variant):
    ref = tp1[variant]
    # Every tensor's tolerance is its own relative part: RTOL * max|grad| is >= 1e3 x the
    # absolute floor even for the tensor with the smallest gradients.
    smallest = min(np.abs(g).max() for g in ref["grads"].values())
    assert RTOL * smallest > 1e3 * ATOL, smallest
    for r in (x[variant] for x in tp2):
        # Init: the full model is the same whatever tp is (bitwise: same CPU RNG stream).
        assert r["weights"].keys() == ref["weights"].keys()
        for name, w in ref["weights"].items():
            np.testing.assert_array_equal(r["weights"][name], w, err_msg=name)
        for key in SAS_METRIC_KEYS:
            assert r["scalars"][key] == pytest.approx(ref["scalars"][key], rel=1e-12), key
        assert_grads_match(r["grads"], ref["grads"])
        assert r["positions"] == ref["positions"]
        np.testing.assert_allclose(r["logits"], ref["logits"], rtol=1e-6, atol=1e-6)
    # Replicated parameters must see identical gradients on every tp rank, or they drift apart.
    for name, g in tp2[0][variant]["replicated"].items():
        np.testing.assert_array_equal(tp2[1][variant]["replicated"][name], g, err_msg=name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_wrong_gradient_in_any_parameter_fails(tp1, variant):
    """The comparison is sharp enough: a 1e-6 relative error in any single tensor fails it."""
    grads = tp1[variant]["grads"]
    assert_grads_match(grads, grads)
    for name, g in grads.items():
        wrong = dict(grads)
        wrong[name] = g.copy()
        flat = wrong[name].reshape(-1)
        flat[np.abs(flat).argmax()] += 1e-6 * np.abs(g).max()
        with pytest.raises(AssertionError, match=name):
            assert_grads_match(wrong, grads)


def test_recompute_reproduces_tensor_parallel_dropout(tp2):
    for variant in VARIANTS:
        # Both tp ranks compute one loss.
        assert tp2[0]["recompute"][variant] == pytest.approx(
            tp2[1]["recompute"][variant], rel=1e-12
        )

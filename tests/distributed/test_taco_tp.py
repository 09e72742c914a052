"""Tensor parallelism of the full TACO pre-training model: tp=2 must equal tp=1.

At the default init the gradients of the attention convolution, the PReLU slopes and the
relative-table LayerNorm are below 1e-6: a float32 comparison with an absolute tolerance
cannot tell them from wrong ones. Here the model runs in float64 from an init where every
tensor's gradient is large (asserted), each gradient is compared with a tolerance relative
to its own largest entry, and test_mutations_are_caught checks that the comparison fails
for the bugs the tensor-parallel attention convolution could plausibly have.
"""

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_taco.models.taco import model as taco_model
from megatron_taco.models.taco.model import TacoAttention, TacoForPretraining
from megatron_taco.parallel.layers import (
    gather_full_weight,
    param_is_tensor_parallel,
    split_partition,
)
from megatron_taco.parallel.random import model_parallel_seed
from megatron_taco.parallel.state import init_parallel
from tests.helpers import TACO_METRIC_KEYS, VOCAB, make_batch, run_distributed, tiny_config

# Parameters whose rows beyond the real vocabulary are padding (the padded size depends on tp).
VOCAB_PADDED = ("taco.embeddings.word_embeddings.weight", "heads.mlm_bias")

# 10x the default std: the attention maps are then large enough to move the softmax, which
# lifts the smallest gradients (PReLU slopes, conv bias) from ~1e-8 to ~5e-3 while the largest
# stay ~1: the spread over tensors is ~150 instead of ~2e7.
INIT_STD = 0.2
# Noise on every 1-D parameter. At init all PReLU slopes are 0.25, conv and linear biases 0,
# LayerNorm weights 1: heads would be interchangeable, and slopes or biases applied to the
# wrong head would leave the forward unchanged.
VECTOR_SPREAD = 0.1
# Per tensor: max |g_tp2 - g_tp1| <= RTOL * max |g_tp1|. Float64 runs agree to ~3e-15.
RTOL = 1e-10
# The smallest tensor's largest gradient must exceed the loosest tolerance anywhere by this.
MARGIN = 1e4
# The heads compute the losses in float32 by design (parallel/cross_entropy.py).
LOSS_RTOL = 1e-6


def _spread_vectors(model: nn.Module, tp: int, rank: int) -> None:
    """Add seeded noise to every 1-D parameter: drawn for the full (tp=1) tensor, padded
    vocabulary rows left at zero, then sliced like the parameter, so the model is the same
    for every tp."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if p.dim() != 1:
                continue
            split = param_is_tensor_parallel(p)
            full = p.shape[0] * (tp if split else 1)
            real = VOCAB if name in VOCAB_PADDED else full
            g = torch.Generator().manual_seed(1000 + i)
            noise = torch.randn(real, generator=g, dtype=torch.float64) * VECTOR_SPREAD
            noise = F.pad(noise, (0, full - real))
            if split:
                noise = split_partition(noise, 0, p.partition_stride, rank, tp)
            p.add_(noise)


def _build(parallel, tracker, **overrides) -> TacoForPretraining:
    cfg = tiny_config(init_method_std=INIT_STD, **overrides)
    model = TacoForPretraining(cfg, parallel, tracker).double()
    _spread_vectors(model, parallel.tp_size, parallel.tp_rank)
    return model


def _trim(name: str, t: torch.Tensor) -> np.ndarray:
    return (t[:VOCAB] if name in VOCAB_PADDED else t).cpu().numpy()


def _step(model: TacoForPretraining, parallel, batch) -> dict:
    """One forward/backward: full (tp=1 layout) weights and gradients, the replicated
    parameters' local gradients, the metrics."""
    group = parallel.tp_group
    params = list(model.named_parameters())
    weights = {n: _trim(n, gather_full_weight(p, group)) for n, p in params}
    out = model(batch)
    out["loss"].backward()
    grads = {n: _trim(n, gather_full_weight(p, group, p.grad)) for n, p in params}
    replicated = {
        n: p.grad.cpu().numpy().copy() for n, p in params if not param_is_tensor_parallel(p)
    }
    scalars = {k: out[k].item() for k in TACO_METRIC_KEYS}
    return dict(weights=weights, grads=grads, replicated=replicated, scalars=scalars)


def _mismatches(ref: dict, run: dict) -> list[tuple[float, str]]:
    """(relative error, what) for every metric and gradient of ``run`` that differs from
    ``ref`` beyond its tolerance."""
    bad = []
    for key, want in ref["scalars"].items():
        got = run["scalars"][key]
        err = abs(got - want) / max(abs(want), 1e-30)
        if not err <= LOSS_RTOL:  # "not <=" also catches NaN
            bad.append((err, f"metric {key}: {got!r} vs {want!r}"))
    for name, want in ref["grads"].items():
        got = run["grads"][name]
        if got.shape != want.shape:
            bad.append((np.inf, f"grad {name}: shape {got.shape} vs {want.shape}"))
            continue
        err = np.abs(got - want).max() / np.abs(want).max()
        if not err <= RTOL:
            bad.append((float(err), f"grad {name}"))
    return sorted(bad, reverse=True)


def _assert_matches(ref: dict, ranks: list[dict]) -> None:
    """Every tp rank's run equals the tp=1 run ``ref``: same full weights (bitwise), metrics,
    every gathered gradient to RTOL of its own max; and the replicated parameters' gradients
    are bitwise equal on all tp ranks (or the replicas drift apart)."""
    for rank, run in enumerate(ranks):
        assert run["weights"].keys() == ref["weights"].keys()
        for name, w in ref["weights"].items():
            np.testing.assert_array_equal(run["weights"][name], w, err_msg=name)
        bad = _mismatches(ref, run)
        if bad:
            lines = "\n".join(f"  {err:.3e}  {what}" for err, what in bad)
            raise AssertionError(
                f"tp rank {rank} differs from the reference run (max relative error {bad[0][0]:.3e}, "
                f"tolerance {RTOL:g} of each tensor's max):\n{lines}"
            )
    for name, g in ranks[0]["replicated"].items():
        for run in ranks[1:]:
            np.testing.assert_array_equal(run["replicated"][name], g, err_msg=name)


# ---------------------------------------------------------------------------------------
# Mutations, applied inside the spawned tp>1 ranks only (each rank is a fresh process).


def _prelu_on_wrong_heads() -> None:
    # Each rank applies its slopes one head off (a WE slope lands on a PE head and back).
    real = F.prelu
    taco_model.F = types.SimpleNamespace(**{**vars(F), "prelu": lambda x, w: real(x, w.roll(1))})


def _conv_maps_without_grad() -> None:
    # The forward is untouched; the c2p, p2c, position and previous-logit columns of the
    # conv weight (every column after the local content heads) get no gradient.
    real = TacoAttention.conv_weight

    def conv_weight(self):
        w = real(self)
        return torch.cat([w[:, : self.hw], w[:, self.hw :].detach()], dim=1)

    TacoAttention.conv_weight = conv_weight


def _prev_logits_flipped() -> None:
    # The previous layer's fused logits reach the conv in reversed head order.
    real = taco_model.attention_logits

    def attention_logits(*args):
        *maps_args, prev, w_maps, w_prev, bias, scale = args
        prev = None if prev is None else prev.flip(0)
        return real(*maps_args, prev, w_maps, w_prev, bias, scale)

    taco_model.attention_logits = attention_logits


MUTATIONS = {
    "prelu_on_wrong_heads": _prelu_on_wrong_heads,
    "conv_maps_without_grad": _conv_maps_without_grad,
    "prev_logits_flipped": _prev_logits_flipped,
}


def _run_model(rank, world_size, tp, recompute, mutation=None, device_type="cpu"):
    """One step at tensor-parallel size ``tp``; with ``device_type="cuda"`` (tests/gpu, over
    NCCL, whose CUDA-only branches of parallel/mappings.py gloo never takes) on this rank's
    GPU, the same model, batch and comparison."""
    if tp > 1 and mutation is not None:
        MUTATIONS[mutation]()
    parallel = init_parallel(tp)
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    tracker = model_parallel_seed(1234, parallel, device=device)
    model = _build(
        parallel,
        tracker,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        recompute_activations=recompute,
    ).to(device)
    batch = {k: v.to(device) for k, v in make_batch(b=2, seed=7).items()}
    return _step(model, parallel, batch)


@pytest.fixture(scope="module")
def tp1():
    return run_distributed(_run_model, 1, 1, False)[0]


def test_every_gradient_is_far_above_the_tolerance(tp1):
    # Each tensor is compared to RTOL of its own max. Stronger: even the loosest of those
    # tolerances (the one of the largest gradient) is MARGIN below the smallest tensor's
    # largest gradient, so no parameter's gradient sits near the comparison's noise floor.
    largest = {name: float(np.abs(g).max()) for name, g in tp1["grads"].items()}
    loosest = RTOL * max(largest.values())
    smallest = min(largest, key=largest.get)
    assert largest[smallest] > MARGIN * loosest, (smallest, largest[smallest], loosest)
    for name in (
        "taco.layers.1.attention.conv_prev_pe",
        "taco.layers.0.attention.prelu_pe",
        "taco.embeddings.relative_layernorm.weight",
    ):
        assert name in largest


@pytest.mark.parametrize("recompute", [False, True])
def test_tp2_equals_tp1(tp1, recompute):
    _assert_matches(tp1, run_distributed(_run_model, 2, 2, recompute))


@pytest.mark.parametrize(
    ("mutation", "caught_in"),
    [
        ("prelu_on_wrong_heads", "prelu_we"),
        ("conv_maps_without_grad", "conv_c2p"),
        ("prev_logits_flipped", "conv_prev_we"),
    ],
)
def test_mutations_are_caught(tp1, mutation, caught_in):
    ranks = run_distributed(_run_model, 2, 2, False, mutation)
    with pytest.raises(AssertionError, match=caught_in) as failure:
        _assert_matches(tp1, ranks)
    print(f"{mutation}: {str(failure.value).splitlines()[0]}")


# ---------------------------------------------------------------------------------------
# Dropout


class _RecordingDropout(nn.Module):
    """The model's attention-dropout mask, logging (layer, kept) for every draw."""

    def __init__(self, dropout: nn.Module, layer: int, log: list) -> None:
        super().__init__()
        self.dropout, self.layer, self.log, self.p = dropout, layer, log, dropout.p

    def forward(self, like):
        kept = self.dropout(like)
        self.log.append((self.layer, kept.clone()))
        return kept


class _ReplayDropout(nn.Module):
    def __init__(self, kept: torch.Tensor, p: float) -> None:
        super().__init__()
        self.kept, self.p = kept, p

    def forward(self, like):
        return self.kept


DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)


def _dropout_run(rank, world_size, tp):
    parallel = init_parallel(tp)
    batch = make_batch(seed=3)
    runs, masks = {}, {}
    for recompute in (False, True):
        tracker = model_parallel_seed(99, parallel, device="cpu")
        model = _build(parallel, tracker, recompute_activations=recompute, **DROPOUT)
        log = []
        for i, layer in enumerate(model.taco.layers):
            layer.attention.attention_dropout = _RecordingDropout(
                layer.attention.attention_dropout, i, log
            )
        runs[recompute] = _step(model, parallel, batch)
        # numpy, like every other result: torch tensors cross the result queue through
        # file descriptors that die with the rank process.
        masks[recompute] = [(layer, kept.numpy()) for layer, kept in log]
    return dict(plain=runs[False], recompute=runs[True], masks=masks)


def _dropout_replay(rank, world_size, kept_per_layer):
    parallel = init_parallel(1)
    tracker = model_parallel_seed(99, parallel, device="cpu")
    model = _build(parallel, tracker, **DROPOUT)
    for layer, kept in zip(model.taco.layers, kept_per_layer):
        kept = torch.from_numpy(kept)
        layer.attention.attention_dropout = _ReplayDropout(kept, DROPOUT["attention_dropout"])
    return _step(model, parallel, make_batch(seed=3))


def test_recompute_reproduces_tensor_parallel_dropout():
    """Dropout on, tp=2: the recompute replays both RNG streams, each rank draws its own
    attention-dropout masks, and the result is the tp=1 model's with those masks."""
    ranks = run_distributed(_dropout_run, 2, 2)
    cfg = tiny_config()
    layers, hw = cfg.num_layers, cfg.we_attention_heads // 2

    # 1. Recompute: the masks drawn again in backward are the forward's, and loss and
    # gradients equal the plain run's. Replaying only the default stream (hidden dropout)
    # would redraw the attention masks from an advanced tracker state and fail both.
    for r in ranks:
        plain = dict(r["masks"][False])
        assert [layer for layer, _ in r["masks"][False]] == list(range(layers))
        replayed = r["masks"][True]
        assert len(replayed) == 2 * layers  # no-grad forward, then the recompute in backward
        for layer, kept in replayed:
            np.testing.assert_array_equal(kept, plain[layer], err_msg=str(layer))
    _assert_matches(ranks[0]["plain"], [r["recompute"] for r in ranks])

    # 2. The two ranks' heads got independent masks (~2p(1-p) = 18% of the entries
    # differ). Equal masks would mean both ranks forked the same tracker seed: heads
    # dropped in lockstep, which tp=1 never does.
    masks = [dict(r["masks"][False]) for r in ranks]
    for layer in range(layers):
        differ = (masks[0][layer] != masks[1][layer]).mean()
        assert differ > 0.05, (layer, differ)

    # 3. tp=2 with dropout equals tp=1 with the same attention masks (rank 0's WE heads,
    # rank 1's, then the PE heads likewise) and the same hidden-dropout masks, which come
    # from the default stream shared by all ranks. Catches masks applied to the wrong heads
    # or scaled wrongly, and hidden dropout that is not the same on every rank.
    canonical = [
        np.concatenate([m[layer][:hw] for m in masks] + [m[layer][hw:] for m in masks])
        for layer in range(layers)
    ]
    tp1 = run_distributed(_dropout_replay, 1, canonical)[0]
    _assert_matches(tp1, [r["recompute"] for r in ranks])

import dataclasses
import math

import pytest
import torch

from megatron_taco.models.common.relative import relative_bucket_range, relative_position_index
from megatron_taco.models.flops import taco_forward_flops, taco_train_flops
from megatron_taco.models.taco import model as taco_module
from megatron_taco.models.taco.config import TacoConfig
from tests.helpers import SEQ, VOCAB, build, make_batch, tiny_config

# ---------------------------------------------------------------------------------------
# Relative positions


def test_relative_index_matches_definition():
    k = 3
    pos = torch.tensor([[0, 5, -1, 2, 1, 9]])
    lo, hi = 0, 2 * k  # the full canonical range
    r = relative_position_index(pos, k, lo, hi)
    for i in range(pos.shape[1]):
        for j in range(pos.shape[1]):
            pi, pj = pos[0, i].item(), pos[0, j].item()
            want = 2 * k + 1 if pi < 0 or pj < 0 else max(-k, min(k, pj - pi)) + k
            assert r[0, i, j].item() == want, (i, j)


def test_relative_index_uses_position_ids_not_columns():
    pos = torch.tensor([[4, 2, 7]])
    r = relative_position_index(pos, 10, 0, 20)
    assert r[0, 0, 1].item() == 10 + (2 - 4)
    assert r[0, 2, 0].item() == 10 + (4 - 7)


def test_bucket_range_covers_only_occurring_distances():
    k = 511
    pos = torch.tensor([[3, 4, -1, 10], [5, 6, 7, -1]])
    lo, hi = relative_bucket_range(pos, k)
    assert (lo, hi) == (k - 7, k + 7)
    r = relative_position_index(pos, k, lo, hi)
    assert r.min().item() == 0 and r.max().item() == hi - lo + 1  # mask slot is the last
    assert relative_bucket_range(torch.tensor([[0, 600]]), k) == (0, 2 * k)  # clipped span
    assert relative_bucket_range(torch.full((1, 4), -1), k) == (k, k)


# ---------------------------------------------------------------------------------------
# Forward / outputs


def test_pretraining_outputs():
    model = build(tiny_config())
    batch = make_batch()
    out = model(batch)
    assert set(out) == {
        "loss",
        "mlm_loss",
        "mpm_loss",
        "mlm_acc",
        "mpm_acc",
        "mlm_tokens",
        "mpm_tokens",
    }
    assert out["mlm_tokens"].item() == (batch["mlm_labels"] != -100).sum().item() == 10
    assert out["mpm_tokens"].item() == (batch["mpm_labels"] != -100).sum().item() == 12
    assert torch.isfinite(out["loss"])
    torch.testing.assert_close(out["loss"], out["mlm_loss"] + out["mpm_loss"])
    # Untrained: close to uniform over the vocabulary / the positions.
    assert abs(out["mlm_loss"].item() - math.log(VOCAB)) < 1.0
    assert abs(out["mpm_loss"].item() - math.log(64)) < 1.0
    assert not out["mlm_acc"].requires_grad and 0 <= out["mlm_acc"].item() <= 1


def test_batch_without_labels_of_one_kind():
    model = build(tiny_config())
    batch = make_batch()
    batch["mpm_labels"].fill_(-100)
    out = model(batch)
    assert out["mpm_tokens"].item() == 0 and out["mpm_loss"].item() == 0.0
    assert out["mlm_tokens"].item() == 10
    out["loss"].backward()
    assert model.heads.mlm_transform.dense.weight.grad.abs().sum() > 0


def test_encoder_shapes():
    cfg = tiny_config()
    model = build(cfg)
    batch = make_batch()
    h_we, h_pe = model.taco(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    assert h_we.shape == (4, SEQ, cfg.we_hidden_size)
    assert h_pe.shape == (4, SEQ, cfg.pe_hidden_size)


def _permute_batch(batch, perm):
    return {k: v[:, perm] for k, v in batch.items()}


def test_permutation_equivariance():
    """Permuting tokens together with their position ids (and mask, labels) permutes every
    per-token output and leaves the loss unchanged: nothing may use the physical column."""
    cfg = tiny_config(hidden_dropout=0.0, attention_dropout=0.0)
    model = build(cfg).double().eval()
    batch = make_batch(seed=1)
    perm = torch.randperm(SEQ, generator=torch.Generator().manual_seed(3))
    permuted = _permute_batch(batch, perm)
    with torch.no_grad():
        we, pe = model.taco(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        we_p, pe_p = model.taco(
            permuted["input_ids"], permuted["position_ids"], permuted["attention_mask"]
        )
        real = batch["attention_mask"]
        # Compare real tokens only (padded queries attend like real ones but are unused).
        torch.testing.assert_close(we_p[real[:, perm]], we[:, perm][real[:, perm]])
        torch.testing.assert_close(pe_p[real[:, perm]], pe[:, perm][real[:, perm]])
        torch.testing.assert_close(model(permuted)["loss"], model(batch)["loss"])
        # Sanity: the model does depend on positions (a non-joint permutation changes it).
        shuffled = dict(batch, position_ids=batch["position_ids"][:, perm])
        assert not torch.allclose(model(shuffled)["loss"], model(batch)["loss"])


def test_masked_token_column_is_invisible():
    """Swap two position-masked tokens' columns (their position ids are both -1): their
    outputs swap and nothing else changes, so the true (hidden) position cannot leak."""
    cfg = tiny_config(hidden_dropout=0.0, attention_dropout=0.0)
    model = build(cfg).double().eval()
    batch = make_batch(seed=2)
    row = 2  # first MPM row
    masked = (batch["position_ids"][row] == -1).nonzero().squeeze(1)
    a, c = masked[0].item(), masked[1].item()
    swapped = {k: v.clone() for k, v in batch.items()}
    for key in ("input_ids", "mpm_labels"):
        swapped[key][row, [a, c]] = batch[key][row, [c, a]]
    assert torch.equal(swapped["position_ids"], batch["position_ids"])
    with torch.no_grad():
        we, _ = model.taco(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        we_s, _ = model.taco(
            swapped["input_ids"], swapped["position_ids"], swapped["attention_mask"]
        )
        torch.testing.assert_close(we_s[row, [a, c]], we[row, [c, a]])
        others = [i for i in range(SEQ) if i not in (a, c)]
        torch.testing.assert_close(we_s[row, others], we[row, others])
        torch.testing.assert_close(model(swapped)["mpm_loss"], model(batch)["mpm_loss"])


def test_mask_bucket_and_mask_position_are_used():
    # Larger init: at std 0.02 a single row's effect on the loss is below float32 resolution.
    cfg = tiny_config(hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3)
    model = build(cfg).double().eval()
    batch = make_batch()
    unmasked = dict(batch, position_ids=batch["position_ids"].clamp(min=0))
    with torch.no_grad():
        base_masked, base_unmasked = model(batch)["loss"], model(unmasked)["loss"]
        emb = model.taco.embeddings
        for table, row in (
            (emb.relative_embeddings, cfg.mask_bucket),
            (emb.position_embeddings, cfg.max_position_embeddings),
        ):
            saved = table[row].clone()
            table[row] += torch.randn(table.shape[1])  # not a constant shift: LN removes those
            assert not torch.allclose(model(batch)["loss"], base_masked), "mask row unused"
            torch.testing.assert_close(model(unmasked)["loss"], base_unmasked)
            table[row] = saved


def test_compact_bucket_range_equals_full_table(monkeypatch):
    cfg = tiny_config(hidden_dropout=0.0, attention_dropout=0.0, max_relative_distance=40)
    model = build(cfg).double().eval()
    batch = make_batch(s=12)  # span 11 < k=40: the compact table has 23+1 rows, not 82
    assert relative_bucket_range(batch["position_ids"], 40) == (29, 51)
    with torch.no_grad():
        compact = model(batch)["loss"]
        k = cfg.max_relative_distance
        real = taco_module.batch_layout
        monkeypatch.setattr(
            taco_module, "batch_layout", lambda p, m, kk: (0, 2 * k, real(p, m, kk)[2])
        )
        full = model(batch)["loss"]
    torch.testing.assert_close(compact, full)


def test_relative_distance_is_clipped():
    # k=2: distances 3 and 30 share the bucket of +k, -29 that of -k.
    pos = torch.tensor([[0, 1, 3, 30]])
    r = relative_position_index(pos, 2, 0, 4)
    assert r[0, 0, 2].item() == r[0, 0, 3].item() == 4
    assert r[0, 3, 0].item() == 0


# ---------------------------------------------------------------------------------------
# Gradients and training


def test_every_parameter_gets_a_gradient():
    # Default init: the conv bias starts at zero, so every PReLU sees negative inputs and
    # every parameter (slopes included) has a non-zero gradient from the first step.
    cfg = tiny_config()
    model = build(cfg)
    model(make_batch())["loss"].backward()
    names = [n for n, _ in model.named_parameters()]
    assert "taco.layers.0.attention.conv_prev_we" not in names  # layer 1: no previous logits
    assert "taco.layers.1.attention.conv_prev_we" in names
    assert "taco.layers.1.attention.conv_prev_pe" in names
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    zero = [
        n for n, p in model.named_parameters() if p.grad is not None and not p.grad.abs().sum() > 0
    ]
    assert not missing, missing
    assert not zero, zero


def test_layer1_conv_has_fewer_input_channels():
    cfg = tiny_config()
    model = build(cfg)
    l1, l2 = model.taco.layers[0].attention, model.taco.layers[1].attention
    assert l1.conv_weight().shape == (cfg.conv_out_channels, cfg.conv_in_channels(True))
    assert l2.conv_weight().shape == (cfg.conv_out_channels, cfg.conv_in_channels(False))


def test_overfits_one_batch():
    cfg = tiny_config(hidden_dropout=0.0, attention_dropout=0.0)
    model = build(cfg)
    batch = make_batch()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(100):
        loss = model(batch)["loss"]
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = model(batch)
    assert out["loss"].item() < 0.1 * first, (first, out["loss"].item())
    assert out["mlm_acc"].item() == 1.0 and out["mpm_acc"].item() == 1.0


# The recompute comparisons run in float64 from a scaled init, as the tensor-parallel tests
# do: at the default init the conv, PReLU and relative-LayerNorm gradients are below 1e-6,
# under assert_close's float32 tolerances, so a recompute that got them wrong would pass.
RECOMPUTE_INIT_STD = 0.2  # lifts the smallest gradients (PReLU, conv bias) to ~5e-3
RECOMPUTE_RTOL = 1e-10  # of each tensor's largest gradient; float64 reruns agree to ~1e-15


def _build_float64(cfg: TacoConfig) -> torch.nn.Module:
    model = build(dataclasses.replace(cfg, init_method_std=RECOMPUTE_INIT_STD)).double()
    # Break the symmetry of the constant inits (PReLU 0.25, biases 0, LayerNorm 1) so that
    # heads are not interchangeable.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _loss_and_grads(model, batch, seed):
    torch.manual_seed(seed)
    model.zero_grad()
    loss = model(batch)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_matches(dropout):
    """Same seed, same batch: recomputing layers in backward gives the same loss and
    gradients, dropout included (the checkpoint restores the RNG state)."""
    cfg = tiny_config(hidden_dropout=dropout, attention_dropout=dropout)
    plain = _build_float64(cfg)
    recompute = _build_float64(dataclasses.replace(cfg, recompute_activations=True))
    batch = make_batch()
    loss_a, grads_a = _loss_and_grads(plain, batch, seed=5)
    loss_b, grads_b = _loss_and_grads(recompute, batch, seed=5)
    # The heads compute the loss in float32 (parallel/cross_entropy.py).
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=0)
    largest = {name: g.abs().max().item() for name, g in grads_a.items()}
    # Even the loosest per-tensor tolerance is far below every tensor's gradient.
    assert min(largest.values()) > 1e4 * RECOMPUTE_RTOL * max(largest.values()), largest
    for name, g in grads_a.items():
        err = (grads_b[name] - g).abs().max().item() / largest[name]
        assert err <= RECOMPUTE_RTOL, (name, err)


# ---------------------------------------------------------------------------------------
# FLOPs


def test_flops_formula():
    cfg = tiny_config()
    f1 = taco_forward_flops(cfg, SEQ, rows=1, labelled_fraction=0.0)
    f2 = taco_forward_flops(cfg, SEQ, rows=2, labelled_fraction=0.0)
    # rows-independent part: the relative projections, once per layer per step.
    n = 2 * (SEQ - 1) + 2
    rel = (
        2
        * n
        * cfg.relative_embedding_size
        * 2
        * cfg.we_attention_heads
        * cfg.kv_channels
        * cfg.num_layers
    )
    assert f2 - f1 == pytest.approx(f1 - rel)
    assert taco_train_flops(cfg, SEQ, 4) == pytest.approx(3 * taco_forward_flops(cfg, SEQ, 4))
    heads = taco_forward_flops(cfg, SEQ, 4, labelled_fraction=0.15) - taco_forward_flops(
        cfg, SEQ, 4, labelled_fraction=0.0
    )
    per_mlm = 2 * (cfg.hidden_size * cfg.we_hidden_size + cfg.we_hidden_size * VOCAB)
    per_mpm = 2 * (
        cfg.hidden_size * cfg.pe_hidden_size + cfg.pe_hidden_size * cfg.max_position_embeddings
    )
    assert heads == pytest.approx(0.15 * SEQ * 2 * (per_mlm + per_mpm))
    # TACO-base: ~ 6 * 85M non-embedding-ish params per token dominates at seq 128.
    base = TacoConfig(vocab_size=30522)
    per_token = taco_train_flops(base, 128, 1) / 128
    assert 3e8 < per_token < 1e9


@pytest.mark.parametrize("with_prev", [False, True])
def test_attention_logits_backward_matches_autograd(with_prev, monkeypatch):
    """The fused maps + 1x1 conv op: its hand-written backward against finite differences,
    its forward against a plain einsum/gather reference. A small column block makes the CPU
    GEMMs run blocked, with a ragged last block."""
    monkeypatch.setattr(taco_module, "_CPU_COLUMN_BLOCK", 7)
    g = torch.Generator().manual_seed(0)
    hw, hp, b, s, d, k, c_out = 2, 1, 2, 5, 3, 3, 3
    pos = torch.tensor([[0, 1, 2, -1, 4], [3, -1, 0, 7, 1]])
    lo, hi = relative_bucket_range(pos, k)
    n = hi - lo + 2
    index = relative_position_index(pos, k, lo, hi)
    c_maps = 3 * hw + hp

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.double, requires_grad=True)

    args = [
        rand(hw, b, s, d),
        rand(hw, b, s, d),
        rand(hp, b, s, d),
        rand(hp, b, s, d),
        rand(hw, n, d),
        rand(hw, n, d),
    ]
    prev = rand(hw + hp, b, s, s) if with_prev else None
    w_maps, w_prev, bias = rand(c_out, c_maps), rand(c_out, hw + hp), rand(c_out)
    scale = 0.7

    def fn(*a):
        p, wp = (a[6], a[7]) if with_prev else (None, None)
        return taco_module.attention_logits(*a[:6], index, p, a[-2], wp, a[-1], scale)

    inputs = (*args, prev, w_prev) if with_prev else tuple(args)
    inputs = (*inputs, w_maps, bias)
    assert torch.autograd.gradcheck(fn, inputs)

    q_we, k_we, q_pe, k_pe, k_r, q_r = args
    c2p_all = torch.einsum("hbid,hnd->hbin", q_we, k_r)
    p2c_all = torch.einsum("hnd,hbjd->hbjn", q_r, k_we)
    maps = [
        torch.einsum("hbid,hbjd->hbij", q_we, k_we),
        torch.gather(c2p_all, -1, index.expand(hw, b, s, s)),
        torch.gather(p2c_all, -1, index.expand(hw, b, s, s)).transpose(-1, -2),
        torch.einsum("hbid,hbjd->hbij", q_pe, k_pe),
    ]
    maps = torch.cat([m * scale for m in maps])
    want = torch.einsum("oc,cbij->obij", w_maps, maps) + bias[:, None, None, None]
    if with_prev:
        want = want + torch.einsum("oc,cbij->obij", w_prev, prev)
    torch.testing.assert_close(fn(*inputs), want.reshape(c_out, -1))


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_attention_probs_backward_matches_autograd(dropout, padding):
    """Masked softmax, inverted dropout with a given keep mask and the two kinds of values:
    the hand-written backward against finite differences, the forward against plain ops."""
    g = torch.Generator().manual_seed(1)
    hw, hp, b, s, dv_we, dv_pe, p = 2, 1, 2, 5, 4, 3, 0.3

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.double, requires_grad=True)

    logits, v_we, v_pe = rand(hw + hp, b, s, s), rand(hw, b, s, dv_we), rand(hp, b, s, dv_pe)
    key_padding = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    key_padding = key_padding[None, :, None, :] if padding else None
    keep = torch.rand(hw + hp, b, s, s, generator=g) >= p if dropout else None

    def fn(logits, v_we, v_pe):
        return taco_module.attention_probs(logits, key_padding, keep, v_we, v_pe, 1 / (1 - p))

    assert torch.autograd.gradcheck(fn, (logits, v_we, v_pe))
    scores = logits if key_padding is None else logits.masked_fill(key_padding, -1e300)
    probs = torch.softmax(scores, -1)
    if dropout:
        probs = probs * keep / (1 - p)
    ctx_we, ctx_pe = fn(logits, v_we, v_pe)
    torch.testing.assert_close(ctx_we, probs[:hw] @ v_we)
    torch.testing.assert_close(ctx_pe, probs[hw:] @ v_pe)

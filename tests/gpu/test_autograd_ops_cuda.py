"""The hand-written autograd ops on CUDA, in float64, against their plain-op forms: forward
values and the gradients of every input (autograd through the plain ops), each compared
relative to its own magnitude. CPU tests check the same ops on CPU; CUDA has its own
kernels for the gathers, scatter-adds and batched GEMMs they are built from."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

RTOL = 1e-10
DEVICE = "cuda"


def _rand(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64, device=DEVICE)


def _assert_close(got, want, what):
    err = (got - want).abs().max().item()
    assert err <= RTOL * max(want.abs().max().item(), 1e-300), (what, err)


def _compare(op, plain, inputs, g):
    """Forward and the gradients of every input, hand-written op vs plain ops."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    ref = [t.detach().clone().requires_grad_() for t in inputs]
    out, want = op(*leaves), plain(*ref)
    outs, wants = (out, want) if isinstance(out, tuple) else ((out,), (want,))
    probes = [_rand(g, *o.shape) for o in outs]
    for i, (o, w) in enumerate(zip(outs, wants)):
        _assert_close(o, w, f"output {i}")
    got_grads = torch.autograd.grad(outs, leaves, probes, allow_unused=True)
    want_grads = torch.autograd.grad(wants, ref, probes, allow_unused=True)
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        if b is None:
            assert a is None or a.abs().max() == 0, i
        else:
            _assert_close(a, b, f"grad of input {i}")


@pytest.mark.parametrize("with_prev", [False, True])
def test_attention_logits(with_prev):
    from megatron_taco.models.common.relative import relative_bucket_range, relative_position_index
    from megatron_taco.models.taco.model import attention_logits

    g = torch.Generator(device=DEVICE).manual_seed(0)
    hw, hp, b, s, d, k, c_out = 3, 2, 2, 48, 8, 16, 5
    pos = torch.arange(s, device=DEVICE).repeat(b, 1)
    pos[0, 5] = pos[1, 40] = -1  # masked positions: the mask bucket
    lo, hi = relative_bucket_range(pos, k)
    index = relative_position_index(pos, k, lo, hi)
    n, c_maps, scale = hi - lo + 2, 3 * hw + hp, 0.35
    inputs = [_rand(g, hw, b, s, d), _rand(g, hw, b, s, d), _rand(g, hp, b, s, d),
              _rand(g, hp, b, s, d), _rand(g, hw, n, d), _rand(g, hw, n, d),
              _rand(g, c_out, c_maps), _rand(g, c_out)]  # fmt: skip
    if with_prev:
        inputs += [_rand(g, hw + hp, b, s, s), _rand(g, c_out, hw + hp)]

    def op(q_we, k_we, q_pe, k_pe, k_r, q_r, w, bias, *prev):
        p, wp = prev or (None, None)
        return attention_logits(q_we, k_we, q_pe, k_pe, k_r, q_r, index, p, w, wp, bias, scale)

    def plain(q_we, k_we, q_pe, k_pe, k_r, q_r, w, bias, *prev):
        idx = index.expand(hw, b, s, s)
        maps = [
            q_we @ k_we.transpose(-1, -2),
            torch.gather(torch.einsum("hbid,hnd->hbin", q_we, k_r), -1, idx),
            torch.gather(torch.einsum("hnd,hbjd->hbjn", q_r, k_we), -1, idx).transpose(-1, -2),
            q_pe @ k_pe.transpose(-1, -2),
        ]
        out = w @ (torch.cat(maps) * scale).flatten(1) + bias[:, None]
        return out if not prev else out + prev[1] @ prev[0].flatten(1)

    _compare(op, plain, inputs, g)


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_attention_probs(dropout, padding):
    from megatron_taco.models.taco.model import attention_probs

    g = torch.Generator(device=DEVICE).manual_seed(1)
    hw, hp, b, s, p = 3, 2, 2, 40, 0.2
    key_padding = None
    if padding:
        key_padding = torch.zeros(1, b, 1, s, dtype=torch.bool, device=DEVICE)
        key_padding[0, 1, 0, 30:] = True
    keep = torch.rand(hw + hp, b, s, s, generator=g, device=DEVICE) >= p if dropout else None
    inputs = [_rand(g, hw + hp, b, s, s), _rand(g, hw, b, s, 12), _rand(g, hp, b, s, 6)]

    def op(logits, v_we, v_pe):
        return attention_probs(logits, key_padding, keep, v_we, v_pe, 1 / (1 - p))

    def plain(logits, v_we, v_pe):
        if key_padding is not None:
            logits = logits.masked_fill(key_padding, torch.finfo(logits.dtype).min)
        probs = torch.softmax(logits, -1)
        if keep is not None:
            probs = probs * keep / (1 - p)
        return probs[:hw] @ v_we, probs[hw:] @ v_pe

    _compare(op, plain, inputs, g)


@pytest.mark.parametrize("masked", [False, True])
def test_relative_bias(masked):
    from megatron_taco.models.common.relative import deberta_relative_index
    from megatron_taco.models.sas.model import relative_bias

    g = torch.Generator(device=DEVICE).manual_seed(2)
    h, b, s, d, span = 3, 2, 40, 8, 16
    index = deberta_relative_index(s, span, 0, span, device=DEVICE)
    index_t = index.transpose(1, 2).contiguous()
    mask = None
    if masked:
        pad = torch.zeros(b, s, dtype=torch.bool, device=DEVICE)
        pad[1, 33:] = True
        mask = (pad[:, :, None] | pad[:, None, :]).unsqueeze(0)
    inputs = [_rand(g, h, b, s, d), _rand(g, h, b, s, d), _rand(g, h, 2 * span, d),
              _rand(g, h, 2 * span, d)]  # fmt: skip

    def op(q, k, q_r, k_r):
        return relative_bias(q, k, q_r, k_r, index, index_t, 0.3, mask)

    def plain(q, k, q_r, k_r):
        i = index[0]
        out = torch.einsum("hbid,hijd->hbij", q, k_r[:, i])
        out = out + torch.einsum("hbjd,hijd->hbij", k, q_r[:, i])
        out = out * 0.3
        return out if mask is None else out.masked_fill(mask, torch.finfo(out.dtype).min)

    _compare(op, plain, inputs, g)


def test_vocab_parallel_cross_entropy():
    from megatron_taco.parallel.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator(device=DEVICE).manual_seed(3)
    vocab, padded = 1000, 1024
    target = torch.randint(0, vocab, (64,), generator=g, device=DEVICE)
    target[:5] = -100

    def op(logits):
        return vocab_parallel_cross_entropy(logits, target, None, vocab_size=vocab)

    def plain(logits):
        return F.cross_entropy(logits[:, :vocab], target, reduction="none")

    _compare(op, plain, [_rand(g, 64, padded)], g)

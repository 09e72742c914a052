"""vocab_parallel_sample across a real gloo group at tp=2: same ids as tp=1, softmax law.

Vocabulary 300 padded to 512 for tp=2, so rank 1 holds ids 256..299 and 212 padding columns.
Every rank builds the full logits from a fixed seed and keeps its slice; the workers return
ids and the parent compares ranks and runs the chi-square test."""

from __future__ import annotations

import torch

from megatron_taco.parallel.layers import pad_vocab_size
from megatron_taco.parallel.sampling import sample_row_keys, vocab_parallel_sample
from megatron_taco.parallel.state import init_parallel
from tests.helpers import run_distributed
from tests.unit.test_sampling import PASS_P, chi_square_pvalue

VOCAB = 300
EXCLUDE = torch.tensor([0, 1, 2, 100, 255, 256, 299])  # both shards, both shard edges
FIT_ROWS = 40_000
SEED = 2024


def _full_logits(dtype):
    """(random batch [2, 64, padded], one fixed row [padded] for the fit), same on every rank."""
    padded = pad_vocab_size(VOCAB, 2)
    g = torch.Generator().manual_seed(7)
    batch = torch.randn(2, 64, padded, generator=g) * 2
    # Raise the ids held by rank 1 so that shard wins often, and make padding and excluded
    # ids overwhelming, so that any leak of them shows.
    row = torch.randn(padded, generator=g) * 1.5
    row[250:VOCAB] += 2.0
    for logits in (batch, row):
        logits[..., VOCAB:] = 40.0
        logits[..., EXCLUDE] = 40.0
    return batch.to(dtype), row.to(dtype)


def _sample(logits, group, keys, temperature):
    return vocab_parallel_sample(
        logits,
        group,
        vocab_size=VOCAB,
        row_keys=keys,
        seed=SEED,
        temperature=temperature,
        exclude_ids=EXCLUDE,
    )


def _sampling_worker(rank, world):
    state = init_parallel(tp_size=world)
    g = state.tp_group
    keys = sample_row_keys(torch.tensor([11, 12]), torch.arange(64).expand(2, 64), epoch=3)
    fit_keys = sample_row_keys(torch.arange(FIT_ROWS), torch.zeros(FIT_ROWS, dtype=torch.long), 0)
    out = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        batch, row = _full_logits(dtype)
        local_batch = batch.chunk(world, dim=-1)[rank]  # [2, 64, Vp]
        ids = _sample(local_batch, g, keys, 0.8)
        # tp=1 on the same process, from the full padded and from the unpadded logits.
        assert torch.equal(ids, _sample(batch, None, keys, 0.8)), f"tp=2 != tp=1 ({dtype})"
        assert torch.equal(ids, _sample(batch[..., :VOCAB], None, keys, 0.8)), dtype
        out[f"batch_{dtype}"] = ids
    _, row = _full_logits(torch.float32)
    local_rows = row.chunk(world)[rank].expand(FIT_ROWS, -1)  # [FIT_ROWS, Vp]
    fit = _sample(local_rows, g, fit_keys, 1.0)
    assert torch.equal(fit, _sample(row.expand(FIT_ROWS, -1), None, fit_keys, 1.0))
    out["fit"] = fit
    return out


def test_tp2_sampling_matches_tp1_and_follows_softmax():
    results = run_distributed(_sampling_worker, 2)
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), f"ranks disagree on {key}"
    for key, ids in results[0].items():
        assert ids.dtype == torch.int64 and (ids >= 0).all() and (ids < VOCAB).all(), key
        assert not torch.isin(ids, EXCLUDE).any(), f"excluded id drawn in {key}"

    _, row = _full_logits(torch.float32)
    probs = torch.softmax(row[:VOCAB].double(), dim=-1)
    probs[EXCLUDE] = 0
    fit = results[0]["fit"]
    assert (fit >= 256).float().mean() > 0.2  # the second shard really takes part
    assert chi_square_pvalue(torch.bincount(fit, minlength=VOCAB), probs) > PASS_P

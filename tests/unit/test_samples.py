import os

import numpy as np
import pytest

from megatron_taco.data import samples
from megatron_taco.data.samples import (
    build_sample_index_with_stats,
    get_split_document_ranges,
    parse_split,
)
from megatron_taco.errors import ConfigError


def build_sample_index(*args, **kwargs):
    """The rows alone (moved here from samples.py, where only tests used it)."""
    return build_sample_index_with_stats(*args, **kwargs)[0]


def make_corpus(num_docs=400, seed=0, max_sentences=30, long_every=0):
    rng = np.random.default_rng(seed)
    per_doc = rng.integers(0, max_sentences, size=num_docs)
    sizes = rng.integers(0, 40, size=int(per_doc.sum())).astype(np.int32)
    if long_every:
        sizes[::long_every] = 300  # longer than any target below
    docs = np.zeros(num_docs + 1, dtype=np.int64)
    np.cumsum(per_doc, out=docs[1:])
    return sizes, docs


def reference_rows(sizes, docs, doc_range, max_target, min_sentences):
    """Megatron's packing loop with a constant target (no short samples)."""
    rows = []
    for d in range(*doc_range):
        first, last = int(docs[d]), int(docs[d + 1])
        if last - first < min_sentences:
            continue
        start, tokens, count = first, 0, 0
        for s in range(first, last):
            tokens += int(sizes[s])
            count += 1
            remaining = last - s - 1
            if (
                tokens >= max_target and remaining >= min_sentences and count >= min_sentences
            ) or remaining == 0:
                rows.append((start, s + 1, max_target))
                start, tokens, count = s + 1, 0, 0
    return sorted(rows)


def check_rows(index, sizes, docs, doc_range, max_target, min_sentences):
    """Every row obeys the packing rule with its own target, for any short_seq_prob."""
    cum = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    doc_of = np.searchsorted(docs, index[:, 0], side="right") - 1
    assert np.all((doc_of >= doc_range[0]) & (doc_of < doc_range[1]))
    for (s, e, t), d in zip(index.tolist(), doc_of.tolist()):
        first, last = int(docs[d]), int(docs[d + 1])
        assert first <= s < e <= last, "a sample crosses a document boundary"
        assert last - first >= min_sentences
        assert 2 <= t <= max_target
        # the first admissible close after s: enough tokens, enough sentences, enough left
        ok = [c for c in range(s + min_sentences, last - min_sentences + 1) if cum[c] - cum[s] >= t]
        assert e == (ok[0] if ok else last)
        assert e - s >= min(min_sentences, last - s)


@pytest.mark.parametrize("min_sentences", [1, 2, 3])
def test_matches_reference_packing_without_short_samples(min_sentences):
    sizes, docs = make_corpus(long_every=17)
    index = build_sample_index(
        sizes,
        docs,
        (0, 400),
        num_epochs=1,
        max_seq_length=66,
        short_seq_prob=0.0,
        min_sentences=min_sentences,
        seed=3,
    )
    assert index.dtype == np.int64 and index.shape[1] == 3
    got = sorted(map(tuple, index.tolist()))
    assert got == reference_rows(sizes, docs, (0, 400), 64, min_sentences)


def test_rows_tile_used_documents_and_follow_rule_with_short_targets():
    sizes, docs = make_corpus(num_docs=300, seed=1)
    rng_range = (20, 280)
    index, stats = build_sample_index_with_stats(
        sizes,
        docs,
        rng_range,
        num_epochs=1,
        max_seq_length=50,
        short_seq_prob=0.3,
        min_sentences=2,
        seed=5,
    )
    check_rows(index, sizes, docs, rng_range, 48, 2)
    # one epoch covers every sentence of every used document exactly once
    covered = np.zeros(sizes.shape[0], dtype=np.int64)
    for s, e, _ in index.tolist():
        covered[s:e] += 1
    per_doc = np.diff(docs)
    for d in range(*rng_range):
        want = 1 if per_doc[d] >= 2 else 0
        assert np.all(covered[docs[d] : docs[d + 1]] == want)
    assert stats.documents == 260
    assert stats.empty_documents == int(np.sum(per_doc[20:280] == 0))
    assert stats.short_documents == int(np.sum(per_doc[20:280] == 1))


def test_short_seq_prob_fraction():
    sizes, docs = make_corpus(num_docs=3000, seed=2)
    for p in (0.0, 0.1, 0.5):
        index = build_sample_index(
            sizes,
            docs,
            (0, 3000),
            num_epochs=1,
            max_seq_length=130,
            short_seq_prob=p,
            min_sentences=2,
            seed=9,
        )
        n = index.shape[0]
        short = np.mean(index[:, 2] < 128)
        # a short draw can hit the maximum itself (1 in 127)
        expected = p * 126 / 127
        assert abs(short - expected) < 4 * np.sqrt(max(p * (1 - p), 1e-9) / n) + 1e-12
        if p:
            t = index[index[:, 2] < 128, 2]
            assert t.min() == 2 and t.max() >= 120


def test_long_sentences_are_kept_truncated_and_counted():
    sizes = np.array([5, 300, 5, 5, 5, 400], dtype=np.int32)
    docs = np.array([0, 4, 6], dtype=np.int64)
    index, stats = build_sample_index_with_stats(
        sizes,
        docs,
        (0, 2),
        num_epochs=1,
        max_seq_length=34,
        short_seq_prob=0.0,
        min_sentences=1,
        seed=0,
    )
    # Megatron would drop both documents; here the over-long sentence closes its sample
    assert sorted(map(tuple, index.tolist())) == [(0, 2, 32), (2, 4, 32), (4, 6, 32)]
    assert stats.long_sentences == 2
    assert stats.truncated_tokens == (305 - 32) + (405 - 32)
    assert stats.tokens == 32 + 10 + 32


def test_determinism_and_seed_sensitivity():
    sizes, docs = make_corpus()
    kw = dict(num_epochs=2, max_seq_length=40, short_seq_prob=0.2, min_sentences=2)
    a = build_sample_index(sizes, docs, (0, 400), seed=11, **kw)
    b = build_sample_index(sizes, docs, (0, 400), seed=11, **kw)
    c = build_sample_index(sizes, docs, (0, 400), seed=12, **kw)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    # each epoch is shuffled: not in corpus order
    one = build_sample_index(sizes, docs, (0, 400), seed=11, **{**kw, "num_epochs": 1})
    pos = np.arange(one.shape[0])
    assert abs(np.corrcoef(pos, one[:, 0])[0, 1]) < 0.15  # not in corpus order
    begins_doc = np.isin(one[:, 0], docs)
    half = one.shape[0] // 2
    assert abs(begins_doc[:half].mean() - begins_doc[half:].mean()) < 0.1  # nor doc by doc
    assert np.array_equal(a[: one.shape[0]], one)
    # the second epoch draws its own targets, so it packs differently, not just in another order
    key = lambda x: sorted(map(tuple, x.tolist()))  # noqa: E731
    assert key(a[one.shape[0] :]) != key(one)


def test_num_samples_across_epochs():
    sizes, docs = make_corpus(num_docs=50)
    kw = dict(max_seq_length=40, short_seq_prob=0.1, min_sentences=2, seed=4)
    one, st1 = build_sample_index_with_stats(sizes, docs, (0, 50), num_epochs=1, **kw)
    want = int(one.shape[0] * 2.5)
    index, stats = build_sample_index_with_stats(sizes, docs, (0, 50), num_samples=want, **kw)
    assert index.shape == (want, 3)
    assert stats.epochs == 3 and st1.epochs == 1
    # epoch-major: the first epoch is the 1-epoch index, a full pass before any repeat
    assert np.array_equal(index[: one.shape[0]], one)
    first = one.shape[0]
    assert np.array_equal(np.sort(index[:first, 0]), np.sort(one[:, 0]))
    assert build_sample_index(sizes, docs, (0, 50), num_samples=0, **kw).shape == (0, 3)


def test_lockstep_and_pointer_doubling_agree(monkeypatch):
    # long documents (hundreds of samples) force the pointer-doubling path
    rng = np.random.default_rng(7)
    per_doc = np.array([0, 1, 900, 3, 400, 2, 1500, 5])
    sizes = rng.integers(1, 30, size=int(per_doc.sum())).astype(np.int32)
    docs = np.concatenate([[0], np.cumsum(per_doc)])
    kw = dict(num_epochs=1, max_seq_length=40, short_seq_prob=0.2, min_sentences=2, seed=2)
    mixed = build_sample_index(sizes, docs, (0, 8), **kw)
    monkeypatch.setattr(samples, "_LOCKSTEP_ROUNDS", 0)
    doubling = build_sample_index(sizes, docs, (0, 8), **kw)
    monkeypatch.setattr(samples, "_LOCKSTEP_ROUNDS", 10_000)
    lockstep = build_sample_index(sizes, docs, (0, 8), **kw)
    key = lambda a: sorted(map(tuple, a.tolist()))  # noqa: E731
    assert key(mixed) == key(doubling) == key(lockstep)
    check_rows(mixed, sizes, docs, (0, 8), 38, 2)


def test_bad_arguments():
    sizes, docs = make_corpus(num_docs=10)
    kw = dict(max_seq_length=40, short_seq_prob=0.1, min_sentences=2, seed=1)
    with pytest.raises(ValueError, match="exactly one"):
        build_sample_index(sizes, docs, (0, 10), **kw)
    with pytest.raises(ValueError, match="doc_range"):
        build_sample_index(sizes, docs, (0, 11), num_epochs=1, **kw)
    with pytest.raises(ValueError, match="short_seq_prob"):
        build_sample_index(sizes, docs, (0, 10), num_epochs=1, **{**kw, "short_seq_prob": 1.5})
    one_sentence_docs = np.arange(6, dtype=np.int64)
    with pytest.raises(ValueError, match="no samples"):
        build_sample_index(np.ones(5, np.int32), one_sentence_docs, (0, 5), num_samples=3, **kw)


def test_split_ranges():
    assert get_split_document_ranges(1000, "949,50,1") == [(0, 949), (949, 999), (999, 1000)]
    assert get_split_document_ranges(10, "1") == [(0, 10), (10, 10), (10, 10)]
    assert get_split_document_ranges(7, "1/1/1") == [(0, 2), (2, 5), (5, 7)]
    assert get_split_document_ranges(0, "98,2") == [(0, 0), (0, 0), (0, 0)]
    for n in (1, 5, 99, 1234):
        r = get_split_document_ranges(n, "0.3,0.3,0.4")
        assert r[0][0] == 0 and r[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
    assert parse_split("3,1") == [0.75, 0.25, 0.0]


@pytest.mark.parametrize("bad", ["", "a,b", "1,2,3,4", "-1,2", "0,0,0", "1,,2"])
def test_bad_split_names_flag(bad):
    with pytest.raises(ConfigError, match="--split"):
        get_split_document_ranges(10, bad)


def _megatron_helpers():
    """megatron-core's compiled helpers, loaded from their file (importing megatron.core
    itself takes seconds); None when megatron-core is not installed."""
    import glob
    import importlib.machinery
    import importlib.util

    try:
        spec = importlib.util.find_spec("megatron.core")
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    found = glob.glob(
        os.path.join(spec.submodule_search_locations[0], "datasets", "helpers_cpp*.so")
    )
    if not found:
        return None
    loader = importlib.machinery.ExtensionFileLoader("helpers_cpp", found[0])
    module_spec = importlib.util.spec_from_loader("helpers_cpp", loader)
    module = importlib.util.module_from_spec(module_spec)
    loader.exec_module(module)
    return module


def test_same_samples_as_megatron_core_build_mapping():
    helpers = _megatron_helpers()
    if helpers is None:
        pytest.skip("megatron-core's compiled helpers are not installed")
    sizes, docs = make_corpus(num_docs=500, seed=3)  # no sentence over Megatron's 512 limit
    ours = build_sample_index(
        sizes,
        docs,
        (0, 500),
        num_epochs=1,
        max_seq_length=66,
        short_seq_prob=0.0,
        min_sentences=2,
        seed=1,
    )
    # Megatron's max_seq_length is the body target (its BERT passes sequence_length - 3 for
    # two segments; ours has one, hence - 2)
    theirs = helpers.build_mapping(docs, sizes, 1, 2**31, 64, 0.0, 1, False, 2)
    assert sorted(map(tuple, ours.tolist())) == sorted(
        map(tuple, np.asarray(theirs, np.int64).tolist())
    )


def test_base_chains_plus_walks_equal_walking_every_chain():
    # The index keeps each document's full-length chain up to its first short start and
    # walks only the rest again; walking every chain of every epoch must give the same rows.
    rng = np.random.default_rng(5)
    per_doc = np.concatenate([rng.integers(0, 40, size=300), [700, 0, 1, 2]])
    sizes = rng.integers(1, 60, size=int(per_doc.sum())).astype(np.int32)
    docs = np.concatenate([[0], np.cumsum(per_doc)])
    cum = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    used = np.diff(docs) >= 2
    start, end = docs[:-1][used], docs[1:][used]
    for p in (0.0, 0.3, 1.0):
        packing = samples._Packing(cum, 62, p, 2, 17, 0, np.int64)
        epochs = np.arange(3, 9)
        rows, slots, sums = packing.rows(start, end, epochs)
        for k in range(epochs.shape[0]):
            a, b, walked = slots[k]
            got = sorted(map(tuple, rows[np.concatenate((np.arange(a, b), walked))].tolist()))
            n = start.shape[0]
            _, s, e, t = packing.walk(np.full(n, k), start, end)
            assert got == sorted(zip(s.tolist(), e.tolist(), t.tolist()))
            body = cum[e] - cum[s]
            assert sums[k].tolist() == [
                np.minimum(body, t).sum(),
                (body - np.minimum(body, t)).sum(),
                np.count_nonzero(t < 62),
            ]


def test_index_does_not_depend_on_how_many_epochs_are_built_together(monkeypatch):
    sizes, docs = make_corpus(num_docs=200, seed=6)
    kw = dict(num_samples=4000, max_seq_length=40, short_seq_prob=0.2, min_sentences=2, seed=3)
    together, stats = build_sample_index_with_stats(sizes, docs, (0, 200), **kw)
    monkeypatch.setattr(samples, "_MAX_CHAINS", 1)  # one epoch at a time
    one_by_one, stats1 = build_sample_index_with_stats(sizes, docs, (0, 200), **kw)
    assert np.array_equal(together, one_by_one) and stats == stats1
    assert stats.epochs >= 3
    check_rows(together, sizes, docs, (0, 200), 38, 2)

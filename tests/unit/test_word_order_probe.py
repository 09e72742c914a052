"""The word-order probe's pieces (evaluation/figure1.py): the paper's Distance and Angle
against values derived by hand, words and shared words with repeated and split words, piece
offsets through a real sentencepiece model (accents: byte offsets), and bad input. The tool
on real checkpoints: tests/e2e/test_word_order_probe.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from megatron_taco.cli.word_order_probe import main
from megatron_taco.errors import ConfigError
from megatron_taco.evaluation.figure1 import (
    PAPER_SENTENCES,
    ProbeConfig,
    angle,
    char_spans_from_bytes,
    compared_words,
    distance,
    read_sentences,
    shared_words,
    word_vectors,
    words_of,
)


def test_distance_and_angle_by_hand():
    # v1 = (3, 4), v2 = (6, 0): |v1| = 5, |v2| = 6, v1 - v2 = (-3, 4) so |v1 - v2| = 5 and
    # d = 5 / min(5, 6) = 1. v1.v2 = 18, cos = 18 / (5 * 6) = 3/5: the angle of the 3-4-5
    # triangle at its side 3, atan2(4, 3) = 0.927295218... rad = 53.130102... degrees.
    v1, v2 = np.array([3.0, 4.0]), np.array([6.0, 0.0])
    assert distance(v1, v2) == pytest.approx(1.0, abs=1e-15)
    assert distance(v2, v1) == pytest.approx(1.0, abs=1e-15)
    assert angle(v1, v2) == pytest.approx(0.9272952180016122, abs=1e-15)
    assert math.degrees(angle(v1, v2)) == pytest.approx(53.13010235415598, abs=1e-12)
    # u1 = (1, 2, 2), u2 = -2 u1: |u1| = 3, |u2| = 6, u1 - u2 = 3 u1 so |u1 - u2| = 9 and
    # d = 9 / 3 = 3 (divided by the shorter length, not the longer: 9 / 6 would be 1.5);
    # opposite directions: angle = pi (the cosine may round to just below -1: clipped).
    u1 = np.array([1.0, 2.0, 2.0])
    assert distance(u1, -2 * u1) == pytest.approx(3.0, abs=1e-14)
    assert angle(u1, -2 * u1) == pytest.approx(math.pi, abs=1e-7)
    # Parallel vectors w and 7w: angle 0, d = |w - 7w| / |w| = 6. For this w the cosine
    # rounds to 1 + 2^-52 in float64, where an unclipped arccos would give NaN.
    w = np.array([0.0, -2.3, -0.2])
    assert np.dot(w, 7 * w) / (np.linalg.norm(w) * np.linalg.norm(7 * w)) > 1.0
    assert angle(w, 7 * w) == 0.0
    assert distance(w, 7 * w) == pytest.approx(6.0, abs=1e-14)


def test_words_keep_case_folded_keys_and_occurrences():
    words = words_of("Once, Bob asked the  dog; the Dog ran.", case_insensitive=True)
    assert [w.text for w in words] == [
        "Once", ",", "Bob", "asked", "the", "dog", ";", "the", "Dog", "ran", "."
    ]  # fmt: skip
    assert [(w.key, w.occurrence) for w in words if w.key in ("the", "dog")] == [
        ("the", 0), ("dog", 0), ("the", 1), ("dog", 1)
    ]  # fmt: skip
    text = "Once, Bob asked the  dog; the Dog ran."
    assert all(text[slice(*w.span)] == w.text for w in words)
    # By default the keys are the words as written: "dog" and "Dog" are two words.
    words = words_of(text)
    assert [(w.key, w.occurrence) for w in words if w.key.casefold() == "dog"] == [
        ("dog", 0), ("Dog", 0)
    ]  # fmt: skip


def test_shared_words_pair_kth_occurrence_with_kth():
    a = words_of("the cat saw the dog and the bird.", case_insensitive=True)
    b = words_of("The dog saw the cat.", case_insensitive=True)
    pairs = shared_words(a, b)
    got = [(a[i].text, a[i].occurrence, b[j].text, b[j].occurrence) for i, j in pairs]
    assert got == [
        ("the", 0, "The", 0),  # case-insensitive
        ("cat", 0, "cat", 0),
        ("saw", 0, "saw", 0),
        ("the", 1, "the", 1),
        ("dog", 0, "dog", 0),
        (".", 0, ".", 0),
    ]  # the third "the" of a has no partner in b; "and", "bird" are not shared
    # b's positions: cat is b's 5th word, dog its 2nd.
    assert [j for _, j in pairs] == [0, 4, 2, 3, 1, 5]


def test_paper_sentences_share_their_words():
    s1, s2, s3 = (words_of(s, case_insensitive=True) for s in PAPER_SENTENCES)
    words = ["Bob", "once", "asked", "Alice", "to", "borrow", "a", "book", "."]
    assert [s1[i].text for i, _ in shared_words(s1, s2)] == words
    assert [s1[i].text for i, _ in shared_words(s1, s3)] == words
    assert [s2[j].text for _, j in shared_words(s1, s2)][1] == "Once"
    s1, s2 = (words_of(s) for s in PAPER_SENTENCES[:2])  # as written: "Once" is not "once"
    assert [s1[i].text for i, _ in shared_words(s1, s2)] == [w for w in words if w != "once"]


def _pieced(sp, text: str, case_insensitive: bool):
    """The words of ``text`` with the pieces of a real sentencepiece model that cover them."""
    proto = sp.encode(text, return_type="proto")
    spans = char_spans_from_bytes(text, [(p.begin, p.end) for p in proto.pieces])
    hidden = np.zeros((len(spans), 1))
    words, _ = word_vectors(words_of(text, case_insensitive), spans, hidden, "mean",
                            [p.piece for p in proto.pieces])  # fmt: skip
    return words


def test_only_words_with_the_same_pieces_are_compared(tokenizer_model):
    """A cased tokenizer cuts "once" and "Once" differently: matched up to case, the pair is
    skipped (its row would mix a change of token with the change of order), with both
    tokenisations; by default it is listed as differing in case. Every compared word has
    the same pieces in both sentences."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
    s1, s2 = PAPER_SENTENCES[:2]
    a, b = _pieced(sp, s1, True), _pieced(sp, s2, True)
    once_a = next(w for w in a if w.text == "once").pieces
    once_b = next(w for w in b if w.text == "Once").pieces
    assert once_a != once_b, (once_a, once_b)  # this tokenizer's pieces differ
    compared, skipped = compared_words(a, b, case_insensitive=True)
    assert all(a[i].pieces == b[j].pieces for i, j in compared)
    assert "once" not in {a[i].text for i, _ in compared}
    assert [(r["word"], r["other"], r["reason"]) for r in skipped] == [
        ("once", "Once", "tokenised differently")
    ]
    assert skipped[0]["pieces"] == [list(once_a), list(once_b)]
    a, b = _pieced(sp, s1, False), _pieced(sp, s2, False)
    compared_cs, skipped = compared_words(a, b)
    assert [a[i].text for i, _ in compared_cs] == [a[i].text for i, _ in compared]
    assert [(r["word"], r["other"], r["reason"]) for r in skipped] == [
        ("once", "Once", "differs in case (see --case-insensitive)")
    ]
    # A word tokenised alike in both is compared: same text, same pieces.
    c = _pieced(sp, "Once upon a time.", True)
    d = _pieced(sp, "A time, once upon.", True)
    pairs, _ = compared_words(c, d, case_insensitive=True)
    assert {c[i].text for i, _ in pairs} >= {"upon", "time", "."}


def test_a_word_is_compared_only_with_all_its_pieces_the_same():
    """ "borrow" is ▁bor|row in one sentence and ▁bor|r|ow in the other: the same first
    piece (the whole vector of --subword first), other pieces after it. Its row would mix
    a change of token with the change of order: skipped, with both tokenisations."""
    a, b = "Bob borrow", "borrow Bob"
    spans_a, names_a = [(0, 3), (4, 7), (7, 10)], ["▁Bob", "▁bor", "row"]
    spans_b, names_b = [(0, 3), (3, 4), (4, 6), (7, 10)], ["▁bor", "r", "ow", "▁Bob"]
    wa, _ = word_vectors(words_of(a), spans_a, np.zeros((3, 1)), "first", names_a)
    wb, _ = word_vectors(words_of(b), spans_b, np.zeros((4, 1)), "first", names_b)
    assert [w.pieces for w in wa] == [("▁Bob",), ("▁bor", "row")]
    compared, skipped = compared_words(wa, wb)
    assert [(wa[i].text, wb[j].text) for i, j in compared] == [("Bob", "Bob")]
    assert skipped == [{"word": "borrow", "other": "borrow", "occurrence": 0,
                        "reason": "tokenised differently",
                        "pieces": [["▁bor", "row"], ["▁bor", "r", "ow"]]}]  # fmt: skip


def test_words_paired_as_written_are_not_also_skipped_for_case():
    """Both spellings occur in both sentences: each is compared with its own, and no row
    says a compared word was skipped. A spelling left over is skipped for case."""

    def pieced(text):  # one piece per word, the same in both sentences
        return [dataclasses.replace(w, pieces=(w.text,)) for w in words_of(text)]

    a, b = pieced("Once upon once"), pieced("once upon Once")
    compared, skipped = compared_words(a, b)
    assert [(a[i].text, b[j].text) for i, j in compared] == [
        ("Once", "Once"), ("upon", "upon"), ("once", "once")
    ]  # fmt: skip
    assert skipped == []
    a, b = pieced("once Once upon"), pieced("Once upon")
    compared, skipped = compared_words(a, b)
    assert [(a[i].text, b[j].text) for i, j in compared] == [("Once", "Once"), ("upon", "upon")]
    assert skipped == []  # b's one "Once" is taken: a's "once" has no counterpart
    a, b = pieced("Once upon"), pieced("upon once")
    _, skipped = compared_words(a, b)
    assert [(r["word"], r["other"], r["reason"]) for r in skipped] == [
        ("Once", "once", "differs in case (see --case-insensitive)")
    ]


def test_word_vectors_from_split_words():
    text = "unbelievable book."
    words = words_of(text)
    # [CLS] "▁un" "believ" "able" "▁bo" "ok." [SEP]: the last piece spans the end of "book"
    # and the ".", so it counts for both words; specials have empty spans.
    pieces = [(0, 0), (0, 2), (2, 8), (8, 12), (12, 16), (16, 18), (0, 0)]
    hidden = np.array([[100.0 * i, i] for i in range(len(pieces))])  # row i = (100 i, i)
    kept, mean = word_vectors(words, pieces, hidden, "mean")
    assert [w.text for w in kept] == ["unbelievable", "book", "."]
    np.testing.assert_allclose(mean, [[200.0, 2.0], [450.0, 4.5], [500.0, 5.0]])
    _, first = word_vectors(words, pieces, hidden, "first")
    np.testing.assert_allclose(first, [[100.0, 1.0], [400.0, 4.0], [500.0, 5.0]])
    # A word no piece covers is left out (here: the tokenizer dropped the ".").
    kept, _ = word_vectors(words, pieces[:5], hidden[:5], "mean")
    assert [w.text for w in kept] == ["unbelievable", "book"]


def test_sentencepiece_byte_offsets_become_character_spans(tokenizer_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
    text = "A naïve café-owner,  «Bob» once."
    proto = sp.encode(text, return_type="proto")
    spans = char_spans_from_bytes(text, [(p.begin, p.end) for p in proto.pieces])
    for piece, (s, e) in zip(proto.pieces, spans):
        # A piece's surface is the original text it stands for (leading spaces included).
        assert text[s:e] == piece.surface, (piece.piece, text[s:e], piece.surface)
    assert char_spans_from_bytes("ï.", [(0, 2), (2, 3)]) == [(0, 1), (1, 2)]


def test_read_sentences(tmp_path):
    assert read_sentences(None) == list(PAPER_SENTENCES)
    path = tmp_path / "s.txt"
    path.write_text("First one.\n\n  Second one.  \nThird.\n", encoding="utf-8")
    assert read_sentences(str(path)) == ["First one.", "Second one.", "Third."]
    path.write_text("Only one.\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"--sentences: .* has 1 sentences"):
        read_sentences(str(path))
    with pytest.raises(ConfigError, match=r"--sentences: cannot read"):
        read_sentences(str(tmp_path / "missing.txt"))


def test_config_checks():
    with pytest.raises(ConfigError, match="--load"):
        ProbeConfig(load=())
    with pytest.raises(ConfigError, match="--plot-pair"):
        ProbeConfig(load=("x",), plot_pair=(2, 2))
    with pytest.raises(ConfigError, match="--plot-pair"):
        ProbeConfig(load=("x",), plot_pair=(0, 1))


def test_bad_load_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--load", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "out")])
    assert info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and "--load" in err[0] and "nope" in err[0]
    # An empty directory is neither a transformers directory nor a checkpoint.
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as info:
        main(["--load", str(tmp_path / "empty"), "--output-dir", str(tmp_path / "out")])
    assert info.value.code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and "neither a transformers model directory" in err[0]
    assert not (tmp_path / "out").exists()

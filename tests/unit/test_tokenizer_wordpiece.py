"""BERT WordPiece (--tokenizer-type BertWordPieceLowerCase / BertWordPieceCase --vocab-file):
our ids against transformers' BertTokenizerFast on real text, the specials read from the
vocabulary (BERT's layout: [PAD]=0, [UNK]=100, [CLS]=101 ...), whole-word starts against
BertTokenizerFast's own word_ids(), and the flags' one-line errors. Every comparison is of
real ids: transformers 5.23's BertTokenizerFast(vocab_file=path) maps every word to [UNK]
(it must be given the path positionally), so a test that compared only shapes or counts
would pass on an all-[UNK] encoding."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer
from megatron_taco.data.masking import word_units
from megatron_taco.data.tokenizer import (
    SPECIAL_PIECES,
    TokenizerError,
    WordPieceTokenizer,
    load_tokenizer,
)
from megatron_taco.errors import ConfigError
from tests.helpers import bert_layout, botchan_sentences

transformers = pytest.importorskip("transformers")

# Accents, CJK (each character its own word in BERT), punctuation runs, digits, a literal
# special token, cased words, and runs of spaces: the normaliser's cases.
EXTRA_TEXTS = [
    "The  quick brown fox, «naïve» café-owner, asked [MASK] twice: 42 ﬁsh? 日本語",
    'Mr. Yamaarashi’s "Hubbard Squash"--said he--was 3.14159 km away!!',
    "ÉCOLE Élève über STRASSE Ångström",
]


@pytest.fixture(scope="module", params=["BertWordPieceLowerCase", "BertWordPieceCase"])
def vocab(request, tmp_path_factory, botchan_path) -> tuple[str, str]:
    """(vocab.txt in BERT's layout trained by taco-train-tokenizer, its type)."""
    out = tmp_path_factory.mktemp("wordpiece")
    trained = train_tokenizer(
        TrainTokenizerConfig(
            input=(str(botchan_path),),
            model_prefix=str(out / "wp"),
            tokenizer_type=request.param,
            vocab_size=700,
        )
    )
    pieces = Path(trained).read_text(encoding="utf-8").splitlines()
    assert pieces[:5] == list(SPECIAL_PIECES)  # the trainer's own layout
    path = out / "vocab.txt"
    path.write_text("".join(p + "\n" for p in bert_layout(pieces)), encoding="utf-8")
    return str(path), request.param


def texts() -> list[str]:
    return [*botchan_sentences()[:200], *EXTRA_TEXTS]


def test_ids_equal_bert_tokenizer_fast(vocab):
    path, kind = vocab
    ours = load_tokenizer(path, kind)
    assert isinstance(ours, WordPieceTokenizer)
    ref = transformers.BertTokenizerFast(path, do_lower_case=kind.endswith("LowerCase"))
    got = ours.encode_batch(texts())
    want = [ref(t, add_special_tokens=False)["input_ids"] for t in texts()]
    assert got == want
    assert [ours.encode(t) for t in texts()] == want
    flat = np.concatenate([np.asarray(ids) for ids in got])
    # Real text mostly spells with real pieces: an all-[UNK] tokenizer fails here.
    assert np.mean(flat == ours.unk_id) < 0.01 and len(np.unique(flat)) > 300
    assert ref.convert_ids_to_tokens(got[-3][:3]) == [ours.id_to_piece(i) for i in got[-3][:3]]


def test_case_handling_follows_the_type(vocab):
    path, kind = vocab
    ours = load_tokenizer(path, kind)
    lower = kind.endswith("LowerCase")
    # Lower case strips accents and case: both spellings are the same ids.
    assert (ours.encode("Élève CAFÉ") == ours.encode("eleve cafe")) is lower


def test_specials_come_from_the_vocabulary(vocab):
    path, kind = vocab
    tok = load_tokenizer(path, kind)
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 100, 101, 102, 103)
    assert tok.eod_id == tok.sep_id
    special = tok.is_special_mask()
    assert special[[0, 1, 99, 101, 102, 103]].all() and not special[100]  # [unusedN] too
    assert not special[104:].any()
    assert tok.encode("[MASK]") == [103]  # a literal special, as BertTokenizerFast


def test_word_starts_match_bert_word_ids(vocab):
    """A piece starts a word iff it is not a "##" continuation: the same words as
    BertTokenizerFast's word_ids(), and masking's word units are exactly those words."""
    path, kind = vocab
    tok = load_tokenizer(path, kind)
    ref = transformers.BertTokenizerFast(path, do_lower_case=kind.endswith("LowerCase"))
    starts_mask = tok.word_start_mask()
    continuations = 0
    for text in texts():
        enc = ref(text, add_special_tokens=False)
        ids = np.asarray(enc["input_ids"])
        words = enc.word_ids()
        want = np.array([i == 0 or words[i] != words[i - 1] for i in range(len(words))])
        np.testing.assert_array_equal(starts_mask[ids], want, err_msg=text)
        continuations += int((~want).sum())
        # masking's whole-word units: [CLS] body [SEP], units cover the words exactly
        row = np.concatenate(([tok.cls_id], ids, [tok.sep_id]))
        maskable = ~tok.is_special_mask()[row]
        unit_start, unit_end, _ = word_units(starts_mask[row], maskable)
        bounds = np.flatnonzero(np.concatenate((want, [True]))) + 1  # body -> row positions
        words_of_text = maskable[bounds[:-1]]  # a literal "[MASK]" in the text is no word
        np.testing.assert_array_equal(unit_start, bounds[:-1][words_of_text])
        np.testing.assert_array_equal(unit_end, bounds[1:][words_of_text])
    assert continuations > 100  # the texts do have "##" pieces


def test_offsets_point_into_the_original_text(vocab):
    path, kind = vocab
    tok = load_tokenizer(path, kind)
    ref = transformers.BertTokenizerFast(path, do_lower_case=kind.endswith("LowerCase"))
    for text, (ids, offsets) in zip(texts(), tok.encode_with_offsets(texts())):
        enc = ref(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids.tolist() == enc["input_ids"]
        assert offsets.tolist() == [list(o) for o in enc["offset_mapping"]]


def test_pickle_round_trip(vocab):
    path, kind = vocab
    tok = load_tokenizer(path, kind)
    back = pickle.loads(pickle.dumps(tok))
    assert back.lower_case == tok.lower_case and back.encode(EXTRA_TEXTS[0]) == tok.encode(
        EXTRA_TEXTS[0]
    )


@pytest.mark.parametrize(
    "content, message",
    [
        ("[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\nworld\n", r"lacks \[MASK\]"),
        ("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhi\nhi\n", "'hi' appears twice"),
        (b"\x0a\x0b\xff\xfe\x00binary", "not a WordPiece vocabulary"),
    ],
)
def test_bad_vocabularies_are_one_line(tmp_path, content, message):
    path = tmp_path / "vocab.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TokenizerError, match=message) as info:
        WordPieceTokenizer(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_vocabulary_lines_are_read_as_tokenizers_reads_them(tmp_path):
    """Pieces holding "\u2028" or "\x85" (str.splitlines breaks there, tokenizers does not)
    and CRLF line ends: every piece keeps the id BertTokenizerFast gives it."""
    pieces = bert_layout(["the", "\u2028x", "cat", "\x85y", "##s", "zz"])
    ref_path = tmp_path / "lf.txt"
    ref_path.write_bytes("".join(p + "\n" for p in pieces).encode())
    ref = transformers.BertTokenizerFast(str(ref_path))
    assert len(ref.get_vocab()) == len(pieces)
    for name, end in (("lf.txt", "\n"), ("crlf.txt", "\r\n")):
        path = tmp_path / name
        path.write_bytes("".join(p + end for p in pieces).encode())
        tok = WordPieceTokenizer(path)
        assert tok.vocab_size == len(pieces)
        ids = tok.encode("The cats zz")
        assert ids == ref("The cats zz", add_special_tokens=False)["input_ids"]
        assert [tok.id_to_piece(i) for i in ids] == ["the", "cat", "##s", "zz"]
        assert tok.word_start_mask()[ids].tolist() == [True, True, False, True]


def test_byte_order_mark_is_one_line(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(p + "\n" for p in bert_layout(["a"])).encode())
    with pytest.raises(TokenizerError, match="byte-order mark") as info:
        WordPieceTokenizer(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "pieces, kind, warning",
    [
        (["the", "cat"], "BertWordPieceCase", "no upper-case piece.*use BertWordPieceLowerCase"),
        (["The", "the", "cat"], "BertWordPieceLowerCase", "1 upper-case pieces.*BertWordPieceCase"),
        (["the", "cat"], "BertWordPieceLowerCase", None),
        (["The", "the", "cat"], "BertWordPieceCase", None),
    ],
)
def test_casing_that_does_not_fit_the_vocabulary_warns(tmp_path, caplog, pieces, kind, warning):
    from types import SimpleNamespace

    from megatron_taco.data.tokenizer import load_config_tokenizer

    path = tmp_path / "vocab.txt"
    path.write_text("".join(p + "\n" for p in bert_layout(pieces)), "utf-8")
    config = SimpleNamespace(tokenizer_type=kind, vocab_file=str(path), tokenizer_model=None)
    with caplog.at_level("WARNING", logger="megatron_taco.data.tokenizer"):
        tok = load_config_tokenizer(config)
    if warning is None:
        assert not caplog.records
        return
    (record,) = caplog.records
    assert re.search(f"^--vocab-file: {re.escape(str(path))} .*{warning}", record.getMessage())
    if kind == "BertWordPieceCase":  # what the warning is about
        assert tok.encode("The cat") == [tok.unk_id, tok.piece_to_id("cat")]


def test_sentencepiece_model_given_as_vocab_file(tokenizer_model, botchan_dataset):
    from megatron_taco.data.config import DataConfig

    config = DataConfig(
        data_path=(botchan_dataset["prefix"],),
        tokenizer_type="BertWordPieceLowerCase",
        vocab_file=tokenizer_model,
    )
    with pytest.raises(ConfigError, match=r"^--vocab-file: .*not a WordPiece vocabulary"):
        config.validate_files()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tokenizer_type": "BertWordPieceLowerCase"}, "--vocab-file: required with"),
        ({"vocab_file": "v.txt"}, "--vocab-file: .* add --tokenizer-type BertWordPieceLowerCase"),
        ({}, "--tokenizer-model: required with --tokenizer-type SentencePiece"),
        (
            {"tokenizer_type": "BertWordPieceCase", "vocab_file": "v", "tokenizer_model": "m"},
            "--tokenizer-model: not read by --tokenizer-type BertWordPieceCase",
        ),
        (
            {"tokenizer_model": "m", "vocab_file": "v"},
            "--vocab-file: not read by --tokenizer-type SentencePiece",
        ),
        ({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "v"}, "--tokenizer-type: must be"),
    ],
)
def test_tokenizer_flags_are_checked(kwargs, message):
    from megatron_taco.data.config import DataConfig

    with pytest.raises(ConfigError, match="^" + message):
        DataConfig(data_path=("x",), **kwargs)


def test_megatron_sentencepiece_spelling_is_accepted(tokenizer_model):
    from megatron_taco.data.config import DataConfig

    config = DataConfig(
        data_path=("x",), tokenizer_type="SentencePieceTokenizer", tokenizer_model=tokenizer_model
    )
    assert config.tokenizer_type == "SentencePiece"
    assert config.load_tokenizer().vocab_size == 800

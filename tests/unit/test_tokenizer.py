import pickle
import re

import numpy as np
import pytest
import sentencepiece as spm

from megatron_taco.data.tokenizer import SPECIAL_PIECES, Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def lines(botchan_path):
    text = botchan_path.read_text(encoding="utf-8")
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def test_special_ids_are_fixed(tokenizer):
    assert (
        tokenizer.pad_id,
        tokenizer.unk_id,
        tokenizer.cls_id,
        tokenizer.sep_id,
        tokenizer.mask_id,
    ) == (
        0,
        1,
        2,
        3,
        4,
    )
    assert tokenizer.eod_id == tokenizer.sep_id
    assert tokenizer.vocab_size == 800
    assert [tokenizer.id_to_piece(i) for i in range(5)] == list(SPECIAL_PIECES)
    # ordinary text never produces [PAD]/[CLS]/[SEP]/[MASK]
    ids = tokenizer.encode("The ablest can do no more, and to want more than this is impossible.")
    assert not set(ids) & {0, 2, 3, 4}


def test_round_trip_on_real_sentences(tokenizer, lines):
    sample = lines[:200]
    with_unknown = 0
    for line in sample:
        ids = tokenizer.encode(line)
        assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
        if tokenizer.unk_id in ids:
            with_unknown += 1
            continue
        assert tokenizer.decode(ids) == line
    assert with_unknown == 0  # characters too rare for the 800 pieces ("9") are bytes
    # numpy arrays decode too (datasets hand out uint16 views)
    ids = np.asarray(tokenizer.encode(sample[20]), dtype=np.uint16)
    assert tokenizer.decode(ids) == sample[20]


def test_unseen_characters_fall_back_to_bytes(tokenizer):
    # The fixture model is trained with the default --byte-fallback: characters it never saw
    # are spelled as UTF-8 bytes and decode back exactly.
    text = "tea \u6f22\u5b57 caf\u00e9 \U0001f600"
    ids = tokenizer.encode(text)
    assert tokenizer.unk_id not in ids
    pieces = [tokenizer.id_to_piece(i) for i in ids]
    assert "<0xE6>" in pieces and "<0xF0>" in pieces  # the first bytes of 漢 and 😀
    assert tokenizer.decode(ids) == text


def test_unknown_characters_map_to_unk_without_byte_fallback(tmp_path, botchan_path):
    from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer

    model = train_tokenizer(
        TrainTokenizerConfig(
            input=(str(botchan_path),),
            model_prefix=str(tmp_path / "nobytes"),
            vocab_size=300,
            byte_fallback=False,
            num_threads=1,
        )
    )
    tok = Tokenizer(model)
    assert not any(tok.is_byte(i) for i in range(tok.vocab_size))
    assert tok.unk_id in tok.encode("tea \u6f22\u5b57")


def test_byte_pieces_in_word_start_mask(tokenizer):
    assert sum(tokenizer.is_byte(i) for i in range(tokenizer.vocab_size)) == 256
    mask = tokenizer.word_start_mask()
    starts = {tokenizer.id_to_piece(i): mask[i] for i in range(tokenizer.vocab_size)}
    # "!" and "," spelled as bytes are punctuation words; letters, digits and the bytes of
    # a multi-byte character continue a word.
    assert starts["<0x21>"] and starts["<0x2C>"]
    assert not any(starts[p] for p in ("<0x41>", "<0x39>", "<0xE6>", "<0x80>"))


def test_encode_batch_matches_encode(tokenizer, lines):
    batch = lines[:64]
    expected = [tokenizer.encode(t) for t in batch]
    assert tokenizer.encode_batch(batch) == expected
    assert tokenizer.encode_batch(batch, num_threads=2) == expected
    assert tokenizer.encode_batch([]) == []


def test_word_start_mask(tokenizer, lines):
    mask = tokenizer.word_start_mask()
    assert mask.dtype == bool and mask.shape == (tokenizer.vocab_size,)
    assert mask[:5].all()  # specials and [UNK] always start a word
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_piece(i)
        byte = tokenizer.is_byte(i)  # judged by the byte it spells: see the byte test
        if i >= 5 and not byte and piece[0] != "\u2581" and any(c.isalnum() for c in piece):
            assert not mask[i], piece
    # A word made of letters is one "▁"-prefixed piece and continuation pieces.
    words = sorted({w for line in lines[:300] for w in line.split() if w.isalpha()})
    assert len(words) > 300
    for word in words:
        ids = tokenizer.encode(word)
        if tokenizer.unk_id in ids:  # [UNK] starts a word by contract, even inside one
            continue
        assert mask[ids[0]], word
        assert not mask[ids[1:]].any(), (word, [tokenizer.id_to_piece(i) for i in ids])
    # On running text: a word never spans a space, every space starts a word, and punctuation
    # is never glued to the end of the word before it ("honest." is "honest" + ".").
    for line in lines[:300]:
        ids = tokenizer.encode(line)
        if tokenizer.unk_id in ids:
            continue
        words = []
        for i in ids:
            piece = tokenizer.id_to_piece(i)
            if tokenizer.is_byte(i):
                piece = chr(int(piece[3:5], 16))  # ASCII here (Botchan's rare digits)
            if mask[i]:
                words.append(piece)
            else:
                words[-1] += piece
        assert all("\u2581" not in w[1:] for w in words), words
        assert sum(w.startswith("\u2581") for w in words) == len(line.split())
        glued = [w for w in words if re.search(r"[A-Za-z0-9][^A-Za-z0-9]", w)]
        assert not glued, line


def test_is_special_mask(tokenizer):
    special = tokenizer.is_special_mask()
    assert special.dtype == bool and special.shape == (tokenizer.vocab_size,)
    assert np.flatnonzero(special).tolist() == [0, 2, 3, 4]


def test_pickle(tokenizer):
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.encode("noted how far it has succeeded") == tokenizer.encode(
        "noted how far it has succeeded"
    )
    assert len(pickle.dumps(tokenizer)) < 500  # the path, not the model


def test_missing_model(tmp_path):
    path = tmp_path / "absent.model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        Tokenizer(path)


def test_corrupt_model(tmp_path, tokenizer_model):
    path = tmp_path / "corrupt.model"
    path.write_bytes(b"this is not a protobuf \x00\xff" * 10)
    with pytest.raises(TokenizerError, match=re.escape(str(path))):
        Tokenizer(path)
    truncated = tmp_path / "truncated.model"
    with open(tokenizer_model, "rb") as f:
        truncated.write_bytes(f.read()[:1000])
    with pytest.raises(TokenizerError, match=re.escape(str(truncated))):
        Tokenizer(truncated)


def test_model_without_fixed_specials(tmp_path, lines):
    # sentencepiece's defaults: <unk>=0, <s>=1, </s>=2 and no [CLS]/[SEP]/[MASK]
    prefix = str(tmp_path / "default")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=prefix,
        vocab_size=200,
        minloglevel=2,
        num_threads=1,
    )
    with pytest.raises(TokenizerError, match=r"default\.model: ids 0\.\.4 must be") as info:
        Tokenizer(prefix + ".model")
    assert "<unk>" in str(info.value)

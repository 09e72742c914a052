"""SentencePiece tokenizer with BERT's special tokens at fixed ids.

Every model this package uses is trained by ``taco-train-tokenizer``, which pins
[PAD]=0 (sentencepiece pad), [UNK]=1 (sentencepiece unk), and [CLS], [SEP], [MASK] at 2, 3, 4
(user-defined symbols). Fixed ids let datasets, masking and the model agree on the specials
without passing a tokenizer around; a model that breaks the layout is rejected on load.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterable

import numpy as np
import sentencepiece as spm

SPECIAL_PIECES = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)
WORD_BOUNDARY = "\u2581"  # "▁": sentencepiece's marker for a preceding space


class TokenizerError(ValueError):
    """The tokenizer model is unusable; the message names the file."""


def is_punctuation_char(ch: str) -> bool:
    # BERT's BasicTokenizer definition: all non-alphanumeric ASCII symbols ("$", "^", "`" are
    # not Unicode "P" characters) plus every Unicode punctuation category.
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


class Tokenizer:
    pad_id = PAD_ID
    unk_id = UNK_ID
    cls_id = CLS_ID
    sep_id = SEP_ID
    mask_id = MASK_ID
    # BERT has no end-of-document token; Megatron's --append-eod writes [SEP] instead.
    eod_id = SEP_ID

    def __init__(self, model_path: str | os.PathLike) -> None:
        self.model_path = os.fspath(model_path)
        self._load()

    def _load(self) -> None:
        path = self.model_path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: sentencepiece model not found")
        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(model_file=path)
        except (RuntimeError, OSError) as e:
            raise TokenizerError(f"{path}: not a valid sentencepiece model ({e})") from None
        n = sp.get_piece_size()
        if n <= len(SPECIAL_PIECES):
            raise TokenizerError(
                f"{path}: vocabulary of {n} pieces has no room beyond the specials"
            )
        found = tuple(sp.id_to_piece(i) for i in range(len(SPECIAL_PIECES)))
        if found != SPECIAL_PIECES or sp.pad_id() != PAD_ID or sp.unk_id() != UNK_ID:
            raise TokenizerError(
                f"{path}: ids 0..4 must be {list(SPECIAL_PIECES)} with pad_id=0 and unk_id=1, "
                f"found {list(found)} with pad_id={sp.pad_id()} unk_id={sp.unk_id()}; train "
                "the model with taco-train-tokenizer"
            )
        if sp.bos_id() >= 0 or sp.eos_id() >= 0:
            # encode() would otherwise never emit them but they would still occupy ids, and
            # anyone enabling add_bos/add_eos would silently shift every sequence.
            raise TokenizerError(
                f"{path}: <s>/</s> must be disabled (bos_id={sp.bos_id()}, eos_id={sp.eos_id()})"
            )
        self._sp = sp
        self.vocab_size: int = n
        self._word_start: np.ndarray | None = None
        self._special: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.model_path = state["model_path"]
        self._load()

    def __repr__(self) -> str:
        return f"Tokenizer({self.model_path!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        # sentencepiece releases the GIL and shards the batch over its own threads
        # (num_threads=-1: as many as hardware threads).
        if not texts:
            return []
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def encode_with_offsets(
        self, texts: list[str], num_threads: int = -1
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per text: (ids int32 [n], offsets int64 [n, 2]) with each piece's [begin, end) in
        characters of the *original* text.

        The normaliser (NFKC, collapsed whitespace) changes the text the pieces spell, so
        character positions (SQuAD's answer_start) can only be mapped through sentencepiece's
        own alignment. A piece's span includes the whitespace its "▁" stands for; the dummy
        prefix piece of a text that starts without a space is empty (begin == end).
        """
        if not texts:
            return []
        try:
            # sentencepiece >= 0.2.1: offsets already converted to characters
            out = self._sp.encode(list(texts), out_type="offset_mapping", num_threads=num_threads)
            return [
                (
                    np.asarray(o["ids"], dtype=np.int32),
                    np.asarray(o["offsets"], dtype=np.int64).reshape(-1, 2),
                )
                for o in out
            ]
        except ValueError:
            pass
        kind = "proto" if hasattr(self._sp, "EncodeAsProto") else "immutable_proto"
        protos = self._sp.encode(list(texts), out_type=kind, num_threads=num_threads)
        return [
            (np.asarray([p.id for p in sp.pieces], dtype=np.int32), _char_offsets(text, sp.pieces))
            for text, sp in zip(texts, protos)
        ]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return self._sp.piece_to_id(piece)

    def is_byte(self, i: int) -> bool:
        """A byte piece <0x00>..<0xFF> (models trained with --byte-fallback)."""
        return self._sp.is_byte(int(i))

    def word_start_mask(self) -> np.ndarray:
        """bool [vocab_size]: True where a piece begins a word.

        A word is a "▁"-prefixed piece plus the continuation pieces after it, which is what
        SpanBERT's whole-word spans need. Two more kinds of piece start a word:

        * specials, [UNK] and other control pieces: they are never the tail of a real word;
        * pieces made only of punctuation (",", ".\\"", "--"): SpanBERT's words come from
          BERT's basic tokenizer, which splits punctuation into words of its own. Without
          this, "hello," is one word and masking "hello" would leave the comma as an
          unmasked fragment of the same word (or mask the comma with it).

        Byte pieces (--byte-fallback, "<0x21>") are judged by the byte they spell: an ASCII
        punctuation byte starts a word, any other byte (a letter or digit, or part of a
        character outside the vocabulary) continues the word it is in.
        """
        if self._word_start is None:
            sp = self._sp
            mask = np.zeros(self.vocab_size, dtype=bool)
            for i in range(self.vocab_size):
                piece = sp.id_to_piece(i)
                if self.is_byte(i):
                    byte = int(piece[3:5], 16)  # "<0xAB>"
                    mask[i] = byte < 0x80 and is_punctuation_char(chr(byte))
                    continue
                mask[i] = (
                    piece.startswith(WORD_BOUNDARY)
                    or i < len(SPECIAL_PIECES)
                    or sp.is_control(i)
                    or sp.is_unknown(i)
                    or (piece != "" and all(is_punctuation_char(c) for c in piece))
                )
            mask.setflags(write=False)
            self._word_start = mask
        return self._word_start

    def is_special_mask(self) -> np.ndarray:
        """bool [vocab_size]: [PAD], [CLS], [SEP], [MASK] and any other control piece.

        [UNK] is not special: it stands for real text the vocabulary cannot spell, so it is
        an ordinary position for masking and sentence structure.
        """
        if self._special is None:
            mask = np.array([self._sp.is_control(i) for i in range(self.vocab_size)], dtype=bool)
            mask[[PAD_ID, CLS_ID, SEP_ID, MASK_ID]] = True
            mask[UNK_ID] = False
            mask.setflags(write=False)
            self._special = mask
        return self._special


def _char_offsets(text: str, pieces) -> np.ndarray:
    """int64 [n, 2]: pieces' UTF-8 byte [begin, end) (sentencepiece's protos) in characters."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    lead = (data & 0xC0) != 0x80  # bytes that start a character
    chars_before = np.zeros(len(data) + 1, dtype=np.int64)  # per byte boundary
    chars_before[1:] = np.cumsum(lead)
    inside = np.append(~lead, False)  # boundary falls inside a multi-byte character
    b = np.asarray([(p.begin, p.end) for p in pieces], dtype=np.int64).reshape(-1, 2)
    # a begin inside a character rounds down to its start, an end up to its end
    return np.stack([chars_before[b[:, 0]] - inside[b[:, 0]], chars_before[b[:, 1]]], axis=1)

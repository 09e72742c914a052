"""The tokenizers: SentencePiece with BERT's special tokens at fixed ids, and BERT's WordPiece.

Every sentencepiece model this package uses is trained by ``taco-train-tokenizer``, which pins
[PAD]=0 (sentencepiece pad), [UNK]=1 (sentencepiece unk), and [CLS], [SEP], [MASK] at 2, 3, 4
(user-defined symbols); a model that breaks the layout is rejected on load.

A WordPiece vocabulary (BERT's vocab.txt, Megatron-LM's --tokenizer-type BertWordPieceLowerCase
/ BertWordPieceCase with --vocab-file) keeps its specials where the file has them ([UNK]=100,
[CLS]=101 ... in BERT's), so everything downstream reads the ids from the tokenizer object.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import unicodedata
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import sentencepiece as spm

from megatron_taco.arguments import option
from megatron_taco.errors import ConfigError

logger = logging.getLogger(__name__)

SPECIAL_PIECES = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)
WORD_BOUNDARY = "\u2581"  # "▁": sentencepiece's marker for a preceding space
CONTINUATION = "##"  # WordPiece's marker of a piece that continues the previous one

# Megatron-LM's --tokenizer-type spellings (SentencePieceTokenizer is Megatron's own).
SENTENCEPIECE = "SentencePiece"
WORDPIECE_TYPES = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}  # -> lower case
TOKENIZER_TYPES = (SENTENCEPIECE, *WORDPIECE_TYPES)
_TYPE_ALIASES = {"SentencePieceTokenizer": SENTENCEPIECE}


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
    tokenizer_type = SENTENCEPIECE

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


class WordPieceTokenizer:
    """BERT's WordPiece (BertTokenizerFast's pipeline, from the ``tokenizers`` library) over a
    vocab.txt: BERT's normaliser (lower case and accents stripped for
    BertWordPieceLowerCase, as Megatron-LM's), punctuation split, greedy longest-match pieces.
    No [CLS]/[SEP] are added: datasets and tasks place them."""

    def __init__(self, vocab_file: str | os.PathLike, lower_case: bool = True) -> None:
        self.model_path = os.fspath(vocab_file)
        self.lower_case = bool(lower_case)
        self._load()

    @property
    def tokenizer_type(self) -> str:
        return "BertWordPieceLowerCase" if self.lower_case else "BertWordPieceCase"

    def _load(self) -> None:
        from tokenizers.implementations import BertWordPieceTokenizer

        path = self.model_path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: WordPiece vocabulary not found")
        try:
            with open(path, encoding="utf-8", newline="") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise TokenizerError(
                f"{path}: not a WordPiece vocabulary (one UTF-8 piece per line); a "
                "sentencepiece model goes with --tokenizer-type SentencePiece"
            ) from None
        if text.startswith("\ufeff"):  # tokenizers would read "\ufeff[PAD]" as the first piece
            raise TokenizerError(f"{path}: starts with a byte-order mark; save it as UTF-8 without")
        # Lines as tokenizers splits them (on "\n" only, not str.splitlines' "\x85" or
        # "\u2028", which pieces may hold), trailing whitespace removed: ids by line number.
        pieces = [line.rstrip() for line in text.split("\n")]
        if pieces and not pieces[-1] and text.endswith("\n"):
            pieces.pop()
        ids = {p: i for i, p in enumerate(pieces)}
        if len(ids) != len(pieces):
            twice = next(p for i, p in enumerate(pieces) if ids[p] != i)
            raise TokenizerError(f"{path}: piece {twice!r} appears twice")
        missing = [p for p in SPECIAL_PIECES if p not in ids]
        if missing:
            raise TokenizerError(
                f"{path}: the vocabulary lacks {', '.join(missing)} (a WordPiece vocab.txt has "
                f"{', '.join(SPECIAL_PIECES)})"
            )
        if len(pieces) <= len(SPECIAL_PIECES):
            raise TokenizerError(f"{path}: vocabulary of {len(pieces)} pieces has only specials")
        self._tok = BertWordPieceTokenizer(path, lowercase=self.lower_case)
        theirs = self._tok.get_vocab()
        if len(theirs) != len(pieces) or any(theirs.get(p) != i for i, p in enumerate(pieces)):
            line = next((i for i, p in enumerate(pieces) if theirs.get(p) != i), len(pieces))
            raise TokenizerError(
                f"{path}: line {line + 1} does not read as the tokenizers library reads it "
                "(unusual whitespace in a piece?)"
            )
        self._pieces = pieces
        self.vocab_size: int = len(pieces)
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            ids[p] for p in SPECIAL_PIECES
        )
        self.eod_id = self.sep_id  # as Megatron's BertWordPieceTokenizer
        self._word_start: np.ndarray | None = None
        self._special: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path, "lower_case": self.lower_case}

    def __setstate__(self, state: dict) -> None:
        self.model_path, self.lower_case = state["model_path"], state["lower_case"]
        self._load()

    def __repr__(self) -> str:
        return (
            f"WordPieceTokenizer({self.model_path!r}, lower_case={self.lower_case}, "
            f"vocab_size={self.vocab_size})"
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        # tokenizers parallelises a batch itself (RAYON_NUM_THREADS, TOKENIZERS_PARALLELISM)
        if not texts:
            return []
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_offsets(
        self, texts: list[str], num_threads: int = -1
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """As Tokenizer.encode_with_offsets: tokenizers' offsets are already in characters of
        the original text (a piece's span holds no whitespace)."""
        if not texts:
            return []
        return [
            (
                np.asarray(e.ids, dtype=np.int32),
                np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2),
            )
            for e in self._tok.encode_batch(list(texts), add_special_tokens=False)
        ]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        return self._pieces[int(i)]

    def piece_to_id(self, piece: str) -> int:
        i = self._tok.token_to_id(piece)
        return self.unk_id if i is None else i

    def is_byte(self, i: int) -> bool:
        return False

    def case_mismatch(self) -> str | None:
        """Why the type's casing does not fit the vocabulary, if it does not (Megatron-LM
        takes either silently): a cased type over a vocabulary without upper case reads every
        capitalised word as [UNK]; a lower-casing one never reaches the upper-case pieces."""
        upper = sum(  # bracketed pieces ([CLS], [unused0]) are not text
            any(c.isupper() for c in p)
            for p in self._pieces
            if not (p.startswith("[") and p.endswith("]"))
        )
        if not self.lower_case and upper == 0:
            return (
                f"{self.model_path} has no upper-case piece (an uncased vocabulary): "
                "BertWordPieceCase reads capitalised words as [UNK]; use BertWordPieceLowerCase"
            )
        if self.lower_case and upper > 0:
            return (
                f"{self.model_path} has {upper} upper-case pieces (a cased vocabulary) that "
                "BertWordPieceLowerCase never produces; use BertWordPieceCase"
            )
        return None

    def word_start_mask(self) -> np.ndarray:
        """bool [vocab_size]: True except on "##" continuation pieces. BERT's pre-tokenizer
        already makes every punctuation character a word of its own, so a piece without "##"
        always starts one (the specials included)."""
        if self._word_start is None:
            continues = [
                p.startswith(CONTINUATION) and len(p) > len(CONTINUATION) for p in self._pieces
            ]
            mask = ~np.array(continues, dtype=bool)
            mask[[self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id]] = True
            mask.setflags(write=False)
            self._word_start = mask
        return self._word_start

    def is_special_mask(self) -> np.ndarray:
        """bool [vocab_size]: [PAD], [CLS], [SEP], [MASK] and BERT's reserved "[unusedN]"-style
        bracketed pieces, which text never encodes to ([UNK] is ordinary text, as in
        Tokenizer)."""
        if self._special is None:
            mask = np.array(
                [len(p) > 2 and p[0] == "[" and p[-1] == "]" for p in self._pieces], dtype=bool
            )
            mask[[self.pad_id, self.cls_id, self.sep_id, self.mask_id]] = True
            mask[self.unk_id] = False
            mask.setflags(write=False)
            self._special = mask
        return self._special


AnyTokenizer = Tokenizer | WordPieceTokenizer


def canonical_tokenizer_type(kind: str) -> str:
    return _TYPE_ALIASES.get(kind, kind)


def load_tokenizer(path: str | os.PathLike, tokenizer_type: str = SENTENCEPIECE) -> AnyTokenizer:
    """The tokenizer of --tokenizer-type over its file (FileNotFoundError, TokenizerError)."""
    tokenizer_type = canonical_tokenizer_type(tokenizer_type)
    if tokenizer_type == SENTENCEPIECE:
        return Tokenizer(path)
    if tokenizer_type in WORDPIECE_TYPES:
        return WordPieceTokenizer(path, lower_case=WORDPIECE_TYPES[tokenizer_type])
    raise TokenizerError(f"unknown tokenizer type {tokenizer_type!r} (one of {TOKENIZER_TYPES})")


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_record(tokenizer: AnyTokenizer) -> dict[str, Any]:
    """What binds data and checkpoints to a tokenizer: its kind, its file's content hash (a
    renamed or moved copy is the same tokenizer) and its vocabulary size."""
    return {
        "type": tokenizer.tokenizer_type,
        "sha256": file_sha256(tokenizer.model_path),
        "vocab_size": int(tokenizer.vocab_size),
    }


# -- checkpoints carry their tokenizer ----------------------------------------------------

TOKENIZER_DIR = "tokenizer"  # in --save


def saved_tokenizer_record(tokenizer: AnyTokenizer) -> dict[str, Any]:
    """metadata.json's "tokenizer": tokenizer_record() and "file", the copy's path relative
    to the --save directory (one folder per content, so a save directory reused with another
    tokenizer never changes the copy its older checkpoints name)."""
    record = tokenizer_record(tokenizer)
    name = os.path.basename(tokenizer.model_path)
    record["file"] = f"{TOKENIZER_DIR}/{record['sha256'][:16]}/{name}"
    return record


def save_tokenizer_copy(save_dir: str, tokenizer: AnyTokenizer, record: dict[str, Any]) -> str:
    """Copy the tokenizer's file to save_dir/record["file"] (atomically, unless already
    there); returns the copy's path."""
    import shutil

    from megatron_taco import io

    dest = os.path.join(save_dir, *record["file"].split("/"))
    if os.path.isfile(dest) and file_sha256(dest) == record["sha256"]:
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with io.atomic_path(dest) as tmp:
        shutil.copyfile(tokenizer.model_path, tmp)
    return dest


# -- datasets bound to their tokenizer ----------------------------------------------------

SUMMARY_SUFFIX = "_summary.json"  # taco-preprocess-data's OUTPUT_PREFIX_summary.json


def dataset_summary(prefix: str) -> tuple[str, dict] | None:
    """(path, contents) of the preprocessing summary that lists dataset ``prefix``
    (OUTPUT_PREFIX_{key}_{level} -> OUTPUT_PREFIX_summary.json, keys may hold "_"); None for
    a dataset made otherwise (merged, Megatron-LM's)."""
    folder, base = os.path.split(os.path.abspath(prefix))
    cut = len(base)
    while (cut := base.rfind("_", 0, cut)) > 0:
        path = os.path.join(folder, base[:cut] + SUMMARY_SUFFIX)
        try:
            with open(path, encoding="utf-8") as f:
                summary = json.load(f)
        except (OSError, ValueError):
            continue
        datasets = summary.get("datasets") if isinstance(summary, dict) else None
        if isinstance(datasets, dict) and any(
            isinstance(d, dict) and os.path.basename(str(d.get("prefix", ""))) == base
            for d in datasets.values()
        ):
            return path, summary
    return None


def check_dataset_tokenizer(
    prefixes: Iterable[str], tokenizer: AnyTokenizer | Callable[[], AnyTokenizer]
) -> None:
    """ConfigError (one line, naming the flag) when a dataset's summary says it was made with
    another tokenizer: a different file content or kind, or (summaries written before the
    hash was recorded) a different vocabulary size. Datasets without a summary pass, and a
    callable ``tokenizer`` is loaded only when a summary is there to check."""
    mine: dict[str, Any] | None = None
    for prefix in prefixes:
        found = dataset_summary(prefix)
        if found is None:
            continue
        if callable(tokenizer):
            tokenizer = tokenizer()
        flag = "--tokenizer-model" if tokenizer.tokenizer_type == SENTENCEPIECE else "--vocab-file"
        path, summary = found
        made = summary.get("tokenizer")
        if isinstance(made, dict) and isinstance(made.get("sha256"), str):
            mine = mine or tokenizer_record(tokenizer)
            if (made["sha256"], made.get("type")) == (mine["sha256"], mine["type"]):
                continue
            raise ConfigError(
                f"{flag}: {tokenizer.model_path} ({_describe(mine)}) is not the tokenizer "
                f"{prefix} was made with ({_describe(made)}, says {path})"
            )
        size = summary.get("vocab_size")
        if isinstance(size, int) and size != tokenizer.vocab_size:
            raise ConfigError(
                f"{flag}: {tokenizer.model_path} has {tokenizer.vocab_size} pieces, {prefix} "
                f"was made with a tokenizer of {size} (says {path})"
            )


def check_checkpoint_tokenizer(
    config: Any, record: Any, checkpoint: str, recorded_file: str | None
) -> None:
    """ConfigError (one line naming both files) when the tokenizer a config's flags name is
    not the one ``checkpoint`` was trained with (``record``: its metadata.json "tokenizer";
    ``recorded_file``: where that tokenizer is): another content or kind. The same content
    at another path is the same tokenizer; a checkpoint written before the record is not
    checked, and a missing file is load_config_tokenizer's to report."""
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        return
    path, kind = tokenizer_file(config), canonical_tokenizer_type(config.tokenizer_type)
    if not path or not os.path.isfile(path):
        return
    sha = file_sha256(path)
    if (sha, kind) == (record["sha256"], record.get("type")):
        return
    raise ConfigError(
        f"{tokenizer_flag(config)}: {path} ({kind}, sha256 {sha[:12]}) is not the tokenizer "
        f"{checkpoint} was trained with ({recorded_file or 'its file is gone'}: "
        f"{_describe(record)}); give that one, or --load another checkpoint"
    )


def _describe(record: dict) -> str:
    return (
        f"{record.get('type', '?')}, {record.get('vocab_size', '?')} pieces, "
        f"sha256 {str(record.get('sha256', '?'))[:12]}"
    )


# -- the tokenizer flags, shared by every config that names a tokenizer --------------------


def tokenizer_type_option(default: str | None = SENTENCEPIECE, help: str = "") -> Any:
    return option(
        default,
        help
        or "Tokenizer kind (Megatron-LM's names): SentencePiece reads --tokenizer-model (from "
        "taco-train-tokenizer); BertWordPieceLowerCase / BertWordPieceCase read BERT's "
        "--vocab-file (lower-cased and accents stripped, or as written)",
        flag="--tokenizer-type",
        choices=(*TOKENIZER_TYPES, *_TYPE_ALIASES),
    )


def vocab_file_option(help: str = "") -> Any:
    return option(
        None,
        help or "WordPiece vocabulary (vocab.txt, one piece per line) for BertWordPiece types",
        flag="--vocab-file",
    )


def check_tokenizer_options(config: Any, required: bool = True) -> None:
    """Validate a config's (tokenizer_type, tokenizer_model, vocab_file) fields: the file its
    type reads is given (when ``required``), the other one is not. Normalises the type."""
    kind = config.tokenizer_type
    if kind is None and not required:
        return
    if kind not in TOKENIZER_TYPES and kind not in _TYPE_ALIASES:
        raise ConfigError(f"--tokenizer-type: must be one of {TOKENIZER_TYPES}, got {kind!r}")
    kind = canonical_tokenizer_type(kind)
    object.__setattr__(config, "tokenizer_type", kind)
    wordpiece = kind in WORDPIECE_TYPES
    needed, other = (
        ("vocab_file", "tokenizer_model") if wordpiece else ("tokenizer_model", "vocab_file")
    )
    flag, other_flag = (f"--{n.replace('_', '-')}" for n in (needed, other))
    if getattr(config, other):
        raise ConfigError(
            f"{other_flag}: not read by --tokenizer-type {kind}, which reads {flag}"
            + ("" if wordpiece else "; add --tokenizer-type BertWordPieceLowerCase for a vocab.txt")
        )
    value = getattr(config, needed)
    if value is not None:
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise ConfigError(f"{flag}: expected a file path, got {value!r}")
        object.__setattr__(config, needed, os.fspath(value))
    elif required:
        raise ConfigError(f"{flag}: required with --tokenizer-type {kind}")


def tokenizer_file(config: Any) -> str | None:
    """The file a config's tokenizer flags name (--vocab-file or --tokenizer-model)."""
    if config.tokenizer_type in WORDPIECE_TYPES:
        return config.vocab_file
    return config.tokenizer_model


def tokenizer_flag(config: Any) -> str:
    return "--vocab-file" if config.tokenizer_type in WORDPIECE_TYPES else "--tokenizer-model"


def load_config_tokenizer(config: Any) -> AnyTokenizer:
    """The tokenizer a config's flags name; a missing or broken file is the flag's one line."""
    path, flag = tokenizer_file(config), tokenizer_flag(config)
    if not path or not os.path.isfile(path):
        raise ConfigError(f"{flag}: {path} does not exist")
    try:
        tokenizer = load_tokenizer(path, config.tokenizer_type)
    except (TokenizerError, OSError) as e:
        raise ConfigError(f"{flag}: {e}") from None
    if isinstance(tokenizer, WordPieceTokenizer) and (why := tokenizer.case_mismatch()):
        logger.warning("%s: %s", flag, why)
    return tokenizer


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

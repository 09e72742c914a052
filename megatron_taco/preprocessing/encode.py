"""One batch of records -> token ids, inside a worker: parse (stage 2 of corpora.py),
split into sentences, encode, laid out per json key as flat arrays ready for the shard."""

from __future__ import annotations

from collections import Counter
from dataclasses import KW_ONLY, dataclass
from itertools import chain
from typing import Any

import numpy as np

from megatron_taco.preprocessing.corpora import parse_raw
from megatron_taco.preprocessing.jsonl import RawLines
from megatron_taco.preprocessing.records import Document, RawRecord, Skipped

# A record whose parsing raised instead of returning Skipped (a bug or a pathological page
# deep in a 20 GB dump): counted and reported with its source, like any other skip, so one
# bad page cannot kill a day-long run.
PARSE_ERROR = "parse_error"
_EXAMPLES_PER_REASON = 3


class Skips:
    """Skipped records counted by reason, with the sources of the first few of each."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, reason: str, source: str) -> None:
        self.counts[reason] += 1
        self._example(reason, source)

    def _example(self, reason: str, source: str) -> None:
        lst = self.examples.setdefault(reason, [])
        if len(lst) < _EXAMPLES_PER_REASON:
            lst.append(source)

    def update(self, other: Skips) -> None:
        self.counts.update(other.counts)
        for reason, sources in other.examples.items():
            for source in sources:
                self._example(reason, source)


@dataclass
class KeyBatch:
    tokens: np.ndarray  # flat, int64, eod included
    seq_lengths: np.ndarray  # int64 [sequences]
    doc_seq_counts: np.ndarray  # int64 [documents]


@dataclass
class EncodedBatch:
    per_key: dict[str, KeyBatch]
    documents: int
    unk_tokens: int  # [UNK]s over all keys, for the per-corpus rate in the summary
    tokens: int
    skips: Skips


@dataclass
class BatchEncoder:
    """parse -> split -> encode for one batch of RawRecords (runs inside a worker)."""

    tokenizer: Any
    json_keys: tuple[str, ...]
    _: KW_ONLY
    splitter: Any = None  # a text.make_sentence_splitter() splitter
    append_eod: bool = False
    min_chars: int = 0
    encode_threads: int = 1

    def __post_init__(self) -> None:
        self.json_keys = tuple(self.json_keys)

    def encode(self, records: list[RawRecord | Skipped] | RawLines) -> EncodedBatch:
        skips = Skips()
        docs = self._parse(records, skips)
        per_key, flat = self._encode(docs)
        # A record none of whose fields produced a token is skipped as empty; one where only
        # some did keeps an empty document in the others, so document i of every key's
        # dataset comes from the same record.
        has_tokens = np.zeros(len(docs), dtype=bool)
        for kb in per_key.values():
            has_tokens |= kb.doc_seq_counts > 0
        for i in np.flatnonzero(~has_tokens):
            skips.add("empty", docs[int(i)].source)
        for kb in per_key.values():
            kb.doc_seq_counts = kb.doc_seq_counts[has_tokens]
            if self.append_eod:
                self._append_eod(kb)
        unk = int(np.count_nonzero(flat == self.tokenizer.unk_id))
        return EncodedBatch(per_key, int(has_tokens.sum()), unk, int(flat.shape[0]), skips)

    def _parse(self, records: list[RawRecord | Skipped] | RawLines, skips: Skips) -> list[Document]:
        if isinstance(records, RawLines):
            records = records.records()
        docs = []
        for raw in records:
            if isinstance(raw, Skipped):  # framing skips of RawLines (blank, not UTF-8)
                skips.add(raw.reason, raw.source)
                continue
            try:
                res = parse_raw(raw, self.json_keys, min_chars=self.min_chars)
            except Exception as e:
                skips.add(PARSE_ERROR, f"{raw.source}: {type(e).__name__}: {e}")
                continue
            if isinstance(res, Skipped):
                skips.add(res.reason, res.source)
            else:
                docs.append(res)
        return docs

    def _encode(self, docs: list[Document]) -> tuple[dict[str, KeyBatch], np.ndarray]:
        """(per key: the documents' non-empty sentences as ids, every id of the batch)."""
        # Sentences of all documents of all keys in ONE encode call: sentencepiece's
        # per-call thread start-up makes per-document calls ~5x slower. Key-major order so
        # each key's sentences are one contiguous range.
        texts: list[str] = []
        counts: dict[str, np.ndarray] = {}
        for key in self.json_keys:
            if self.splitter is not None:
                # One call for the whole batch: blingfire splits many lines per C call.
                per_doc = self.splitter.split_many([d.text[key] for d in docs])
            else:
                per_doc = [[d.text[key]] for d in docs]
            for sents in per_doc:
                texts.extend(sents)
            counts[key] = np.fromiter(map(len, per_doc), dtype=np.int64, count=len(per_doc))
        ids = self.tokenizer.encode_batch(texts, num_threads=self.encode_threads) if texts else []
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
        bounds = np.concatenate(([0], np.cumsum(lengths)))

        per_key: dict[str, KeyBatch] = {}
        sent_start = 0
        for key in self.json_keys:
            n = int(counts[key].sum())
            lens = lengths[sent_start : sent_start + n]
            toks = flat[bounds[sent_start] : bounds[sent_start + n]]
            doc_of_sent = np.repeat(np.arange(len(docs)), counts[key])
            keep = lens > 0  # empty sentences are dropped; they carry no tokens
            per_key[key] = KeyBatch(
                toks, lens[keep], np.bincount(doc_of_sent[keep], minlength=len(docs))
            )
            sent_start += n
        return per_key, flat

    def _append_eod(self, kb: KeyBatch) -> None:
        nonempty = kb.doc_seq_counts > 0
        if not nonempty.any():
            return
        last_seq = (np.cumsum(kb.doc_seq_counts) - 1)[nonempty]
        ends = np.cumsum(kb.seq_lengths)[last_seq]
        kb.tokens = np.insert(kb.tokens, ends, self.tokenizer.eod_id)
        kb.seq_lengths = kb.seq_lengths.copy()
        kb.seq_lengths[last_seq] += 1

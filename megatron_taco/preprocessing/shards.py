"""The workers' shards and their merge. Every worker writes its own shard, so there is no
single-writer bottleneck; the reader numbers the batches and the merge concatenates them in
that order (byte ranges of the shard files and slices of their index arrays, one Python step
per batch, never per sequence), so the output is byte-identical whatever ``--workers`` and
``--chunk-size`` are."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from megatron_taco.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    unigram_path,
    write_index_header,
)
from megatron_taco.preprocessing.config import PreprocessError
from megatron_taco.preprocessing.encode import EncodedBatch, Skips


def _shard_prefix(shard_dir: str, rank: int, key: str) -> str:
    return os.path.join(shard_dir, f"shard{rank:03d}_{key}")


def _doc_counts_path(shard_prefix: str) -> str:
    return shard_prefix + ".docs"


class ShardWriter:
    """One worker's output, per key: a shard dataset in which each BATCH is one document
    (one add_document call per batch instead of one per real document keeps the builder
    off the profile), plus a raw int64 file with the number of sequences of every real
    document, in order. The table batch number -> documents in it comes back to the main
    process, which rebuilds the real document boundaries while merging."""

    def __init__(
        self, shard_dir: str, rank: int, json_keys: tuple[str, ...], dtype: str, vocab_size: int
    ) -> None:
        self.dtype = np.dtype(dtype)
        self.prefixes = {k: _shard_prefix(shard_dir, rank, k) for k in json_keys}
        self.builders = {
            k: IndexedDatasetBuilder(data_file_path(p), self.dtype)
            for k, p in self.prefixes.items()
        }
        self.doc_files = {k: open(_doc_counts_path(p), "wb") for k, p in self.prefixes.items()}  # noqa: SIM115
        self.unigram = {k: np.zeros(vocab_size, dtype=np.int64) for k in json_keys}
        self.n_seqs = dict.fromkeys(json_keys, 0)
        self.n_tokens = dict.fromkeys(json_keys, 0)
        self.n_docs = 0
        self.batch_seq: list[int] = []
        self.batch_docs: list[int] = []
        self.skips = Skips()

    def add(self, seq: int, enc: EncodedBatch) -> None:
        self.batch_seq.append(seq)
        self.batch_docs.append(enc.documents)
        for key, kb in enc.per_key.items():
            # ids < vocab_size, which best_dtype is chosen to hold
            self.builders[key].add_document(kb.tokens.astype(self.dtype), kb.seq_lengths)
            self.doc_files[key].write(kb.doc_seq_counts.astype("<i8").tobytes())
            if kb.tokens.size:
                self.unigram[key] += np.bincount(kb.tokens, minlength=self.unigram[key].shape[0])
            self.n_seqs[key] += int(kb.seq_lengths.shape[0])
            self.n_tokens[key] += int(kb.tokens.shape[0])
        self.n_docs += enc.documents
        self.skips.update(enc.skips)

    def finish(self) -> dict:
        for key, builder in self.builders.items():
            builder.finalize(index_file_path(self.prefixes[key]))
            self.doc_files[key].close()
        return {
            "batch_seq": np.asarray(self.batch_seq, dtype=np.int64),
            "batch_docs": np.asarray(self.batch_docs, dtype=np.int64),
            "documents": self.n_docs,
            "sequences": self.n_seqs,
            "tokens": self.n_tokens,
            "unigram": self.unigram,
            "skips": self.skips,
        }


def _copy_range(src_fd: int, dst_fd: int, offset: int, count: int) -> None:
    while count > 0:
        try:
            n = os.copy_file_range(src_fd, dst_fd, count, offset)
        except (AttributeError, OSError):
            n = 0  # no copy_file_range (old kernel, other OS, some filesystems)
        if n == 0:
            data = os.pread(src_fd, min(count, 16 << 20), offset)
            if not data:
                raise PreprocessError(f"shard ended early while copying byte {offset}")
            n = os.write(dst_fd, data)
        offset += n
        count -= n


@dataclass
class _Piece:
    shard: int  # worker rank
    s0: int  # sequences [s0, s1) of that worker's shard
    s1: int
    b0: int  # bytes [b0, b1) of its .bin
    b1: int
    d0: int  # real documents [d0, d1) of its document counts
    d1: int


def merge_shards(
    shard_dir: str, reports: list[dict], prefixes: dict[str, str], out_dir: str, dtype: np.dtype
) -> dict[str, dict]:
    """Per json key, the workers' shards merged in batch order into ``out_dir`` under the
    names of the final ``prefixes``, with unigram counts, checked against the workers'
    ``reports``; returns the summary's datasets."""
    datasets = {}
    for key, final in prefixes.items():
        out_prefix = os.path.join(out_dir, os.path.basename(final))
        shard_prefixes = [_shard_prefix(shard_dir, r, key) for r in range(len(reports))]
        n_seq, n_doc = _merge_key(shard_prefixes, reports, out_prefix, dtype)
        unigram = np.sum([rep["unigram"][key] for rep in reports], axis=0, dtype=np.int64)
        np.save(unigram_path(out_prefix), unigram)
        _verify(out_prefix, key, n_seq, n_doc, reports, unigram)
        datasets[key] = {
            "prefix": final,
            "documents": n_doc,
            "sequences": n_seq,
            "tokens": sum(rep["tokens"][key] for rep in reports),
        }
    return datasets


def _batch_order(
    shard_prefixes: list[str],
    shards: list[IndexedDataset],
    doc_counts: list[np.ndarray],
    reports: list[dict],
    dtype: np.dtype,
) -> list[_Piece]:
    """Where each batch lies in the shards, in batch order."""
    pieces: dict[int, _Piece] = {}
    for rank, rep in enumerate(reports):
        sh = shards[rank]
        first_doc = np.concatenate(([0], np.cumsum(rep["batch_docs"])))
        if sh.num_documents != len(rep["batch_seq"]) or doc_counts[rank].shape[0] != first_doc[-1]:
            raise PreprocessError(
                f"{shard_prefixes[rank]}: shard holds {sh.num_documents} batches and "
                f"{doc_counts[rank].shape[0]} documents, its worker reported "
                f"{len(rep['batch_seq'])} and {int(first_doc[-1])}"
            )
        ends = (
            np.append(sh.pointers, sh.pointers[-1] + sh.sizes[-1] * dtype.itemsize)
            if len(sh)
            else [0]
        )
        di = sh.document_indices
        for i, b in enumerate(rep["batch_seq"].tolist()):
            s0, s1 = int(di[i]), int(di[i + 1])
            pieces[b] = _Piece(
                rank, s0, s1, int(ends[s0]), int(ends[s1]), int(first_doc[i]), int(first_doc[i + 1])
            )
    n_batches = len(pieces)
    if sorted(pieces) != list(range(n_batches)):
        missing = sorted(set(range(max(pieces, default=-1) + 1)) - set(pieces))
        raise PreprocessError(f"batches missing from the shards: {missing[:10]}")
    return [pieces[b] for b in range(n_batches)]


def _merge_key(
    shard_prefixes: list[str], reports: list[dict], out_prefix: str, dtype: np.dtype
) -> tuple[int, int]:
    """Concatenate every shard's batches in batch order into out_prefix.bin/.idx; returns
    (sequences, documents)."""
    shards = [IndexedDataset(p) for p in shard_prefixes]  # validates each shard
    doc_counts = [np.fromfile(_doc_counts_path(p), dtype="<i8") for p in shard_prefixes]
    order = _batch_order(shard_prefixes, shards, doc_counts, reports, dtype)

    fds = [os.open(data_file_path(p), os.O_RDONLY) for p in shard_prefixes]
    try:
        out_fd = os.open(data_file_path(out_prefix), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for pc in order:
                _copy_range(fds[pc.shard], out_fd, pc.b0, pc.b1 - pc.b0)
        finally:
            os.close(out_fd)
    finally:
        for fd in fds:
            os.close(fd)

    n_seq = sum(pc.s1 - pc.s0 for pc in order)
    n_doc = sum(pc.d1 - pc.d0 for pc in order)
    # Streamed column by column, one slice per batch: the index of a 40 GB corpus is never
    # held in memory twice.
    with open(index_file_path(out_prefix), "wb") as f:
        write_index_header(f, dtype, n_seq, n_doc + 1)
        for pc in order:
            f.write(shards[pc.shard].sizes[pc.s0 : pc.s1].astype("<i4").tobytes())
        base = 0
        for pc in order:
            f.write(
                (shards[pc.shard].pointers[pc.s0 : pc.s1] - pc.b0 + base).astype("<i8").tobytes()
            )
            base += pc.b1 - pc.b0
        f.write(np.zeros(1, dtype="<i8").tobytes())
        base = 0
        for pc in order:
            counts = doc_counts[pc.shard][pc.d0 : pc.d1]
            if int(counts.sum()) != pc.s1 - pc.s0:
                raise PreprocessError(
                    f"{shard_prefixes[pc.shard]}: a batch of {pc.s1 - pc.s0} sequences has "
                    f"document counts adding up to {int(counts.sum())}"
                )
            f.write((base + np.cumsum(counts)).astype("<i8").tobytes())
            base += pc.s1 - pc.s0
    return n_seq, n_doc


def _verify(prefix, key, n_seq, n_doc, reports, unigram) -> None:
    expect_seq = sum(rep["sequences"][key] for rep in reports)
    expect_doc = sum(rep["documents"] for rep in reports)
    ds = IndexedDataset(prefix)  # re-validates pointers against the .bin size
    problems = []
    if len(ds) != expect_seq or n_seq != expect_seq:
        problems.append(f"{len(ds)} sequences, workers wrote {expect_seq}")
    if ds.num_documents != expect_doc or n_doc != expect_doc:
        problems.append(f"{ds.num_documents} documents, workers wrote {expect_doc}")
    if int(ds.sizes.sum(dtype=np.int64)) != int(unigram.sum()):
        problems.append(
            f"{int(ds.sizes.sum())} tokens but unigram counts sum to {int(unigram.sum())}"
        )
    if problems:
        raise PreprocessError(
            f"{index_file_path(prefix)}: merged dataset is inconsistent: {'; '.join(problems)}"
        )

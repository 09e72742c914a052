"""Megatron's MMIDIDX indexed dataset, byte-compatible with megatron-core 0.16.1.

Layout of ``{prefix}.idx`` (little endian)::

    b"MMIDIDX\\x00\\x00"             9 bytes magic
    version                        uint64, always 1
    dtype code                     uint8 (see _DTYPE_CODES)
    sequence count S               uint64
    document count D               uint64, = number of documents + 1
    sequence lengths               int32 [S]   (tokens)
    sequence pointers              int64 [S]   (byte offsets into .bin)
    document indices               int64 [D]   (sequence index where each document starts,
                                                 first 0, last S)

``{prefix}.bin`` holds the tokens of all sequences back to back, nothing else.
megatron-core's multimodal variant (an int8 mode per sequence after the document indices)
is not supported: such files are rejected as having trailing bytes.
"""

from __future__ import annotations

import os
import shutil
import struct
from typing import Any

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
HEADER_SIZE = _HEADER.size  # 34

# megatron.core.datasets.indexed_dataset.DType
_DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dt: code for code, dt in _DTYPE_CODES.items()}

# Validation of the pointer column walks it in chunks so opening a billion-sequence index
# never materialises a second full-size int64 array.
_VALIDATE_CHUNK = 1 << 22


class IndexedDatasetError(ValueError):
    """An indexed dataset file is missing, truncated or corrupt; the message names the file."""


def write_index_header(f, dtype, num_sequences: int, num_document_indices: int) -> None:
    """The .idx header; the caller then writes int32 sizes, int64 pointers and the int64
    document indices (``num_document_indices`` = documents + 1, starting with 0). Exposed so
    a writer that streams the columns (the preprocessing merge) shares the format's one
    definition."""
    f.write(
        _HEADER.pack(
            _MAGIC, _VERSION, _dtype_code(np.dtype(dtype)), num_sequences, num_document_indices
        )
    )


def data_file_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".bin"


def index_file_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".idx"


UNIGRAM_SUFFIX = "_unigram.npy"


def unigram_path(prefix: str) -> str:
    """Token counts of the dataset (int64 [vocab_size]), written by the preprocessing and
    summed by the merge; SAS's cold-start distribution."""
    return prefix + UNIGRAM_SUFFIX


def best_dtype(vocab_size: int) -> np.dtype:
    # Same threshold as megatron-core's DType.optimal_dtype, so token files are interchangeable.
    if vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def _dtype_code(dtype: Any) -> int:
    dt = np.dtype(dtype)
    if dt not in _CODE_OF_DTYPE:
        supported = ", ".join(str(d) for d in _CODE_OF_DTYPE)
        raise ValueError(
            f"dtype {dt} cannot be stored in an MMIDIDX dataset (supported: {supported})"
        )
    return _CODE_OF_DTYPE[dt]


def check_index(idx: Any, n: int, what: str) -> int:
    """``idx`` into ``n`` items, negative ones counted from the end; IndexError naming ``what``."""
    i = int(idx)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"{what} {idx} out of range [0, {n})")
    return i


class _Index:
    """The validated, memory-mapped contents of one .idx file."""

    def __init__(self, idx_path: str) -> None:
        try:
            file_size = os.path.getsize(idx_path)
        except FileNotFoundError:
            raise IndexedDatasetError(f"{idx_path}: index file not found") from None
        except OSError as e:
            raise IndexedDatasetError(f"{idx_path}: cannot stat index file: {e}") from None
        if file_size < HEADER_SIZE:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index: {file_size} bytes, the header alone is {HEADER_SIZE}"
            )
        with open(idx_path, "rb") as f:
            magic, version, code, seq_count, doc_count = _HEADER.unpack(f.read(HEADER_SIZE))
        if magic != _MAGIC:
            raise IndexedDatasetError(
                f"{idx_path}: bad magic {magic!r}, expected {_MAGIC!r} (not a Megatron MMIDIDX index)"
            )
        if version != _VERSION:
            raise IndexedDatasetError(
                f"{idx_path}: unsupported index version {version}, expected {_VERSION}"
            )
        if code not in _DTYPE_CODES:
            raise IndexedDatasetError(
                f"{idx_path}: unknown dtype code {code}, expected one of {sorted(_DTYPE_CODES)}"
            )
        if doc_count < 1:
            raise IndexedDatasetError(
                f"{idx_path}: document count is 0; the document index must hold at least the "
                "leading 0"
            )
        expected = HEADER_SIZE + 12 * seq_count + 8 * doc_count
        if file_size < expected:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index: {file_size} bytes, the header announces "
                f"{seq_count} sequences and {doc_count - 1} documents = {expected} bytes"
            )
        if file_size > expected:
            extra = file_size - expected
            hint = (
                " (a multimodal index? sequence modes are not supported)"
                if extra == seq_count
                else ""
            )
            raise IndexedDatasetError(
                f"{idx_path}: {extra} unexpected trailing bytes after the document index "
                f"(expected {expected} bytes, found {file_size}){hint}"
            )

        self.path = idx_path
        self.dtype = _DTYPE_CODES[code]
        self.sequence_count = seq_count
        self._mmap = np.memmap(idx_path, mode="r", dtype=np.uint8, order="C")
        buf = memoryview(self._mmap)
        off = HEADER_SIZE
        self.sizes = np.frombuffer(buf, dtype=np.int32, count=seq_count, offset=off)
        off += 4 * seq_count
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=seq_count, offset=off)
        off += 8 * seq_count
        self.document_indices = np.frombuffer(buf, dtype=np.int64, count=doc_count, offset=off)
        self.total_bytes = self._validate()

    def _validate(self) -> int:
        p = self.path
        docs = self.document_indices
        if docs[0] != 0:
            raise IndexedDatasetError(f"{p}: document index starts at {docs[0]}, expected 0")
        if docs[-1] != self.sequence_count:
            raise IndexedDatasetError(
                f"{p}: document index ends at {docs[-1]} but there are {self.sequence_count} "
                "sequences"
            )
        if len(docs) > 1 and np.any(np.diff(docs) < 0):
            bad = int(np.argmax(np.diff(docs) < 0))
            raise IndexedDatasetError(
                f"{p}: document index decreases at document {bad} ({docs[bad]} -> {docs[bad + 1]})"
            )
        itemsize = np.int64(self.dtype.itemsize)
        expected_ptr = np.int64(0)
        for start in range(0, self.sequence_count, _VALIDATE_CHUNK):
            sizes = self.sizes[start : start + _VALIDATE_CHUNK]
            ptrs = self.pointers[start : start + _VALIDATE_CHUNK]
            if np.any(sizes < 0):
                bad = start + int(np.argmax(sizes < 0))
                raise IndexedDatasetError(
                    f"{p}: sequence {bad} has negative length {self.sizes[bad]}"
                )
            nbytes = sizes.astype(np.int64) * itemsize
            # pointers[i] must be the sum of the byte lengths of all earlier sequences
            expect = expected_ptr + np.concatenate(([0], np.cumsum(nbytes[:-1], dtype=np.int64)))
            mismatch = ptrs != expect
            if np.any(mismatch):
                bad = int(np.argmax(mismatch))
                raise IndexedDatasetError(
                    f"{p}: pointer of sequence {start + bad} is {ptrs[bad]}, but the lengths "
                    f"before it add up to byte {expect[bad]}"
                )
            expected_ptr = expect[-1] + nbytes[-1]
        return int(expected_ptr)


class IndexedDataset:
    """Read-only, zero-copy reader: every returned array is a view into the memory-mapped .bin.

    Pickles as its path prefix only, so DataLoader workers (fork or spawn) reopen the files
    instead of copying gigabytes of mapped data through a pipe.
    """

    def __init__(self, path_prefix: str | os.PathLike) -> None:
        self._open(os.fspath(path_prefix))

    def _open(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        index = _Index(index_file_path(path_prefix))
        bin_path = data_file_path(path_prefix)
        try:
            bin_size = os.path.getsize(bin_path)
        except FileNotFoundError:
            raise IndexedDatasetError(
                f"{bin_path}: data file not found (its index {index.path} exists)"
            ) from None
        if bin_size != index.total_bytes:
            what = "truncated" if bin_size < index.total_bytes else "too long"
            raise IndexedDatasetError(
                f"{bin_path}: data file {what}: {bin_size} bytes, but {index.path} describes "
                f"{index.total_bytes} bytes ({index.sequence_count} sequences of {index.dtype})"
            )
        self.dtype: np.dtype = index.dtype
        self.sizes: np.ndarray = index.sizes
        self.pointers: np.ndarray = index.pointers
        self.document_indices: np.ndarray = index.document_indices
        if bin_size == 0:
            # mmap cannot map an empty file; an empty dataset has nothing to read anyway.
            self._bin = np.empty(0, dtype=np.uint8)
        else:
            self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8, order="C")

    def __getstate__(self) -> str:
        return self.path_prefix

    def __setstate__(self, state: str) -> None:
        self._open(state)

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    def _check_index(self, idx: Any) -> int:
        if not isinstance(idx, (int, np.integer)) or isinstance(idx, bool):
            raise TypeError(f"{self.path_prefix}: index must be an int, got {type(idx).__name__}")
        return check_index(idx, len(self), f"{self.path_prefix}: sequence index")

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        return np.frombuffer(self._bin, dtype=self.dtype, count=count, offset=byte_offset)

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"{self.path_prefix}: slices must be contiguous (step 1)")
            if stop <= start:
                return []
            lengths = self.sizes[start:stop]
            flat = self._read(int(self.pointers[start]), int(lengths.sum(dtype=np.int64)))
            return np.split(flat, np.cumsum(lengths[:-1], dtype=np.int64))
        i = self._check_index(idx)
        return self._read(int(self.pointers[i]), int(self.sizes[i]))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end if length is None)."""
        i = self._check_index(idx)
        size = int(self.sizes[i])
        if not 0 <= offset <= size:
            raise IndexError(
                f"{self.path_prefix}: offset {offset} outside sequence {i} of length {size}"
            )
        if length is None:
            length = size - offset
        if length < 0 or offset + length > size:
            raise IndexError(
                f"{self.path_prefix}: length {length} at offset {offset} runs past the end of "
                f"sequence {i} (length {size})"
            )
        return self._read(int(self.pointers[i]) + offset * self.dtype.itemsize, length)

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.path_prefix!r}, sequences={len(self)}, "
            f"documents={self.num_documents}, dtype={self.dtype})"
        )


class _GrowingArray:
    """Append-only numpy buffer with amortised doubling (Python lists of ints cost ~36 B each)."""

    def __init__(self, dtype: Any, initial: int = 1024) -> None:
        self._data = np.empty(initial, dtype=dtype)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def _reserve(self, extra: int) -> None:
        need = self._n + extra
        if need > self._data.shape[0]:
            grown = np.empty(max(need, 2 * self._data.shape[0]), dtype=self._data.dtype)
            grown[: self._n] = self._data[: self._n]
            self._data = grown

    def append(self, value: int) -> None:
        self._reserve(1)
        self._data[self._n] = value
        self._n += 1

    def extend(self, values: np.ndarray) -> None:
        values = np.asarray(values)
        self._reserve(values.shape[0])
        self._data[self._n : self._n + values.shape[0]] = values
        self._n += values.shape[0]

    def view(self) -> np.ndarray:
        return self._data[: self._n]


def _as_numpy(tokens: Any) -> np.ndarray:
    # Duck-typed torch support keeps this module importable (and fast to import) without torch.
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):
        tokens = tokens.detach().cpu().numpy()
    return np.asarray(tokens).reshape(-1)


class IndexedDatasetBuilder:
    """Streams sequences to ``bin_path``; ``finalize`` writes the index.

    Document semantics are megatron-core's: the document index starts as [0] and every
    ``end_document``/``add_document`` appends the current sequence count, so a finished index
    is [0, end_of_doc_0, ..., S]. For the same input, both builders write identical bytes.
    """

    def __init__(self, bin_path: str | os.PathLike, dtype: Any = np.int32) -> None:
        self.bin_path = os.fspath(bin_path)
        self.dtype = np.dtype(dtype)
        _dtype_code(self.dtype)
        self._sizes = _GrowingArray(np.int32)
        self._doc_indices = _GrowingArray(np.int64)
        self._doc_indices.append(0)
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._range: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._range = None
        try:
            # open for the builder's whole life; closed by finalize() or close()
            self._file = open(self.bin_path, "wb")  # noqa: SIM115
        except OSError as e:
            raise IndexedDatasetError(f"{self.bin_path}: cannot create data file: {e}") from None

    def _convert(self, tokens: Any) -> np.ndarray:
        arr = _as_numpy(tokens)
        if self._range is not None and arr.size and arr.dtype.kind in "iub":
            lo, hi = int(arr.min()), int(arr.max())
            # megatron-core would wrap silently (70000 -> 4464 in uint16); corrupt tokens are
            # far more expensive to discover after a week of training than here.
            if lo < self._range[0] or hi > self._range[1]:
                raise ValueError(
                    f"{self.bin_path}: token ids span [{lo}, {hi}], which does not fit {self.dtype}"
                )
        if arr.dtype.kind == "f" and self.dtype.kind in "iu":
            raise ValueError(f"{self.bin_path}: float tokens given to an {self.dtype} dataset")
        return np.ascontiguousarray(arr, dtype=self.dtype)

    def _require_open(self) -> None:
        if self._file is None or self._file.closed:
            raise IndexedDatasetError(f"{self.bin_path}: builder is already finalized or closed")

    def add_item(self, tokens: Any) -> None:
        self._require_open()
        arr = self._convert(tokens)
        self._file.write(arr.tobytes(order="C"))
        self._sizes.append(arr.shape[0])

    def end_document(self) -> None:
        self._require_open()
        self._doc_indices.append(len(self._sizes))

    def add_document(self, sequences: Any, lengths: Any = None) -> None:
        """One document: either a list of sequences, or flat tokens with per-sequence ``lengths``
        (megatron-core's signature)."""
        self._require_open()
        if lengths is None:
            arrays = [self._convert(s) for s in sequences]
            for arr in arrays:
                self._file.write(arr.tobytes(order="C"))
            self._sizes.extend(np.array([a.shape[0] for a in arrays], dtype=np.int32))
        else:
            flat = self._convert(sequences)
            lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
            if np.any(lens < 0) or int(lens.sum()) != flat.shape[0]:
                raise ValueError(
                    f"{self.bin_path}: add_document lengths sum to {int(lens.sum())} but "
                    f"{flat.shape[0]} tokens were given"
                )
            self._file.write(flat.tobytes(order="C"))
            self._sizes.extend(lens.astype(np.int32))
        self._doc_indices.append(len(self._sizes))

    def add_index(self, path_prefix: str | os.PathLike) -> None:
        """Append a finished dataset (all its documents) after what has been written so far."""
        self._require_open()
        prefix = os.fspath(path_prefix)
        other = IndexedDataset(prefix)  # validates both files before any byte is appended
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{index_file_path(prefix)}: dtype {other.dtype} differs from the builder's "
                f"{self.dtype}"
            )
        if len(self._doc_indices) and self._doc_indices.view()[-1] != len(self._sizes):
            raise IndexedDatasetError(
                f"{self.bin_path}: add_index called inside an unfinished document; call "
                "end_document() first"
            )
        offset = len(self._sizes)
        self._sizes.extend(other.sizes)
        self._doc_indices.extend(other.document_indices[1:] + offset)
        del other
        with open(data_file_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._file, length=16 << 20)

    def close(self) -> None:
        """Close the data file without writing an index (used to abandon a failed build)."""
        if self._file is not None and not self._file.closed:
            self._file.close()

    def finalize(self, idx_path: str | os.PathLike) -> None:
        self._require_open()
        idx_path = os.fspath(idx_path)
        sizes = self._sizes.view()
        docs = self._doc_indices.view()
        if docs[-1] != sizes.shape[0]:
            self.close()
            raise IndexedDatasetError(
                f"{idx_path}: {sizes.shape[0] - int(docs[-1])} sequences were added after the "
                "last end_document(); every sequence must belong to a document"
            )
        self._file.close()
        itemsize = np.int64(self.dtype.itemsize)
        pointers = np.zeros(sizes.shape[0], dtype=np.int64)
        if sizes.shape[0] > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * itemsize, out=pointers[1:])
        with open(idx_path, "wb") as f:
            write_index_header(f, self.dtype, sizes.shape[0], docs.shape[0])
            f.write(sizes.astype("<i4", copy=False).tobytes(order="C"))
            f.write(pointers.astype("<i8", copy=False).tobytes(order="C"))
            f.write(docs.astype("<i8", copy=False).tobytes(order="C"))

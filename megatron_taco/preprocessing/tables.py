"""Tables: .parquet, .arrow (IPC file or stream, as in Hugging Face caches) and .feather, read
in record batches with pyarrow; each json key is one column, one row is one record."""

from __future__ import annotations

import os
from collections.abc import Iterator

from megatron_taco.preprocessing.records import CorpusError, RawRecord, Skipped
from megatron_taco.preprocessing.streams import COMPRESSION_EXTS

TABLE_EXTS = (".parquet", ".arrow", ".feather")
_BATCH_ROWS = 1024
_CC_NEWS_TEXT_FIELDS = ("title", "maintext", "text")


def _is_text_type(t, numbers: bool = False) -> bool:
    import pyarrow as pa

    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True
    if numbers and (pa.types.is_integer(t) or pa.types.is_floating(t)):
        return True
    if hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _is_text_type(t.value_type)
    if pa.types.is_dictionary(t):
        return _is_text_type(t.value_type)
    return False


def _open_table(path: str, fmt: str):
    """(schema, batch iterator factory) of a parquet/arrow/feather file."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    name = os.path.basename(path).lower()
    if name.endswith(COMPRESSION_EXTS):
        raise CorpusError(f"{path}: compressed {fmt} tables are not supported; decompress the file")
    try:
        if name.endswith(".parquet"):
            pf = pq.ParquetFile(path)
            schema = pf.schema_arrow
            return schema, lambda cols: pf.iter_batches(batch_size=_BATCH_ROWS, columns=cols)
        source = pa.memory_map(path)
        try:
            reader = ipc.open_file(source)
            schema = reader.schema

            def batches(cols, reader=reader):
                for i in range(reader.num_record_batches):
                    b = reader.get_batch(i)
                    yield b.select(cols) if cols is not None else b

            return schema, batches
        except pa.ArrowInvalid:
            # Hugging Face datasets caches are IPC *streams*, not IPC files.
            stream = ipc.open_stream(pa.memory_map(path))

            def sbatches(cols, stream=stream):
                for b in stream:
                    yield b.select(cols) if cols is not None else b

            return stream.schema, sbatches
    except (OSError, pa.ArrowException) as e:
        raise CorpusError(f"{path}: not a readable parquet/arrow/feather file ({e})") from e


def read_table(path: str, fmt: str, json_keys) -> Iterator[RawRecord | Skipped]:
    schema, batches = _open_table(path, fmt)
    names = list(schema.names)
    if json_keys is None:
        cols = [n for n in names if _is_text_type(schema.field(n).type)]
    else:
        wanted = list(json_keys)
        if fmt == "cc-news":
            if "maintext" not in names and "text" not in names:
                raise CorpusError(
                    f"{path}: a cc-news table needs a 'maintext' or 'text' column; columns are {names}"
                )
            wanted = [k for k in _CC_NEWS_TEXT_FIELDS if k in names] + list(json_keys[1:])
        missing = [k for k in wanted if k not in names]
        if missing:
            raise CorpusError(
                f"{path}: no column {missing} (json keys {list(json_keys)}); columns are {names}"
            )
        # Numbers are accepted for metadata keys (ids); binary, nested and time columns
        # have no single text form.
        not_text = [k for k in wanted if not _is_text_type(schema.field(k).type, numbers=True)]
        if not_text:
            raise CorpusError(
                f"{path}: column(s) {not_text} are not text ({[str(schema.field(k).type) for k in not_text]})"
            )
        cols = list(dict.fromkeys(wanted))
    row = 0
    for batch in batches(cols):
        for rec in batch.to_pylist():
            yield RawRecord(fmt, rec, f"{path}#row={row}")
            row += 1


def table_columns(path: str) -> list[str]:
    return list(_open_table(path, "parquet")[0].names)

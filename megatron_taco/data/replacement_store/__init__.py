"""On-disk store of SAS replacement tokens: one generation per epoch, sharded, flat in memory.

In epoch t every training instance samples one token per replaced slot from the MLM head;
those tokens are what the model reads at the same slots in epoch t+1. Instead of keeping an
[N, W] array in RAM on every rank, the tokens of epoch t go to ``ROOT/gen_{t:05d}/``::

    layout.json          the StoreLayout, written by the first writer (guards resumes)
    shard_{k:05d}.bin    rows of instances [k*R, min((k+1)*R, N)): W little-endian values
                         each, then the row's 32-bit checksum (row_checksums)
    manifest.json        written last by commit_generation: sizes and crc32 of every shard

A shard is written by exactly one GenerationWriter (ownership is the caller's decision),
with positioned writes at fixed row offsets, so replaying a batch rewrites identical bytes.
A generation is readable only once its manifest exists, and the manifest is written only
after every row was written and found to match the checksum written with it (a row changed
on disk before the commit is refused, not sealed into the manifest); reads check it too. Nothing here is O(N) in memory: files are created, scanned and
read in bounded chunks, and reads go through ``pread`` rather than a memory map so that an
epoch of random reads does not grow the process's resident set to the size of the store.
See docs/replacement_store.md for the protocol and the crash-consistency argument.

Modules: layout.py (StoreLayout, row checksums, paths), writer.py (GenerationWriter),
manifest.py (commit_generation, read_manifest), reader.py (GenerationReader, list and delete
generations). The names below are the store's API.
"""

from megatron_taco.data.replacement_store.layout import (
    LAYOUT_NAME,
    MANIFEST_NAME,
    MAX_VOCAB_SIZE,
    ReplacementStoreError,
    StoreLayout,
    check_origin,
    generation_dir,
    manifest_path,
    read_layout_file,
    row_checksums,
)
from megatron_taco.data.replacement_store.manifest import (
    Manifest,
    ShardRecord,
    commit_generation,
    read_manifest,
)
from megatron_taco.data.replacement_store.reader import (
    GenerationReader,
    delete_generations,
    list_generations,
)
from megatron_taco.data.replacement_store.writer import GenerationWriter

__all__ = [
    "LAYOUT_NAME",
    "MANIFEST_NAME",
    "MAX_VOCAB_SIZE",
    "GenerationReader",
    "GenerationWriter",
    "Manifest",
    "ReplacementStoreError",
    "ShardRecord",
    "StoreLayout",
    "check_origin",
    "commit_generation",
    "delete_generations",
    "generation_dir",
    "list_generations",
    "manifest_path",
    "read_layout_file",
    "read_manifest",
    "row_checksums",
]

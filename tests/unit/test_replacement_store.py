import dataclasses
import json
import multiprocessing as mp
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_taco.data import replacement_store as rs
from megatron_taco.data.replacement_store import (
    GenerationReader,
    GenerationWriter,
    ReplacementStoreError,
    StoreLayout,
    commit_generation,
    delete_generations,
    list_generations,
    manifest_path,
    read_manifest,
)
from megatron_taco.data.replacement_store import layout as store_layout
from tests.helpers import committed_generations, shard_path

REPO = Path(__file__).resolve().parents[2]


def _rows(ids, layout, seed=0):
    # A pure function of (instance, seed): what a deterministic replay would sample again.
    ids = np.asarray(ids, dtype=np.int64)
    slots = np.arange(layout.width, dtype=np.int64)
    return (ids[:, None] * 1_000_003 + slots * 7_919 + seed * 31) % layout.vocab_size


def _schedule(layout, seed, max_batch=17):
    """A random permutation of all instances cut into random-sized batches."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(layout.num_instances)
    cuts = []
    pos = 0
    while pos < len(perm):
        size = int(rng.integers(1, max_batch + 1))
        cuts.append(perm[pos : pos + size])
        pos += size
    return cuts


def _write_all(root, layout, generation=0, num_writers=1, seed=0):
    owners = [list(range(w, layout.num_shards, num_writers)) for w in range(num_writers)]
    writers = [GenerationWriter(root, generation, layout, own) for own in owners]
    for batch in _schedule(layout, seed):
        shard_owner = layout.shard_of(batch) % num_writers  # round-robin ownership
        for w, writer in enumerate(writers):
            mine = batch[shard_owner == w]
            writer.write(mine, _rows(mine, layout, seed))
    for writer in writers:
        writer.flush()
        writer.close()
    return commit_generation(root, generation, layout)


def _shard_bytes(root, layout, generation=0):
    return [
        Path(shard_path(root, generation, layout, k)).read_bytes() for k in range(layout.num_shards)
    ]


# ---------------------------------------------------------------------------------------
# layout


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(num_instances=0, width=4, vocab_size=10, num_shards=1), "num_instances"),
        (dict(num_instances=-5, width=4, vocab_size=10, num_shards=1), "num_instances"),
        (dict(num_instances=10, width=0, vocab_size=10, num_shards=1), "width"),
        (dict(num_instances=10, width=4.0, vocab_size=10, num_shards=1), "width"),
        (dict(num_instances=10, width=4, vocab_size=0, num_shards=1), "vocab_size"),
        (dict(num_instances=10, width=4, vocab_size=2**32, num_shards=1), "vocab_size"),
        (dict(num_instances=10, width=4, vocab_size=10, num_shards=0), "num_shards"),
        (dict(num_instances=True, width=4, vocab_size=10, num_shards=1), "num_instances"),
    ],
)
def test_nonsense_layouts_are_refused(kwargs, field):
    with pytest.raises(ReplacementStoreError, match=rf"^StoreLayout\.{field}: expected an integer"):
        StoreLayout(**kwargs)


def test_dtype_holds_the_vocabulary_plus_a_sentinel():
    small = StoreLayout(num_instances=3, width=2, vocab_size=65535, num_shards=1)
    big = StoreLayout(num_instances=3, width=2, vocab_size=65536, num_shards=1)
    assert small.dtype == np.dtype("<u2") and small.sentinel == 65534 + 1
    assert big.dtype == np.dtype("<u4") and big.sentinel == 2**32 - 1
    assert StoreLayout(1, 1, 2**32 - 1, 1).sentinel == 2**32 - 1


@pytest.mark.parametrize("n,shards", [(10, 1), (10, 3), (10, 4), (10, 6), (3, 8), (1, 5), (12, 12)])
def test_shards_partition_the_instances(n, shards):
    layout = StoreLayout(num_instances=n, width=2, vocab_size=50, num_shards=shards)
    ranges = [layout.shard_range(k) for k in range(shards)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    ids = np.arange(n)
    for k, (first, stop) in enumerate(ranges):
        assert (layout.shard_of(ids[first:stop]) == k).all()
    with pytest.raises(ReplacementStoreError, match="out of range"):
        layout.shard_of([n])


# ---------------------------------------------------------------------------------------
# round trip


@pytest.mark.parametrize(
    "n,width,vocab,shards,writers",
    [
        (1000, 7, 800, 4, 2),  # divisible
        (1001, 5, 70_000, 3, 3),  # uint32, N not divisible by num_shards
        (10, 3, 50, 6, 4),  # trailing empty shard (R=2, 5 shards used)
        (5, 3, 50, 8, 3),  # num_shards > N
        (1, 1, 2, 1, 1),
    ],
)
def test_round_trip_with_several_writers(tmp_path, n, width, vocab, shards, writers):
    layout = StoreLayout(num_instances=n, width=width, vocab_size=vocab, num_shards=shards)
    manifest = _write_all(tmp_path, layout, generation=3, num_writers=writers, seed=n)
    assert manifest.layout == layout and len(manifest.shards) == shards
    assert manifest == read_manifest(tmp_path, 3)
    reader = GenerationReader(tmp_path, 3)
    assert len(reader) == n
    rng = np.random.default_rng(1)
    for ids in (np.arange(n), rng.permutation(n), rng.integers(0, n, size=3 * n)):
        got = reader.read(ids)
        assert got.dtype == layout.dtype and got.shape == (len(ids), width)
        np.testing.assert_array_equal(got, _rows(ids, layout, seed=n))
    assert reader.read(np.array([], dtype=np.int64)).shape == (0, width)
    reader.close()


def test_manifest_holds_layout_and_shard_records(tmp_path):
    layout = StoreLayout(num_instances=7, width=2, vocab_size=100, num_shards=2)
    _write_all(tmp_path, layout)
    obj = json.loads(Path(manifest_path(tmp_path, 0)).read_text())
    assert obj["format"] == "megatron_taco.replacement_store" and obj["version"] == 2
    assert obj["complete"] is True and obj["generation"] == 0
    assert obj["layout"] == dict(
        num_instances=7, width=2, vocab_size=100, num_shards=2, dtype="uint16", version=2
    )
    first = obj["shards"][1]
    assert (first["file"], first["first_instance"], first["num_instances"]) == (
        "shard_00001.bin",
        4,
        3,
    )
    # 3 rows of 2 uint16 ids and a uint32 checksum each
    assert first["bytes"] == 3 * (2 * 2 + 4) == os.path.getsize(shard_path(tmp_path, 0, layout, 1))


def test_repeated_instance_in_one_batch_last_wins(tmp_path):
    layout = StoreLayout(num_instances=4, width=2, vocab_size=100, num_shards=1)
    with GenerationWriter(tmp_path, 0, layout, [0]) as w:
        w.write(np.array([0, 1, 2, 3, 1]), np.array([[1, 1], [2, 2], [3, 3], [4, 4], [9, 9]]))
    commit_generation(tmp_path, 0, layout)
    assert GenerationReader(tmp_path, 0).read([1]).tolist() == [[9, 9]]


# ---------------------------------------------------------------------------------------
# misuse and unwritten rows


def test_writing_a_shard_not_owned_is_an_error(tmp_path):
    layout = StoreLayout(num_instances=10, width=2, vocab_size=100, num_shards=2)
    with GenerationWriter(tmp_path, 0, layout, [0]) as w:
        w.write(np.array([1, 2]), np.ones((2, 2), dtype=np.int64))
        with pytest.raises(ReplacementStoreError, match=r"instance 7 belongs to shard_00001\.bin"):
            w.write(np.array([3, 7]), np.ones((2, 2), dtype=np.int64))
    assert not os.path.exists(shard_path(tmp_path, 0, layout, 1))  # not created either


@pytest.mark.parametrize(
    "ids,rows,message",
    [
        ([0, 1], np.zeros((2, 3)), r"rows have shape \(2, 3\), expected \(2, 2\)"),
        ([0, 1], np.zeros((2, 2)), "rows must hold integer token ids"),
        ([0, 1], [[0, 0], [5, 100]], r"instance 1 has token id\(s\) outside \[0, 100\)"),
        ([0, 1], [[0, -1], [5, 10]], r"instance 0 has token id\(s\) outside"),
        ([0, 10], [[0, 0], [0, 0]], r"instance id 10 out of range \[0, 10\)"),
        ([[0, 1]], [[0, 0], [0, 0]], "instance ids must be a 1-D integer array"),
    ],
)
def test_bad_writes_are_refused(tmp_path, ids, rows, message):
    layout = StoreLayout(num_instances=10, width=2, vocab_size=100, num_shards=1)
    w = GenerationWriter(tmp_path, 0, layout, [0])
    with pytest.raises(ReplacementStoreError, match=message):
        w.write(np.asarray(ids), np.asarray(rows))
    w.close()


@pytest.mark.parametrize("owned", [[2], [-1], ["0"], 3])
def test_bad_ownership_is_refused(tmp_path, owned):
    layout = StoreLayout(num_instances=10, width=2, vocab_size=100, num_shards=2)
    with pytest.raises(ReplacementStoreError, match="owned_shards"):
        GenerationWriter(tmp_path, 0, layout, owned)


def _write_all_but(root, layout, skipped):
    ids = np.setdiff1d(np.arange(layout.num_instances), skipped)
    with GenerationWriter(root, 0, layout, range(layout.num_shards)) as w:
        w.write(ids, _rows(ids, layout))
        w.flush()


def test_commit_refuses_unwritten_rows_naming_shard_and_instance(tmp_path):
    layout = StoreLayout(num_instances=30, width=3, vocab_size=100, num_shards=3)
    _write_all_but(tmp_path, layout, skipped=[17, 25])
    shard = shard_path(tmp_path, 0, layout, 1)
    with pytest.raises(ReplacementStoreError) as info:
        commit_generation(tmp_path, 0, layout)
    assert str(info.value) == (
        f"{shard}: 1 of 10 rows never written (first: instance 17); refusing to commit generation 0"
    )
    assert not os.path.exists(manifest_path(tmp_path, 0))


def test_reading_an_unwritten_row_names_shard_and_instance(tmp_path):
    layout = StoreLayout(num_instances=30, width=3, vocab_size=100, num_shards=3)
    _write_all_but(tmp_path, layout, skipped=[17])
    with pytest.raises(ReplacementStoreError, match="never committed"):
        GenerationReader(tmp_path, 0)
    reader = GenerationReader(tmp_path, 0, allow_uncommitted=True)
    np.testing.assert_array_equal(reader.read([16, 18]), _rows([16, 18], layout))
    shard = shard_path(tmp_path, 0, layout, 1)
    with pytest.raises(ReplacementStoreError) as info:
        reader.read([3, 17, 16])
    assert str(info.value) == f"{shard}: instance 17 (row 7) was never written"


def test_uncommitted_reader_reports_a_shard_no_writer_created(tmp_path):
    layout = StoreLayout(num_instances=10, width=2, vocab_size=100, num_shards=2)
    GenerationWriter(tmp_path, 0, layout, [0]).close()
    reader = GenerationReader(tmp_path, 0, allow_uncommitted=True)
    with pytest.raises(ReplacementStoreError, match=r"shard_00001\.bin: missing$"):
        reader.read([7])


# ---------------------------------------------------------------------------------------
# reopening (resumed runs)


def test_reopening_keeps_rows_and_uncommits(tmp_path):
    layout = StoreLayout(num_instances=50, width=4, vocab_size=1000, num_shards=2)
    first = _write_all(tmp_path, layout)
    before = _shard_bytes(tmp_path, layout)
    writer = GenerationWriter(tmp_path, 0, layout, [1])
    # The rows of the old commit are still there, but checksums may go stale: no manifest.
    assert not os.path.exists(manifest_path(tmp_path, 0))
    assert _shard_bytes(tmp_path, layout) == before
    ids = np.arange(25, 50)
    writer.write(ids, _rows(ids, layout))  # the replay writes the same values
    writer.flush()
    writer.close()
    assert commit_generation(tmp_path, 0, layout) == first


def test_reopening_with_another_layout_is_refused(tmp_path):
    layout = StoreLayout(num_instances=50, width=4, vocab_size=1000, num_shards=2)
    GenerationWriter(tmp_path, 0, layout, [0]).close()
    other = StoreLayout(num_instances=50, width=5, vocab_size=1000, num_shards=2)
    with pytest.raises(ReplacementStoreError, match=r"layout\.json: generation 0 was started with"):
        GenerationWriter(tmp_path, 0, other, [1])
    with pytest.raises(ReplacementStoreError, match=r"layout\.json: generation was written with"):
        commit_generation(tmp_path, 0, other)


def test_a_resume_whose_flags_decide_other_rows_is_refused_naming_the_flag(tmp_path):
    # Issue 27 item 3: same sizes, but another seed (other instances) or replacement rate of
    # the same width (other positions): each row would land elsewhere.
    origin = (("--seed", "1234"), ("--mask-prob", "0.15"), ("--data-path", '[[1.0, "a", 9, 3]]'))
    layout = StoreLayout(num_instances=50, width=4, vocab_size=1000, num_shards=2, origin=origin)
    assert StoreLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    first = _write_all(tmp_path, layout)
    assert (
        rs.Manifest.from_json(json.loads(json.dumps(first.to_json()))).layout.origin
        == layout.origin
    )
    for flag, value in (
        ("--seed", "7"),
        ("--mask-prob", "0.14"),
        ("--data-path", '[[1.0, "a", 8, 3]]'),
    ):
        other = dataclasses.replace(layout, origin=(*dict(origin, **{flag: value}).items(),))
        line = (
            f"{flag}: the store was written with {flag} {dict(origin)[flag]}, this run has "
            f"{value}: its rows would be read onto other positions or instances"
        )
        with pytest.raises(ReplacementStoreError, match=f"layout\\.json: {re.escape(line)}"):
            GenerationWriter(tmp_path, 0, other, [1])
        with pytest.raises(ReplacementStoreError, match=f"layout\\.json: {re.escape(line)}"):
            commit_generation(tmp_path, 0, other)
    assert os.path.exists(manifest_path(tmp_path, 0))  # refused before it was un-committed
    # A store written before the origin was recorded: its sizes are all there is to check.
    GenerationWriter(tmp_path, 1, dataclasses.replace(layout, origin=()), [0]).close()
    GenerationWriter(tmp_path, 1, layout, [0]).close()


def test_reopening_a_shard_of_the_wrong_size_is_refused(tmp_path):
    layout = StoreLayout(num_instances=50, width=4, vocab_size=1000, num_shards=2)
    GenerationWriter(tmp_path, 0, layout, [0]).close()
    path = shard_path(tmp_path, 0, layout, 0)
    os.truncate(path, 10)
    with pytest.raises(ReplacementStoreError, match=r"shard_00000\.bin: truncated \(size 10 bytes"):
        GenerationWriter(tmp_path, 0, layout, [0])
    assert os.path.getsize(path) == 10  # refused, not "repaired"


# ---------------------------------------------------------------------------------------
# crash consistency (a real SIGKILL in a child process)

_CRASH_LAYOUT = dict(num_instances=3000, width=9, vocab_size=30_000, num_shards=3)

_WRITER_CHILD = """
import sys, time
sys.path.insert(0, {repo!r})
from megatron_taco.data.replacement_store import GenerationWriter, StoreLayout
from tests.unit.test_replacement_store import _rows, _schedule
layout = StoreLayout(**{layout!r})
batches = _schedule(layout, seed=5)
w = GenerationWriter({root!r}, 1, layout, range(layout.num_shards))
for b in batches[:{flushed}]:
    w.write(b, _rows(b, layout, seed=5))
w.flush()
for b in batches[{flushed}:{flushed} + 5]:  # written, never flushed
    w.write(b, _rows(b, layout, seed=5))
print("READY", flush=True)
time.sleep(120)
"""


def _run_until_ready(script):
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        pytest.fail(f"child did not get ready: {line!r} {proc.stderr.read()}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    proc.stdout.close()
    proc.stderr.close()


def test_sigkill_after_flush_then_replay_is_byte_identical(tmp_path):
    layout = StoreLayout(**_CRASH_LAYOUT)
    batches = _schedule(layout, seed=5)
    flushed = len(batches) // 3
    root = tmp_path / "crashed"
    _run_until_ready(
        _WRITER_CHILD.format(repo=str(REPO), layout=_CRASH_LAYOUT, root=str(root), flushed=flushed)
    )
    with pytest.raises(ReplacementStoreError, match="never written"):
        commit_generation(root, 1, layout)
    # Reopened, not truncated: every flushed row survived the kill.
    done = np.concatenate(batches[:flushed])
    peek = GenerationReader(root, 1, allow_uncommitted=True)
    np.testing.assert_array_equal(peek.read(done), _rows(done, layout, seed=5))
    with GenerationWriter(root, 1, layout, range(layout.num_shards)) as w:
        for b in batches[flushed:]:
            w.write(b, _rows(b, layout, seed=5))
        w.flush()
    crashed = commit_generation(root, 1, layout)

    reference = tmp_path / "reference"
    with GenerationWriter(reference, 1, layout, range(layout.num_shards)) as w:
        for b in batches:
            w.write(b, _rows(b, layout, seed=5))
        w.flush()
    assert commit_generation(reference, 1, layout) == crashed
    assert _shard_bytes(root, layout, 1) == _shard_bytes(reference, layout, 1)
    assert sorted(os.listdir(root / "gen_00001")) == sorted(os.listdir(reference / "gen_00001"))


_CREATION_CHILD = """
import os, sys, time
sys.path.insert(0, {repo!r})
from megatron_taco.data import replacement_store as rs
from megatron_taco.data.replacement_store import writer

def stop_here():
    print("READY", flush=True)
    time.sleep(120)

if {stage!r} == "fill":
    def half_fill(fd, nbytes, layout):
        os.pwrite(fd, b"\\xff" * (nbytes // 2), 0)
        stop_here()
    writer._fill_sentinel = half_fill
else:  # filled and fsynced, killed just before the rename
    real_replace = os.replace
    def blocked_replace(src, dst):
        if dst.endswith(".bin"):
            stop_here()
        real_replace(src, dst)
    os.replace = blocked_replace
rs.GenerationWriter({root!r}, 0, rs.StoreLayout(**{layout!r}), [0])
"""


@pytest.mark.parametrize("stage", ["fill", "rename"])
def test_sigkill_during_shard_creation_leaves_no_shard(tmp_path, stage):
    layout = StoreLayout(**_CRASH_LAYOUT)
    _run_until_ready(
        _CREATION_CHILD.format(
            repo=str(REPO), stage=stage, root=str(tmp_path), layout=_CRASH_LAYOUT
        )
    )
    gen = tmp_path / "gen_00000"
    leftovers = [p.name for p in gen.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith("shard_00000.bin.")
    path = shard_path(tmp_path, 0, layout, 0)
    assert not os.path.exists(path)
    with pytest.raises(ReplacementStoreError, match=rf"^{path}: missing$"):
        commit_generation(tmp_path, 0, layout)
    # A fresh writer clears the leftover and creates the shard whole.
    GenerationWriter(tmp_path, 0, layout, [0]).close()
    assert not [p for p in gen.iterdir() if p.name.endswith(".tmp")]
    data = np.fromfile(path, dtype=np.uint8)  # ids and checksums: all the sentinel's bytes
    assert data.size == 1000 * layout.record_bytes and (data == 0xFF).all()


# ---------------------------------------------------------------------------------------
# corruption: one clear line naming the file


def _committed(tmp_path):
    layout = StoreLayout(num_instances=100, width=5, vocab_size=300, num_shards=3)
    _write_all(tmp_path, layout, generation=2)
    return layout, shard_path(tmp_path, 2, layout, 1), manifest_path(tmp_path, 2)


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _edit_manifest(path, edit):
    obj = json.loads(Path(path).read_text())
    edit(obj)
    Path(path).write_text(json.dumps(obj))


def _error(tmp_path, **kwargs):
    with pytest.raises(ReplacementStoreError) as info:
        GenerationReader(tmp_path, 2, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_missing_shard(tmp_path):
    _, shard, _ = _committed(tmp_path)
    os.unlink(shard)
    assert _error(tmp_path) == f"{shard}: missing"


def test_truncated_shard(tmp_path):
    _, shard, _ = _committed(tmp_path)
    os.truncate(shard, 17)
    assert _error(tmp_path, verify=False) == f"{shard}: truncated (size 17 bytes, expected 476)"


def test_grown_shard(tmp_path):
    _, shard, _ = _committed(tmp_path)
    with open(shard, "ab") as f:
        f.write(b"\0\0")
    assert _error(tmp_path) == f"{shard}: wrong size (478 bytes, expected 476)"


def test_corrupt_shard_fails_the_checksum(tmp_path):
    _, shard, _ = _committed(tmp_path)
    _flip_byte(shard, 123)
    assert _error(tmp_path).startswith(f"{shard}: checksum mismatch (crc32 ")
    GenerationReader(tmp_path, 2, verify=False)  # size still right: only verify catches it


def test_missing_manifest(tmp_path):
    _, _, manifest = _committed(tmp_path)
    os.unlink(manifest)
    assert _error(tmp_path) == f"{manifest}: missing (generation 2 was never committed)"


@pytest.mark.parametrize(
    "corrupt,expected",
    [
        (lambda p: Path(p).write_bytes(b'{"format": "megatron_ta'), "not valid JSON"),
        (lambda p: Path(p).write_bytes(b"\xff\xfe\x00garbage"), r"not valid JSON \(not UTF-8"),
        (lambda p: Path(p).write_text("[1, 2]"), "expected a JSON object"),
        (
            lambda p: _edit_manifest(p, lambda o: o.update(version=7)),
            # Issue 27 item 2: good data of a newer version, never "delete it".
            r"written by a newer megatron_taco \(store format version 7, this version reads "
            r"2\): upgrade megatron_taco to read it",
        ),
        (
            lambda p: _edit_manifest(p, lambda o: o.update(complete=False)),
            "not marked complete",
        ),
        (
            lambda p: _edit_manifest(p, lambda o: o["layout"].update(num_instances=200)),
            "shard 0 records num_instances 34, the layout gives 67",
        ),
        (
            lambda p: _edit_manifest(p, lambda o: o["layout"].update(width=0)),
            r"StoreLayout\.width: expected an integer >= 1, got 0",
        ),
        (
            lambda p: _edit_manifest(p, lambda o: o["layout"].update(dtype="uint32")),
            "dtype 'uint32' does not match vocab_size 300",
        ),
        (
            lambda p: _edit_manifest(p, lambda o: o["shards"].pop()),
            "lists 2 shards, the layout has 3",
        ),
        (
            lambda p: _edit_manifest(p, lambda o: o["shards"][0].pop("crc32")),
            "shard 0 lacks crc32",
        ),
        (
            lambda p: _edit_manifest(p, lambda o: o["shards"][0].update(crc32="abc")),
            "crc32 must be an integer",
        ),
        (lambda p: _edit_manifest(p, lambda o: o.update(generation=5)), "records generation 5"),
    ],
)
def test_corrupt_manifest(tmp_path, corrupt, expected):
    _, _, manifest = _committed(tmp_path)
    corrupt(manifest)
    message = _error(tmp_path)
    assert message.startswith(f"{manifest}: ")
    assert len(re.findall(expected, message)) == 1, message


# ---------------------------------------------------------------------------------------
# generations


def test_list_commit_and_delete_generations(tmp_path):
    layout = StoreLayout(num_instances=20, width=2, vocab_size=100, num_shards=2)
    assert list_generations(tmp_path / "nothing-yet") == []
    for t in range(4):
        _write_all(tmp_path, layout, generation=t)
    GenerationWriter(tmp_path, 4, layout, [0]).close()  # being written
    (tmp_path / "gen_000005").mkdir()  # not a canonical name: not ours
    (tmp_path / "gen_00009").write_text("a file, not a generation")
    assert list_generations(tmp_path) == [0, 1, 2, 3, 4]
    assert committed_generations(tmp_path) == [0, 1, 2, 3]
    assert delete_generations(tmp_path, keep={2, 4}) == [0, 1, 3]
    assert list_generations(tmp_path) == [2, 4] and committed_generations(tmp_path) == [2]
    assert (tmp_path / "gen_000005").is_dir()
    np.testing.assert_array_equal(GenerationReader(tmp_path, 2).read([5]), _rows([5], layout))
    Path(manifest_path(tmp_path, 2)).write_text("{")
    with pytest.raises(ReplacementStoreError, match="not valid JSON"):
        committed_generations(tmp_path)
    with pytest.raises(ReplacementStoreError, match="generation must be an integer"):
        delete_generations(tmp_path, keep={-1})


# ---------------------------------------------------------------------------------------
# pickling


def _read_in_child(reader, ids):
    assert reader._files == {}  # nothing open came across
    return reader.read(ids)


def test_reader_pickles_without_open_files_and_reads_in_a_spawned_child(tmp_path):
    layout = StoreLayout(num_instances=500, width=6, vocab_size=70_000, num_shards=4)
    _write_all(tmp_path, layout, seed=2)
    reader = GenerationReader(tmp_path, 0)
    ids = np.array([499, 0, 250, 3, 3])
    reader.read(ids)  # opens files in the parent
    assert reader._files
    clone = pickle.loads(pickle.dumps(reader))
    assert clone._files == {} and clone.manifest == reader.manifest
    with mp.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_read_in_child, (reader, ids))
    np.testing.assert_array_equal(got, _rows(ids, layout, seed=2))
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(GenerationWriter(tmp_path, 1, layout, [0]))


# ---------------------------------------------------------------------------------------
# memory

_MEMORY_CHILD = """
import json, sys
sys.path.insert(0, {repo!r})
import numpy as np
from megatron_taco.data.replacement_store import (
    GenerationReader, GenerationWriter, StoreLayout, commit_generation)

def status_kb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

layout = StoreLayout(num_instances={n}, width=20, vocab_size=30_000, num_shards=4)
def rows(ids):
    return (ids[:, None] * 1_000_003 + np.arange(20) * 7_919) % 30_000
rng = np.random.default_rng(0)
baseline = status_kb("VmHWM")
with GenerationWriter({root!r}, 0, layout, range(4)) as w:
    pos = 0
    while pos < layout.num_instances:  # in order, batch sizes random: no O(N) schedule
        ids = np.arange(pos, min(pos + int(rng.integers(1, 8192)), layout.num_instances))
        w.write(ids, rows(ids))
        pos = ids[-1] + 1
    w.flush()
commit_generation({root!r}, 0, layout)
reader = GenerationReader({root!r}, 0)
for start in range(0, layout.num_instances, 4096):
    ids = np.arange(start, min(start + 4096, layout.num_instances))
    ids = np.concatenate([ids, rng.integers(0, layout.num_instances, size=64)])
    assert (reader.read(ids) == rows(ids)).all()
print(json.dumps(dict(baseline_kb=baseline, peak_kb=status_kb("VmHWM"))))
"""


def _peak_rss(root, n):
    script = _MEMORY_CHILD.format(repo=str(REPO), n=n, root=str(root))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_memory_is_flat_in_the_number_of_instances(tmp_path):
    started = time.monotonic()
    small = _peak_rss(tmp_path / "small", 20_000)
    large = _peak_rss(tmp_path / "large", 2_000_000)
    in_ram_kb = 2_000_000 * 20 * 2 // 1024  # what an [N, W] uint16 array would cost
    assert os.path.getsize(tmp_path / "large" / "gen_00000" / "shard_00000.bin") == 500_000 * 44
    growth_kb = large["peak_kb"] - small["peak_kb"]
    print(f"peak RSS kB: small={small} large={large} growth={growth_kb} in-RAM array={in_ram_kb}")
    assert growth_kb < 0.25 * in_ram_kb
    assert large["peak_kb"] - large["baseline_kb"] < 0.25 * in_ram_kb
    assert time.monotonic() - started < 60


def test_scanning_uses_bounded_chunks(tmp_path, monkeypatch):
    # The chunk size is what bounds creation and checksum memory; a tiny one must still work.
    monkeypatch.setattr(store_layout, "CHUNK_BYTES", 7)
    layout = StoreLayout(num_instances=41, width=3, vocab_size=70_000, num_shards=2)
    _write_all(tmp_path, layout)
    np.testing.assert_array_equal(
        GenerationReader(tmp_path, 0).read(np.arange(41)), _rows(np.arange(41), layout)
    )


# ---------------------------------------------------------------------------------------
# row checksums: a row changed between its write and the commit (issue 22 item 3)


def _set_token(root, layout, generation, instance, slot, value):
    """Overwrites one token id of a stored row in place (the checksum is left as written)."""
    k = instance // layout.rows_per_shard
    offset = (instance - k * layout.rows_per_shard) * layout.record_bytes
    offset += slot * layout.dtype.itemsize
    with open(shard_path(root, generation, layout, k), "r+b") as f:
        f.seek(offset)
        f.write(np.array([value], dtype=layout.dtype).tobytes())


def _interrupted(root, layout, generation=1, seed=0):
    """A generation written up to a checkpoint (flushed), then the process is gone: every row
    but those of the schedule's second half, which the resumed run replays."""
    schedule = _schedule(layout, seed)
    half = len(schedule) // 2
    with GenerationWriter(root, generation, layout, range(layout.num_shards)) as writer:
        for batch in schedule[:half]:
            writer.write(batch, _rows(batch, layout, seed))
        writer.flush()
    return schedule[:half], schedule[half:]


def _resume(root, layout, replay, generation=1, seed=0):
    with GenerationWriter(root, generation, layout, range(layout.num_shards)) as writer:
        for batch in replay:
            writer.write(batch, _rows(batch, layout, seed))
        writer.flush()
    return commit_generation(root, generation, layout)


@pytest.mark.parametrize("vocab", [1000, 70_000])  # uint16 and uint32 ids
def test_a_row_changed_before_the_commit_is_refused_by_shard_and_row(tmp_path, vocab):
    layout = StoreLayout(num_instances=60, width=5, vocab_size=vocab, num_shards=3)
    written, replay = _interrupted(tmp_path, layout)
    victim = int(written[0][0])  # written before the checkpoint: the replay leaves it
    good = int(_rows(np.array([victim]), layout)[0, 2])
    _set_token(tmp_path, layout, 1, victim, 2, (good + 1) % vocab)  # still a valid token id
    with pytest.raises(ReplacementStoreError) as refused:
        _resume(tmp_path, layout, replay)
    k, r = divmod(victim, layout.rows_per_shard)
    assert str(refused.value) == (
        f"{shard_path(tmp_path, 1, layout, k)}: row {r} (instance {victim}) does not match the "
        "checksum written with it (the shard changed on disk after the row was written); 1 "
        "such row(s); refusing to commit generation 1"
    )
    assert not os.path.exists(manifest_path(tmp_path, 1))
    # The same interruption without the change commits what an uninterrupted writer commits.
    clean, reference = tmp_path / "clean", tmp_path / "reference"
    _, replay = _interrupted(clean, layout)
    assert _resume(clean, layout, replay).shards == _write_all(reference, layout, 1).shards


def test_a_changed_checksum_or_a_row_moved_to_another_instance_is_refused(tmp_path):
    layout = StoreLayout(num_instances=20, width=3, vocab_size=500, num_shards=1)
    written, replay = _interrupted(tmp_path, layout)
    a, b = sorted(int(i) for i in np.concatenate(written)[:2])  # the replay leaves them
    shard, size = Path(shard_path(tmp_path, 1, layout, 0)), layout.record_bytes
    clean = shard.read_bytes()
    data = bytearray(clean)
    data[a * size : (a + 1) * size] = clean[b * size : (b + 1) * size]
    data[b * size : (b + 1) * size] = clean[a * size : (a + 1) * size]
    shard.write_bytes(bytes(data))
    with pytest.raises(ReplacementStoreError, match=rf"row {a} \(instance {a}\) does not match"):
        _resume(tmp_path, layout, replay)
    data = bytearray(shard.read_bytes())  # the replay's rows, the two rows in place again
    data[a * size : (a + 1) * size] = clean[a * size : (a + 1) * size]
    data[b * size : (b + 1) * size] = clean[b * size : (b + 1) * size]
    data[(a + 1) * size - 1] ^= 0x10  # a bit of the checksum alone
    shard.write_bytes(bytes(data))
    with pytest.raises(ReplacementStoreError, match=rf"row {a} \(instance {a}\) does not match"):
        commit_generation(tmp_path, 1, layout)


def test_a_row_changed_after_the_commit_is_refused_when_read(tmp_path):
    layout = StoreLayout(num_instances=30, width=4, vocab_size=300, num_shards=2)
    _write_all(tmp_path, layout, generation=2)
    reader = GenerationReader(tmp_path, 2)  # verified
    good = int(_rows(np.array([17]), layout)[0, 0])
    _set_token(tmp_path, layout, 2, 17, 0, (good + 7) % 300)
    k, r = divmod(17, layout.rows_per_shard)
    with pytest.raises(ReplacementStoreError, match=rf"row {r} \(instance 17\) does not match"):
        reader.read(np.array([3, 17]))  # a worker's read, after the epoch start's verification
    np.testing.assert_array_equal(reader.read([3]), _rows(np.array([3]), layout))
    with pytest.raises(ReplacementStoreError, match=r"checksum mismatch \(crc32 "):
        GenerationReader(tmp_path, 2)


def test_every_single_token_change_changes_the_checksum():
    # Any delta of one slot is delta * (odd multiplier) != 0 mod 2^32: tried exhaustively
    # over the slots of random rows, with small, large and wrapping deltas.
    rng = np.random.default_rng(0)
    width = 7
    ids = rng.integers(0, 2**31, 50)
    rows = rng.integers(0, 2**32 - 1, (50, width), dtype=np.uint64).astype(np.uint32)
    base = rs.row_checksums(ids, rows)
    for delta in (1, 2, 3, 1 << 15, 1 << 16, 1 << 31, 2**32 - 1):
        for slot in range(width):
            changed = rows.copy()
            changed[:, slot] += np.uint32(delta % 2**32)  # wraps like a stored uint32
            assert (rs.row_checksums(ids, changed) != base).all(), (delta, slot)
    assert (rs.row_checksums(ids + 1, rows) != base).all()


def _reference_checksum(instance: int, tokens) -> int:
    """docs/replacement_store.md's row checksum, in Python integers (not the code's)."""
    m = [((k * 2654435761 + 40503) % 2**32) | 1 for k in range(len(tokens) + 1)]
    total = 0x5BD1E995 + instance * m[0] + sum(int(x) * m[j + 1] for j, x in enumerate(tokens))
    return total % 2**32


@pytest.mark.parametrize("vocab", [1000, 70_000])
def test_stored_rows_are_the_documented_format(tmp_path, vocab):
    # Bytes on disk against the documented format, computed independently: W little-endian
    # ids, then the little-endian checksum of (instance, ids). A change of the multipliers,
    # the constant or the byte order would make every store written before it look corrupt.
    layout = StoreLayout(num_instances=23, width=4, vocab_size=vocab, num_shards=2)
    _write_all(tmp_path, layout)
    itemsize = 2 if vocab <= 65535 else 4
    for k in range(layout.num_shards):
        data = Path(shard_path(tmp_path, 0, layout, k)).read_bytes()
        first, stop = layout.shard_range(k)
        assert len(data) == (stop - first) * (4 * itemsize + 4)
        for i in range(first, stop):
            row = data[(i - first) * (4 * itemsize + 4) :][: 4 * itemsize + 4]
            ids = [
                int.from_bytes(row[s : s + itemsize], "little")
                for s in range(0, 4 * itemsize, itemsize)
            ]
            assert ids == _rows([i], layout)[0].tolist()
            assert int.from_bytes(row[-4:], "little") == _reference_checksum(i, ids), i


def _set_tokens(root, layout, generation, instance, values: dict) -> None:
    for slot, value in values.items():
        _set_token(root, layout, generation, instance, slot, value)


@pytest.mark.parametrize("bit", [31, 30, 16])
def test_the_same_high_bit_flipped_in_two_ids_of_a_row_is_refused(tmp_path, bit):
    # Two ids of a row changed by 2^31 each change a checksum mod 2^32 by 2^31 * (m_j + m_k),
    # a multiple of 2^32 for any odd multipliers: the checksum cannot see it. Such ids are
    # >= the vocabulary size, which no writer stores: that is checked as well.
    layout = StoreLayout(num_instances=20, width=6, vocab_size=70_000, num_shards=1)
    written, replay = _interrupted(tmp_path, layout)
    victim = int(written[0][0])
    good = _rows(np.array([victim]), layout)[0]
    changed = {j: int(good[j]) ^ (1 << bit) for j in (1, 4)}
    _set_tokens(tmp_path, layout, 1, victim, changed)
    with pytest.raises(ReplacementStoreError) as refused:
        _resume(tmp_path, layout, replay)
    assert str(refused.value) == (
        f"{shard_path(tmp_path, 1, layout, 0)}: row {victim} (instance {victim}) holds token id "
        f"{changed[1]}, not below the vocabulary size 70000 (the shard changed on disk after "
        "the row was written); 1 such row(s); refusing to commit generation 1"
    )
    # The same rows after a commit: refused when read.
    _set_tokens(tmp_path, layout, 1, victim, dict(enumerate(good.tolist())))
    _resume(tmp_path, layout, [])
    reader = GenerationReader(tmp_path, 1)
    _set_tokens(tmp_path, layout, 1, victim, changed)
    with pytest.raises(ReplacementStoreError, match=rf"holds token id {changed[1]}, not below"):
        reader.read(np.array([victim]))

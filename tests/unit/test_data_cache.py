"""The on-disk index cache (data/cache.py) under crashes: every file is fsynced before it is
renamed into place and the directory after, and a file that is cut short anyway (an empty
.npy after a power cut) is rebuilt, never trusted."""

from __future__ import annotations

import os

import numpy as np

from megatron_taco.data.cache import load_or_build


def _build(calls):
    def build():
        calls.append(1)
        return {"x": np.arange(1000) * 3, "y": np.ones(7)}, {"n": 1000}

    return build


def test_a_truncated_or_empty_array_file_is_rebuilt(tmp_path):
    calls = []
    first = load_or_build("probe", {"v": 1}, ("x", "y"), _build(calls), str(tmp_path))
    assert first.status == "built" and len(calls) == 1
    again = load_or_build("probe", {"v": 1}, ("x", "y"), _build(calls), str(tmp_path))
    assert again.status == "loaded" and len(calls) == 1
    for cut in (0, 100):  # empty (renamed before its data reached the disk), or cut short
        with open(first.paths["x"], "r+b") as f:
            f.truncate(cut)
        entry = load_or_build("probe", {"v": 1}, ("x", "y"), _build(calls), str(tmp_path))
        assert entry.status == "built"
        assert np.array_equal(entry.arrays["x"], np.arange(1000) * 3)
    assert len(calls) == 3


def test_files_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    entry = load_or_build("probe", {"v": 2}, ("x", "y"), _build([]), str(tmp_path))
    for path in entry.paths.values():
        (at,) = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == path]
        src = events[at][1]
        assert ("fsync", src) in events[:at]  # its data is on disk before it has its name
        assert ("fsync", str(tmp_path)) in events[at + 1 :]  # and so is the name
    assert os.stat(entry.paths["x"]).st_mode & 0o044  # readable by the group and others

"""Checkpoints under crashes and damage: pretrain_taco.py on 2 ranks (forked as torchrun starts
them; the launchers themselves are tested in test_pretrain_taco.py and test_preemption.py),
tiny TACO, ZeRO-1 fp32, tp 1 x dp 2, a checkpoint every 2 iterations, resumed from the
session's taco_checkpoint (iterations 2 and 4):

* kill -9 at several points of a save (MEGATRON_TACO_TEST_KILL_AT), including while an
  iteration the tracker names is saved again after a --ckpt-step rollback: "latest" always
  names a checkpoint that verifies, and the next run resumes from it;
* --load-fallback resumes from the last complete checkpoint when the tracker's is corrupt,
  or verifies but does not fit the model (one line without it);
* a corrupt, truncated or missing file, a malicious pickle (also with --finetune
  --no-load-rng), a garbage tracker, a truncated .bin and an unusable --save are one line
  and exit 2 before any process group;
* a full disk (a small tmpfs, else a file-size limit) fails the save with the path and the
  free space, removes the partial directory and keeps the previous checkpoint as latest;
* a second run on a --save in use is one line naming the first; a killed run's lock is taken
  over by the next run.
"""

from __future__ import annotations

import json
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_taco.checkpoint.layout import METADATA_FILENAME, TRACKER_FILENAME
from megatron_taco.checkpoint.manifest import manifest_entry as _manifest_entry
from megatron_taco.checkpoint.manifest import verify_checkpoint
from megatron_taco.checkpoint.manifest import write_metadata as _write_metadata
from megatron_taco.checkpoint.safe_files import safe_torch_load
from megatron_taco.cli.pretrain_taco import main as taco_main
from megatron_taco.runtime.faults import KILL_ENV
from tests.helpers import (
    ENV,
    REPO,
    ZERO1_FP32,
    deepspeed_command,
    tiny_pretrain_args,
    train_records,
)
from tests.helpers import launch as ranks

pytestmark = pytest.mark.e2e


def taco_args(dataset, save: Path, *extra: str) -> list[str]:
    """taco_checkpoint's flags (its --train-iters given in ``extra``)."""
    return tiny_pretrain_args(dataset, save, "--deepspeed-config", ZERO1_FP32, *extra)


def launch(dataset, save: Path, *extra: str, kill_at: str | None = None, preexec=None):
    """2 ranks; ``preexec``: run in the launcher first (a resource limit), so through the
    real deepspeed launcher."""
    env = {KILL_ENV: kill_at} if kill_at is not None else {}
    argv = taco_args(dataset, save, *extra)
    if preexec is None:
        return ranks("pretrain_taco.py", *argv, world=2, env=env, check=False)
    cmd = deepspeed_command("pretrain_taco.py", *argv)
    return subprocess.run(
        cmd,
        cwd=REPO,
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=preexec,
    )


def show(res) -> str:
    return f"--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}"


def tracker(save: Path) -> int:
    return int((save / TRACKER_FILENAME).read_text())


def errors(res) -> set[str]:
    return {line for line in res.stderr.splitlines() if "pretrain_taco.py: error:" in line}


@pytest.fixture(scope="module")
def base(taco_checkpoint) -> Path:
    """Iterations 2 and 4 saved by a 2-rank run (copied before any change)."""
    assert tracker(taco_checkpoint) == 4
    return taco_checkpoint


def copy_of(base: Path, tmp_path: Path) -> Path:
    save = tmp_path / "ckpt"
    shutil.copytree(base, save)
    return save


def iter_dirs(save: Path) -> list[str]:
    return sorted(p.name for p in save.iterdir() if p.name.startswith("iter_"))


def test_kill_9_at_any_point_of_a_save_leaves_latest_loadable(botchan_dataset, base, tmp_path):
    save = copy_of(base, tmp_path)
    shutil.rmtree(save / "iter_0000004")
    (save / TRACKER_FILENAME).write_text("2\n")
    resume = ("--load", str(save), "--train-iters", "4")
    # Partial files, then a complete but unnamed directory: latest stays at 2.
    for point in ("after_model_files", "after_metadata"):
        res = launch(botchan_dataset, save, *resume, kill_at=f"{point}@4")
        assert res.returncode != 0, show(res)
        assert f"resumed from {save} at iteration 2" in res.stdout, show(res)
        assert tracker(save) == 2 and "iter_0000004" not in iter_dirs(save), point
        verify_checkpoint(str(save), 2)
    # Renamed into place, killed before the tracker: latest still 2, 4 complete.
    res = launch(botchan_dataset, save, *resume, kill_at="after_rename@4")
    assert res.returncode != 0 and tracker(save) == 2, show(res)
    verify_checkpoint(str(save), 2)
    verify_checkpoint(str(save), 4)
    # Saved again over the complete 4 (swapped in whole), killed after the tracker.
    res = launch(botchan_dataset, save, *resume, kill_at="after_tracker@4")
    assert res.returncode != 0 and tracker(save) == 4, show(res)
    verify_checkpoint(str(save), 4)
    # The rollback of the issue: the tracker names 4, --ckpt-step 2 saves 4 again (with
    # another --lr, so the new 4 differs), killed between the swap and the tracker.
    res = launch(botchan_dataset, save, *resume, "--ckpt-step", "2", "--lr", "5e-4",
                 kill_at="after_rename@4")  # fmt: skip
    assert res.returncode != 0 and tracker(save) == 4, show(res)
    meta = verify_checkpoint(str(save), 4)
    assert meta["configs"]["training"]["lr"] == 5e-4
    # The next run resumes from "latest" and cleans up what the crashes left behind.
    metrics = tmp_path / "m.jsonl"
    res = launch(botchan_dataset, save, "--load", str(save), "--train-iters", "6",
                 "--lr", "5e-4", "--metrics-file", str(metrics))  # fmt: skip
    assert res.returncode == 0, show(res)
    assert f"resumed from {save} at iteration 4" in res.stdout
    assert sorted(train_records(metrics)) == [5, 6] and tracker(save) == 6
    assert iter_dirs(save) == ["iter_0000002", "iter_0000004", "iter_0000006"]


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 4096] = np.random.default_rng(1).bytes(4096)
    path.write_bytes(bytes(data))


def test_corrupt_model_file_is_refused_before_rendezvous_or_fallen_back_from(
    botchan_dataset, base, tmp_path
):
    save = copy_of(base, tmp_path)
    model = save / "iter_0000004" / "mp_rank_00_model_states.pt"
    _corrupt(model)
    res = launch(botchan_dataset, save, "--load", str(save), "--train-iters", "4")
    assert res.returncode == 2, show(res)
    assert "world size 2" not in res.stdout  # stopped before the process groups
    (line,) = errors(res)  # the same one line from both ranks
    assert "checkpoint iteration 4 (named by " in line
    assert f"is incomplete or corrupt: {model} is corrupt: CRC-32" in line
    assert "the last complete checkpoint there is iteration 2: pass --ckpt-step 2" in line
    metrics = tmp_path / "m.jsonl"
    res = launch(botchan_dataset, save, "--load", str(save), "--train-iters", "4",
                 "--load-fallback", "--metrics-file", str(metrics))  # fmt: skip
    assert res.returncode == 0, show(res)
    assert "--load-fallback: loading iteration 2 instead" in res.stderr
    assert f"resumed from {save} at iteration 2" in res.stdout
    assert sorted(train_records(metrics)) == [3, 4]
    verify_checkpoint(str(save), 4)  # the corrupt 4 was replaced by a good one


def test_a_checkpoint_that_does_not_fit_the_model_is_one_line_or_fallen_back_from(
    botchan_dataset, base, tmp_path
):
    # The fault: a loadable model file with other keys, its manifest re-signed.
    save = copy_of(base, tmp_path)
    model = save / "iter_0000004" / "mp_rank_00_model_states.pt"
    states = safe_torch_load(str(model))
    key = next(iter(states["module"]))
    states["module"][f"{key}_renamed"] = states["module"].pop(key)
    torch.save(states, model)
    _resign(model.parent)
    verify_checkpoint(str(save), 4)
    res = launch(botchan_dataset, save, "--load", str(save), "--train-iters", "4")
    assert res.returncode == 2, show(res)
    (line,) = errors(res)  # the same one line from both ranks
    assert f"--load: {model} does not fit this model: it lacks {key}; it has {key}_renamed" in line
    assert "the last complete checkpoint there is iteration 2: pass --ckpt-step 2" in line
    assert "Traceback" not in res.stderr
    res = launch(botchan_dataset, save, "--load", str(save), "--train-iters", "4",
                 "--load-fallback", "--metrics-file", str(tmp_path / "m.jsonl"))  # fmt: skip
    assert res.returncode == 0, show(res)
    assert "--load-fallback: loading iteration 2 instead" in res.stderr
    assert f"resumed from {save} at iteration 2" in res.stdout


def _resign(iter_dir: Path) -> None:
    """A manifest that matches the files, as a tool (or an attacker) would write it."""
    meta = json.loads((iter_dir / METADATA_FILENAME).read_text())
    files = {name: _manifest_entry(str(iter_dir / name)) for name in meta.pop("files")}
    meta.pop("checksum")
    _write_metadata(str(iter_dir), meta, files)


def _plant(path: Path, marker: Path) -> None:
    class Marker:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"module": Marker()}, path)
    _resign(path.parent)


def test_damaged_files_are_one_line_before_any_process_group(
    botchan_dataset, base, tmp_path, capsys, monkeypatch
):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    iter_dir = "iter_0000004"
    names = sorted(p.name for p in (base / iter_dir).iterdir())
    marker = tmp_path / "marker"

    def refused(save: Path, *extra: str, **kw) -> str:
        # In-process on purpose: main() must return before any process group exists.
        args = taco_args(botchan_dataset, tmp_path / "out", "--train-iters", "4", *extra)
        assert taco_main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("pretrain_taco.py: error: "), err
        assert not torch.distributed.is_initialized()
        return err[0]

    load_flags = ("--finetune", "--no-load-rng")  # world size 1 here: resume flags for 2 ranks
    for name in names:
        save = copy_of(base, tmp_path / f"pickle_{name}")
        if name.endswith(".pt"):
            _plant(save / iter_dir / name, marker)
            line = refused(save, "--load", str(save), *load_flags)
            assert f"{save / iter_dir / name} holds pickled objects other than tensors" in line
        (save / iter_dir / name).write_bytes((save / iter_dir / name).read_bytes()[:-10])
        line = refused(save, "--load", str(save), *load_flags)
        assert str(save / iter_dir / name) in line, line
        (save / iter_dir / name).unlink()
        line = refused(save, "--load", str(save), *load_flags)
        assert str(save / iter_dir / name) in line and "missing" in line, line
    assert not marker.exists()
    assert len(names) == 6  # metadata, model, 2 optimizer partitions, 2 RNG files
    save = copy_of(base, tmp_path / "tracker")
    (save / TRACKER_FILENAME).write_text("garbage")
    assert "must hold an iteration number" in refused(save, "--load", str(save), *load_flags)
    (tmp_path / "file").write_text("x")
    bad_save = ["--save", str(tmp_path / "file" / "ckpt")]
    assert "--save: cannot create" in refused(tmp_path, *bad_save)


def test_truncated_data_file_is_one_line(botchan_dataset, tmp_path, capsys):
    prefix = tmp_path / "data"
    shutil.copy(botchan_dataset["prefix"] + ".idx", str(prefix) + ".idx")
    data = Path(botchan_dataset["prefix"] + ".bin").read_bytes()
    Path(str(prefix) + ".bin").write_bytes(data[:-8])
    dataset = {**botchan_dataset, "prefix": str(prefix)}
    assert taco_main(taco_args(dataset, tmp_path / "out", "--train-iters", "2")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pretrain_taco.py: error: --data-path: {prefix}.bin: data file ")
    assert "truncated" in err and "\n" not in err


def _small_disk(path: Path, size: int) -> bool:
    """A tmpfs of ``size`` bytes at ``path`` when this process may mount one."""
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True)  # fmt: skip
    return res.returncode == 0


def test_full_disk_fails_the_save_cleanly(botchan_dataset, base, tmp_path):
    disk = tmp_path / "disk"
    used = sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
    mounted = _small_disk(disk, used + 2**20)
    try:
        save = copy_of(base, disk)
        preexec = None
        if mounted:  # fill it, leaving room for the start-up write test only
            free = shutil.disk_usage(disk).free
            (disk / "filler").write_bytes(b"\0" * (free - 64 * 1024))
        else:  # a file-size limit instead: every file larger than 256 KiB fails to write

            def preexec():
                resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

        res = launch(botchan_dataset, save, "--load", str(save), "--train-iters", "6",
                     "--metrics-file", str(tmp_path / "m.jsonl"), preexec=preexec)  # fmt: skip
        assert res.returncode == 1, show(res)
        (line,) = errors(res)  # the same one line from both ranks
        assert "saving checkpoint iteration 6 failed: " in line
        assert f"{save}/iter_0000006.tmp-" in line and "MiB free there" in line
        assert f"{save / TRACKER_FILENAME} still names iteration 4" in line
        assert tracker(save) == 4 and iter_dirs(save) == ["iter_0000002", "iter_0000004"]
        verify_checkpoint(str(save), 4)
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


def test_a_second_run_on_one_save_is_refused_and_a_killed_ones_lock_taken_over(
    botchan_dataset, tmp_path
):
    # Plain python (rank 0 alone): the lock is rank 0's whatever the launcher.
    save, log = tmp_path / "ckpt", tmp_path / "first.log"

    def command(*extra: str) -> list[str]:
        return [sys.executable, "pretrain_taco.py", *taco_args(botchan_dataset, save, *extra)]

    with open(log, "w") as out:
        first = subprocess.Popen(command("--train-iters", "2000"), cwd=REPO, env=ENV, stdout=out,
                                 stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (save / TRACKER_FILENAME).exists():  # its first save, at iteration 2
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        second = subprocess.run(command("--train-iters", "2000"), cwd=REPO, env=ENV,
                                capture_output=True, text=True, timeout=240)  # fmt: skip
        assert second.returncode == 2, show(second)
        assert errors(second) == {
            f"pretrain_taco.py: error: --save: {save} is in use by another run (pid {first.pid} "
            f"on host {socket.gethostname()}, since {lock_record(save)['since']}; "
            f"{save / 'run.lock'}): wait for it to end, or give another --save"
        }, show(second)
        assert "Traceback" not in second.stderr and first.poll() is None
    finally:
        first.kill()  # kill -9: its lock's record stays behind
        first.wait()
    assert lock_record(save)["pid"] == first.pid
    stopped = tracker(save)
    res = subprocess.run(command("--load", str(save), "--train-iters", str(stopped + 1)),
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert res.returncode == 0, show(res)
    assert f"was held by pid {first.pid} on host {socket.gethostname()}" in res.stderr
    assert "which is no longer running; taking it over" in res.stderr
    assert f"resumed from {save} at iteration {stopped}" in res.stdout
    assert not (save / "run.lock").exists()


def lock_record(save: Path) -> dict:
    return json.loads((save / "run.lock").read_text())

"""Checkpoints under faults and hostile input (issue 15), on checkpoints saved by a real
DeepSpeed engine (one gloo rank, ZeRO-1):

* the manifest schema is strict: no missing field, null entry or wrong type skips a check;
* symbolic links, FIFOs, devices and symlinked directories in a checkpoint are refused by
  name, without blocking;
* any failure to verify (an I/O error, a file vanishing, a crafted pickle that breaks the
  unpickler) is one line naming the file, and --load-fallback falls back from it;
* a checkpoint of another model kind is named as such before anything else;
* a clean-up that fails after the tracker names the new checkpoint is a warning, not a
  failed save.
"""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import shutil
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from megatron_taco.checkpoint import errors, layout, manifest, safe_files
from megatron_taco.checkpoint import save as ckpt_save
from megatron_taco.checkpoint.errors import CheckpointInvalid
from megatron_taco.checkpoint.layout import METADATA_FILENAME, TRACKER_FILENAME, TrainingState
from megatron_taco.checkpoint.save import save_checkpoint
from megatron_taco.errors import ConfigError
from megatron_taco.training.config import TrainingConfig
from tests.helpers import chosen, run_distributed

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
MODEL_FILE = "mp_rank_00_model_states.pt"


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, batch):
        logits = self.out(self.embed(batch["tokens"]))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), (batch["tokens"] % 8).flatten())
        return {"loss": loss}


def _engine(save: str, parallel):
    from megatron_taco.training.deepspeed_config import (
        load_deepspeed_json,
        resolve_deepspeed_config,
    )
    from megatron_taco.training.engine import initialize_engine

    training = TrainingConfig(
        train_iters=4,
        micro_batch_size=2,
        lr=1e-2,
        lr_warmup_iters=1,
        eval_iters=0,
        progress_bar=False,
    )
    ds_json = load_deepspeed_json(str(REPO / "ds_configs" / "zero1_fp32.json"))
    settings = resolve_deepspeed_config(training, parallel.dp_size, device_type="cpu",
                                        ds_json=ds_json)  # fmt: skip
    torch.manual_seed(0)
    return initialize_engine(ToyModel(), training, settings, parallel).model_engine


def _save_worker(rank, world_size, save):
    from megatron_taco.parallel.state import init_parallel

    parallel = init_parallel(1)
    engine = _engine(save, parallel)
    for it in (6, 8):
        save_checkpoint(engine, save, TrainingState(it, 4 * it), parallel,
                        metadata={"model": "TOY"})  # fmt: skip
    return sorted(os.listdir(save))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("faults") / "ckpt"
    run_distributed(_save_worker, 1, str(save))
    return save


@pytest.fixture
def load(saved, tmp_path) -> Path:
    """A fresh copy: checkpoints 6 and 8, the tracker naming 8."""
    out = tmp_path / "load"
    shutil.copytree(saved, out)
    return out


def _meta_path(load: Path, it: int = 8) -> Path:
    return load / f"iter_{it:07d}" / METADATA_FILENAME


def _rewrite(load: Path, change, *, checksum: bool = True, it: int = 8) -> None:
    """Change metadata.json as a writer would: with a checksum that matches (or none)."""
    meta = json.loads(_meta_path(load, it).read_text())
    meta.pop("checksum")
    change(meta)
    if checksum:
        meta["checksum"] = manifest.metadata_checksum(meta)
    _meta_path(load, it).write_text(json.dumps(meta))


def _refused(load: Path, fragment: str) -> str:
    with pytest.raises(CheckpointInvalid) as e:
        chosen(str(load), None)
    msg = str(e.value)
    assert "\n" not in msg and fragment in msg, msg
    assert "the last complete checkpoint there is iteration 6: pass --ckpt-step 6" in msg, msg
    assert chosen(str(load), None, fallback=True) == 6
    return msg


# ---------------------------------------------------------------------------------------
# 3. A strict manifest schema


def _entry(name):
    return lambda m: m["files"].__setitem__(name, None)


SCHEMA_HOLES = {
    "no checksum": (lambda m: None, False, "lacks the field 'checksum'"),
    "no files": (lambda m: m.pop("files"), True, "lacks the field 'files'"),
    "null entry": (_entry(MODEL_FILE), True, f"manifest entry of {MODEL_FILE!r}"),
    "null entry outside": (
        lambda m: m["files"].__setitem__("../../etc/passwd", None),
        True,
        "lists a file outside the checkpoint: '../../etc/passwd'",
    ),
    "no crc": (lambda m: m["files"][MODEL_FILE].pop("crc32"), True, "manifest entry of"),
    "bool size": (lambda m: m["files"][MODEL_FILE].update(bytes=True), True, "manifest entry"),
    "iteration as text": (lambda m: m.update(iteration="8"), True, "field 'iteration' must be"),
    "other format": (lambda m: m.update(format="other/9"), True, "format 'other/9'"),
}


@pytest.mark.parametrize("hole", sorted(SCHEMA_HOLES))
def test_manifest_schema_is_strict(load, hole):
    change, checksum, fragment = SCHEMA_HOLES[hole]
    _rewrite(load, change, checksum=checksum)
    _refused(load, fragment)


# ---------------------------------------------------------------------------------------
# 3 (and 2). Links, FIFOs and devices: refused by name, never followed, never blocking


def _bounded(fn, seconds: float = 20.0):
    """fn() in a daemon thread: a verification that blocks (a FIFO, /dev/zero) fails the
    test instead of hanging it."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"verification still running after {seconds} s (blocked)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _link_to_copy(path: Path, outside: Path) -> None:
    """The same bytes, but reached through a symbolic link to a file outside the checkpoint."""
    shutil.copy(path, outside)
    path.unlink()
    path.symlink_to(outside)


def _fifo(path: Path, _outside: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path, _outside: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _symlinked_dir(path: Path, outside: Path) -> None:
    """An unlisted file hidden behind a symlinked directory (os.walk does not descend)."""
    outside.mkdir()
    (outside / "payload.pt").write_bytes(b"x")
    (path.parent / "sub").symlink_to(outside, target_is_directory=True)


LINKS = {
    "symlink to a copy": (_link_to_copy, "is a symbolic link, not a regular file"),
    "fifo": (_fifo, "is a FIFO, not a regular file"),
    "symlink to /dev/zero": (_dev_zero, "is a symbolic link, not a regular file"),
    "symlinked directory": (_symlinked_dir, "sub is a symbolic link"),
}


@pytest.mark.parametrize("case", sorted(LINKS))
def test_links_fifos_and_devices_are_refused_without_blocking(load, tmp_path, case):
    plant, fragment = LINKS[case]
    path = load / "iter_0000008" / MODEL_FILE
    plant(path, tmp_path / "outside")
    msg = _bounded(lambda: _refused_message(load))
    assert fragment in msg, msg
    assert _bounded(lambda: chosen(str(load), None, fallback=True)) == 6


def _refused_message(load: Path) -> str:
    try:
        chosen(str(load), None)
    except CheckpointInvalid as e:
        return str(e)
    return "accepted"


def test_a_symlinked_checkpoint_directory_or_tracker_is_refused(load, tmp_path):
    moved = tmp_path / "elsewhere"
    shutil.move(load / "iter_0000008", moved)
    (load / "iter_0000008").symlink_to(moved, target_is_directory=True)
    assert "iter_0000008 is a symbolic link" in _refused_message(load)
    (load / "iter_0000008").unlink()
    shutil.move(moved, load / "iter_0000008")
    (load / TRACKER_FILENAME).unlink()
    os.mkfifo(load / TRACKER_FILENAME)
    with pytest.raises(ConfigError, match="latest_checkpointed_iteration.txt is a FIFO"):
        _bounded(lambda: chosen(str(load), None))
    assert _bounded(lambda: chosen(str(load), None, fallback=True)) == 8


# ---------------------------------------------------------------------------------------
# 4. Any failure to verify is a verification failure: one line, and a fallback


@pytest.fixture
def failing_open(monkeypatch):
    """Make opening one file fail with ``errno`` (EIO: a disk or NFS error; ENOENT: the
    file vanished between the directory listing and the read)."""
    state = {}
    real_os_open, real_open = os.open, builtins.open

    def check(path):
        if state and str(path).endswith(state["suffix"]) and state["times"] != 0:
            state["times"] -= 1
            if state["errno"] == errno.ENOENT and os.path.lexists(path):
                os.unlink(path)
            raise OSError(state["errno"], os.strerror(state["errno"]), str(path))

    def fake_os_open(path, *args, **kwargs):
        check(path)
        return real_os_open(path, *args, **kwargs)

    def fake_open(path, *args, **kwargs):
        if isinstance(path, (str, os.PathLike)):
            check(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(builtins, "open", fake_open)

    def arm(suffix: str, code: int, times: int = -1) -> None:
        """The next ``times`` opens fail (-1: every one)."""
        state.update(suffix=suffix, errno=code, times=times)

    return arm


def test_a_file_vanishing_while_verifying_is_fallen_back_from(load, failing_open):
    failing_open(f"iter_0000008/{MODEL_FILE}", errno.ENOENT)
    assert "is missing" in _refused(load, f"iter_0000008/{MODEL_FILE}")


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE])
@pytest.mark.parametrize("where", [MODEL_FILE, METADATA_FILENAME])
def test_io_errors_are_retried_then_stop_without_a_fallback(
    load, failing_open, monkeypatch, caplog, code, where
):
    # Issue 27 item 2: unreadable now is not corrupt: the newer checkpoint is never skipped
    # (a fallback would then let training replace it, or retention delete it).
    monkeypatch.setattr(layout, "IO_RETRY_DELAYS", (0.0, 0.0))
    path = load / "iter_0000008" / where
    failing_open(f"iter_0000008/{where}", code, times=2)  # a transient error: retried
    with caplog.at_level(logging.WARNING, logger="megatron_taco.checkpoint"):
        assert chosen(str(load), None) == 8
    assert caplog.text.count(f"{path}: {os.strerror(code)}; retrying") == 2
    failing_open(f"iter_0000008/{where}", code)  # and one that lasts
    for fallback in (False, True):
        with pytest.raises(errors.CheckpointUnreadable) as e:
            chosen(str(load), None, fallback=fallback)
        assert str(e.value) == (
            f"--load: {path} cannot be read ({os.strerror(code)}; 3 attempts): an I/O error is "
            "not a corrupt checkpoint, so no older one is loaded instead; rerun once the file "
            "system answers, or pass --ckpt-step N to load another on purpose"
        )
    assert not isinstance(e.value, CheckpointInvalid)


def test_a_checkpoint_of_a_newer_format_says_upgrade_and_is_never_skipped(load):
    _rewrite(load, lambda m: m.update(format="megatron_taco/3", files="a new layout"))
    for fallback in (False, True):
        with pytest.raises(errors.CheckpointTooNew) as e:
            chosen(str(load), None, fallback=fallback)
        assert str(e.value) == (
            f"--load: {_meta_path(load)} was written by a newer megatron_taco (format "
            "'megatron_taco/3', this version reads 'megatron_taco/2'): upgrade megatron_taco "
            "to load it (no older checkpoint is loaded instead)"
        )
    # Nor skipped on the way to an older one (the tracker names 6 after a rollback).
    (load / TRACKER_FILENAME).write_text("9\n")
    with pytest.raises(errors.CheckpointTooNew):
        chosen(str(load), None, fallback=True)


def test_store_clean_up_keeps_what_checkpoints_it_cannot_read_may_need(
    load, failing_open, monkeypatch
):
    from megatron_taco.recipes.sas_augmentation import generations_needed

    # Checkpoints 6 and 8 took 24 and 32 samples: with 10 per epoch, epochs 2 and 3.
    assert generations_needed(str(load), 10) == {1, 2, 3}
    _rewrite(load, lambda m: m.update(iteration=9), checksum=False)  # proven corrupt
    assert generations_needed(str(load), 10) == {1, 2}  # it needs nothing
    monkeypatch.setattr(layout, "IO_RETRY_DELAYS", ())
    failing_open(f"iter_0000006/{METADATA_FILENAME}", errno.EIO)
    with pytest.raises(errors.CheckpointUnreadable):
        generations_needed(str(load), 10)  # not "needs nothing": the caller keeps them all


def _craft(path: Path, pickle_bytes: bytes) -> None:
    """Replace the pickle of a torch zip file, keeping its tensors (and fix the manifest,
    as an attacker would)."""
    with zipfile.ZipFile(path) as zi:
        entries = {n: zi.read(n) for n in zi.namelist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zo:
        for name, data in entries.items():
            zo.writestr(name, pickle_bytes if name.endswith("/data.pkl") else data)


CRAFTED = {
    "memo KeyError": b"\x80\x02h\x05.",  # BINGET of a memo slot never set
    "short BININT (struct.error)": b"\x80\x02J\x01\x02",
    "empty stack (IndexError)": b"\x80\x02t.",  # TUPLE with no MARK before it
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_pickles_are_verification_failures(load, case):
    iter_dir = load / "iter_0000008"
    _craft(iter_dir / MODEL_FILE, CRAFTED[case])

    def fix_manifest(meta):
        meta["files"][MODEL_FILE] = manifest.manifest_entry(str(iter_dir / MODEL_FILE))

    _rewrite(load, fix_manifest)
    _refused(load, f"{iter_dir / MODEL_FILE} is not a readable torch checkpoint")


def test_safe_torch_load_turns_any_unpickling_error_into_one_line(load):
    path = load / "iter_0000008" / MODEL_FILE
    for data in CRAFTED.values():
        _craft(path, data)
        with pytest.raises(ConfigError, match=f"^--load: {path} is not a readable checkpoint"):
            safe_files.safe_torch_load(str(path))


# ---------------------------------------------------------------------------------------
# A checkpoint of another model kind: named first, in one line


def test_another_model_kind_is_named_before_anything_else(load):
    # Even with a corrupt file in it: the kind is what the user must hear about first.
    path = load / "iter_0000008" / MODEL_FILE
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ConfigError) as e:
        chosen(str(load), None, models=("SAS",), fallback=True)
    msg = str(e.value)
    assert not isinstance(e.value, CheckpointInvalid)
    assert msg.startswith(f"--load: {load / 'iter_0000008'} is a TOY checkpoint"), msg
    assert "this run loads SAS checkpoints" in msg and "\n" not in msg
    assert chosen(str(load), None, models=("TOY", "SAS"), fallback=True) == 6


def test_model_kind_check_compares_names_only():
    meta = {"model": "SAS-GLUE"}
    manifest.check_model_kind(meta, "ckpt/iter_0000001", ("SAS-GLUE",))
    with pytest.raises(ConfigError, match="does not name the model that saved it"):
        manifest.check_model_kind({}, "ckpt/iter_0000001", ("TACO",))


# ---------------------------------------------------------------------------------------
# 6. A failure after the tracker names the new checkpoint


def _cleanup_worker(rank, world_size, save):
    from megatron_taco.parallel.state import init_parallel

    parallel = init_parallel(1)
    engine = _engine(save, parallel)
    for it in (1, 2):
        save_checkpoint(engine, save, TrainingState(it, it), parallel)

    def fail(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), f"{save}/iter_0000001")

    ckpt_save._retire = fail  # this spawned process only
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger(ckpt_save.__name__).addHandler(handler)
    try:
        path = save_checkpoint(engine, save, TrainingState(3, 3), parallel, retain=1)
        outcome = ("saved", path)
    except Exception as e:  # the old behaviour: reported as a failed save
        outcome = (type(e).__name__, str(e))
    return outcome, records, Path(save, TRACKER_FILENAME).read_text()


def test_failed_clean_up_after_the_tracker_is_a_warning(tmp_path):
    save = tmp_path / "ckpt"
    outcome, records, tracker = run_distributed(_cleanup_worker, 1, str(save))[0]
    assert outcome == ("saved", str(save / "iter_0000003")), outcome
    assert tracker == "3\n"
    (line,) = [r for r in records if "iteration 3" in r]
    assert line.startswith("saved checkpoint iteration 3 (latest), but removing older ")
    assert "Permission denied" in line and "\n" not in line


# ---------------------------------------------------------------------------------------
# torch >= 2.6: the first release whose weights_only loading has no known bypass


def test_torch_older_than_2_6_is_refused(load, monkeypatch):
    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (torch_req,) = [Requirement(d) for d in project["dependencies"] if d.startswith("torch")]
    assert not torch_req.specifier.contains("2.5.1") and torch_req.specifier.contains("2.6.0")
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu121")
    with pytest.raises(ConfigError, match=r"^torch 2\.5\.1\+cu121: loading checkpoints safely"):
        safe_files.safe_torch_load(str(load / "iter_0000008" / MODEL_FILE))
    with pytest.raises(ConfigError, match="needs torch >= 2.6"):
        chosen(str(load), None)

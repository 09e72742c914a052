"""Checkpoints that are safe and whole, at the level of the checkpoint functions on real
DeepSpeed engines in real gloo process groups (tests.helpers.run_distributed):

* the manifest (size + CRC-32 of every file) and the metadata checksum; a truncated,
  corrupt, missing or unlisted file is one ConfigError naming the file, the iteration and
  the last complete iteration, and --load-fallback loads that one instead;
* a malicious pickle planted in each file of a checkpoint is refused by the loaders
  (weights_only=True, DeepSpeed's files through SafeCheckpointEngine) and by the opcode
  scan before any process group, and never runs;
* a write failing on one rank (ENOSPC) fails the save on every rank, removes the partial
  directory and leaves the tracker alone; re-saving the iteration the tracker names swaps
  the directory atomically; --save-retain; --save checked at start-up;
* a non-finite loss on one rank stops every rank before the step is saved.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from megatron_taco import io
from megatron_taco.checkpoint import manifest, rng, safe_files
from megatron_taco.checkpoint import save as ckpt_save
from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.checkpoint.errors import CheckpointInvalid, CheckpointSaveError
from megatron_taco.checkpoint.layout import METADATA_FILENAME, TRACKER_FILENAME, TrainingState
from megatron_taco.checkpoint.load import execute_plan, load_checkpoint
from megatron_taco.checkpoint.manifest import verify_checkpoint
from megatron_taco.checkpoint.ownership import check_save_dir
from megatron_taco.checkpoint.plan import (
    FALLBACK,
    FRESH,
    RESUME,
    WEIGHTS,
    ResumePlan,
    ResumeRequest,
    RunLayout,
    plan_resume,
)
from megatron_taco.checkpoint.save import save_checkpoint
from megatron_taco.errors import ConfigError
from megatron_taco.training.config import TrainingConfig
from tests.helpers import chosen, run_distributed

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
VOCAB, SEQ = 64, 12


class ToyModel(nn.Module):
    """A few parameters of both weight-decay groups; ``poison`` makes the loss NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 8)
        self.poison = False

    def forward(self, batch):
        logits = self.out(self.norm(self.embed(batch["tokens"]))).float()
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), (batch["tokens"] % 8).flatten())
        if self.poison:
            loss = loss * float("nan")
        return {"loss": loss, "mlm_loss": loss.detach()}


class ToyDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int):
        return {"tokens": torch.from_numpy(np.random.default_rng(index).integers(0, VOCAB, SEQ))}


def _collate(samples):
    return {"tokens": torch.stack([s["tokens"] for s in samples])}


class Marker:
    """Unpickling it creates ``path``: proof that a loader ran code from a checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _training(tmp: str, **kw) -> TrainingConfig:
    values = dict(
        train_iters=4,
        micro_batch_size=2,
        lr=1e-2,
        lr_warmup_iters=1,
        log_interval=1,
        eval_iters=0,
        progress_bar=False,
    )
    values.update(kw)
    return TrainingConfig(**values)


def _engine(training: TrainingConfig, parallel, stage: int = 1, model_class=None):
    from megatron_taco.training.deepspeed_config import (
        load_deepspeed_json,
        resolve_deepspeed_config,
    )
    from megatron_taco.training.engine import initialize_engine

    ds_json = load_deepspeed_json(str(REPO / "ds_configs" / f"zero{stage}_fp32.json"))
    settings = resolve_deepspeed_config(
        training, parallel.dp_size, device_type="cpu", ds_json=ds_json
    )
    torch.manual_seed(0)
    return initialize_engine((model_class or ToyModel)(), training, settings, parallel)


# DeepSpeed's recovery scripts, copied into --save (not into a checkpoint) at ZeRO saves.
RECOVERY_SCRIPTS = {"zero_to_fp32.py", "zero_to_torch.py"}


def _listing(path: str) -> list[str]:
    return sorted(set(os.listdir(path)) - RECOVERY_SCRIPTS)


# ---------------------------------------------------------------------------------------
# Two ranks, ZeRO-1: saves, a failing write on rank 1, a rollback re-save, retention, NaN.


def _failing_optimizer_writes(real):
    def write(path, fn):
        if "optim_states" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path, fn)

    return write


def _save_worker(rank, world_size, tmp):
    from megatron_taco.parallel.state import init_parallel

    parallel = init_parallel(1)
    engine = _engine(_training(tmp), parallel).model_engine
    save = os.path.join(tmp, "ckpt")
    out = {}
    for it in (2, 4):
        save_checkpoint(engine, save, TrainingState(it, 4 * it), parallel, metadata={"k": it})
    out["after_two"] = _listing(save)
    real = io.write_durably
    if rank == 1:  # a full disk for rank 1's optimizer partition only
        io.write_durably = _failing_optimizer_writes(real)
    try:
        save_checkpoint(engine, save, TrainingState(6, 24), parallel)
    except CheckpointSaveError as e:
        out["disk_full"] = str(e)
    io.write_durably = real
    out["after_failure"] = _listing(save)
    # Rollback: the tracker names 4 and iteration 4 is saved again (other data position).
    save_checkpoint(engine, save, TrainingState(4, 99), parallel)
    out["rollback_meta"] = manifest.read_metadata(os.path.join(save, "iter_0000004"))
    out["after_rollback"] = _listing(save)
    for it in (6, 8):
        save_checkpoint(engine, save, TrainingState(it, 4 * it), parallel, retain=2)
    out["after_retain"] = _listing(save)
    out["nan"] = _nan_run(parallel, tmp, poison_rank=1)
    return out


def _nan_run(parallel, tmp, poison_rank):
    from megatron_taco.checkpoint.config import CheckpointConfig
    from megatron_taco.training.callbacks import Callback
    from megatron_taco.training.loop import NonFiniteLossError, Trainer
    from megatron_taco.training.observability.log import TrainingLogger
    from megatron_taco.training.spec import ModelParts

    training = _training(os.path.join(tmp, "nan"), train_iters=5, global_batch_size=4)
    checkpoint = CheckpointConfig(save=os.path.join(tmp, "nan", "ckpt"), save_interval=1)
    engine = _engine(training, parallel)
    model = engine.model_engine.module

    class Poison(Callback):
        name = "poison"

        def on_save(self, trainer, state):
            # From the 3rd iteration on, rank ``poison_rank`` computes NaN losses.
            model.poison = state.iteration >= 2 and parallel.rank == poison_rank

    logger = TrainingLogger(rank=parallel.rank, train_iters=5, progress_bar=False)
    parts = ModelParts(
        model=model, collate_fn=_collate, train_dataset=ToyDataset(), callbacks=[Poison()]
    )
    try:
        Trainer(engine, parallel, training, parts, logger, checkpoint=checkpoint, seed=1).train(
            TrainingState()
        )
    except NonFiniteLossError as e:
        return str(e), _listing(checkpoint.save)
    finally:
        logger.close()
    return None, _listing(checkpoint.save)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("saves"))
    results = run_distributed(_save_worker, 2, tmp)
    return tmp, results


def test_save_writes_a_manifest_and_leaves_no_temporary_files(saved):
    tmp, results = saved
    assert results[0]["after_two"] == ["iter_0000002", "iter_0000004", TRACKER_FILENAME]
    iter_dir = os.path.join(tmp, "ckpt", "iter_0000008")
    meta = json.loads(Path(iter_dir, METADATA_FILENAME).read_text())
    files = {
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "rng_state_rank_00000.pt",
        "rng_state_rank_00001.pt",
    }
    assert set(meta["files"]) == files  # every rank's files, gathered by rank 0
    for name, entry in meta["files"].items():
        size, crc = safe_files.checksum_regular(os.path.join(iter_dir, name))
        assert entry == {"bytes": size, "crc32": crc}
    # The RNG file is tensors and numbers only: plain weights_only loading works.
    states = torch.load(os.path.join(iter_dir, "rng_state_rank_00001.pt"), weights_only=True)
    assert states["python"]["state"].shape == (625,) and states["numpy"]["keys"].shape == (624,)


def test_failed_write_on_one_rank_fails_the_save_everywhere(saved):
    tmp, results = saved
    save = os.path.join(tmp, "ckpt")
    messages = [r["disk_full"] for r in results]
    assert messages[0] == messages[1]  # the same one line on every rank
    msg = messages[0]
    assert "\n" not in msg and msg.startswith("saving checkpoint iteration 6 failed: ")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: No space left on device" in msg
    assert "MiB free there" in msg
    assert f"{save}/{TRACKER_FILENAME} still names iteration 4" in msg
    # The partial directory is gone and the tracker still names the previous checkpoint.
    assert results[0]["after_failure"] == ["iter_0000002", "iter_0000004", TRACKER_FILENAME]


def test_resaving_the_tracked_iteration_swaps_it_in_whole(saved):
    tmp, results = saved
    assert results[0]["rollback_meta"]["consumed_samples"] == 99
    assert results[0]["after_rollback"] == ["iter_0000002", "iter_0000004", TRACKER_FILENAME]
    # --save-retain 2 after saving 6 and 8: the two newest remain.
    assert results[0]["after_retain"] == ["iter_0000006", "iter_0000008", TRACKER_FILENAME]
    assert Path(tmp, "ckpt", TRACKER_FILENAME).read_text() == "8\n"
    verify_checkpoint(os.path.join(tmp, "ckpt"), 8)


def test_non_finite_loss_on_one_rank_stops_every_rank_unsaved(saved):
    _, results = saved
    (msg0, listing), (msg1, _) = results[0]["nan"], results[1]["nan"]
    assert msg0 == msg1 and msg0 is not None
    assert msg0.startswith("iteration 3: non-finite loss, mlm_loss in fp32 training")
    # Saved after iterations 1 and 2; the NaN step was never saved.
    assert listing == ["iter_0000001", "iter_0000002", TRACKER_FILENAME]


# ---------------------------------------------------------------------------------------
# Verification before any process group (on copies of the saved checkpoints)


@pytest.fixture
def two_checkpoints(saved, tmp_path):
    """A --load directory with complete checkpoints 6 and 8 (the tracker names 8)."""
    tmp, _ = saved
    load = tmp_path / "load"
    load.mkdir()
    src = Path(tmp, "ckpt")
    for it in ("iter_0000006", "iter_0000008"):
        shutil.copytree(src / it, load / it)
    (load / TRACKER_FILENAME).write_text("8\n")
    return load


def _model_file(load: Path) -> Path:
    return load / "iter_0000008" / "mp_rank_00_model_states.pt"


def _random_bytes_inside(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 3
    data[start : start + 4096] = np.random.default_rng(0).bytes(4096)
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-100]), "has"),
    "random_4k": (_random_bytes_inside, "is corrupt: CRC-32"),
    "missing": (lambda p: p.unlink(), "is missing"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_file_is_named_with_the_fallback(two_checkpoints, damage):
    load = two_checkpoints
    path = _model_file(load)
    size = path.stat().st_size
    DAMAGE[damage][0](path)
    with pytest.raises(CheckpointInvalid) as e:
        chosen(str(load), None)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"--load: checkpoint iteration 8 (named by {load / TRACKER_FILENAME}) is incomplete or "
        "corrupt: "
    )
    assert f"{path} {DAMAGE[damage][1]}" in msg
    if damage == "truncated":
        assert f"the manifest says {size} (truncated" in msg
    assert "the last complete checkpoint there is iteration 6: pass --ckpt-step 6" in msg
    assert chosen(str(load), None, fallback=True) == 6


def test_metadata_and_unlisted_files_are_checked(two_checkpoints):
    load = two_checkpoints
    meta = load / "iter_0000008" / METADATA_FILENAME
    text = meta.read_text()
    meta.write_text(text.replace('"consumed_samples": 32', '"consumed_samples": 31'))
    with pytest.raises(CheckpointInvalid, match="metadata.json does not match its checksum"):
        chosen(str(load), None)
    meta.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointInvalid, match="metadata.json is not valid JSON"):
        chosen(str(load), None)
    meta.write_text(text)
    (load / "iter_0000008" / "extra_model_states.pt").write_bytes(b"x")
    with pytest.raises(CheckpointInvalid, match="extra_model_states.pt is not in the manifest"):
        chosen(str(load), None)
    # Nothing older verifies either: said so.
    shutil.rmtree(load / "iter_0000006")
    with pytest.raises(CheckpointInvalid, match="no older checkpoint in .* verifies either$"):
        chosen(str(load), None, fallback=True)


def test_tracker_and_tensor_parallel_size_are_checked(two_checkpoints):
    load = two_checkpoints
    with pytest.raises(ConfigError, match="^--tensor-model-parallel-size: .*iter_0000008 was "):
        chosen(str(load), None, tp_size=2)
    (load / TRACKER_FILENAME).write_text("\0\0\0")
    with pytest.raises(ConfigError, match="must hold an iteration number"):
        chosen(str(load), None)
    assert chosen(str(load), None, fallback=True) == 8
    (load / TRACKER_FILENAME).write_text("7\n")
    with pytest.raises(CheckpointInvalid, match="iter_0000007 does not exist; the last complete "):
        chosen(str(load), None)


def _plant(path: Path, marker: Path) -> None:
    torch.save({"module": Marker(str(marker))}, path)


def _rewrite_manifest(iter_dir: Path) -> None:
    """As an attacker would: a manifest that matches the planted file."""
    meta = json.loads((iter_dir / METADATA_FILENAME).read_text())
    files = {name: manifest.manifest_entry(str(iter_dir / name)) for name in meta["files"]}
    del meta["files"], meta["checksum"]
    manifest.write_metadata(str(iter_dir), meta, files)


def test_opcode_scan_refuses_a_planted_pickle_before_any_process_group(two_checkpoints, tmp_path):
    load = two_checkpoints
    marker = tmp_path / "marker"
    iter_dir = load / "iter_0000008"
    for name in sorted(p.name for p in iter_dir.glob("*.pt")):
        original = (iter_dir / name).read_bytes()
        _plant(iter_dir / name, marker)
        _rewrite_manifest(iter_dir)
        with pytest.raises(CheckpointInvalid) as e:
            chosen(str(load), None)
        assert f"{iter_dir / name} holds pickled objects other than tensors" in str(e.value)
        assert "io.open" in str(e.value)
        (iter_dir / name).write_bytes(original)
        _rewrite_manifest(iter_dir)
    assert chosen(str(load), None) == 8
    assert not marker.exists()


# ---------------------------------------------------------------------------------------
# The loaders themselves (what runs after the checks): one rank, ZeRO-1.


def _malicious_worker(rank, world_size, tmp):
    from megatron_taco.parallel.state import init_parallel

    parallel = init_parallel(1)
    engine = _engine(_training(tmp), parallel).model_engine
    save = os.path.join(tmp, "ckpt")
    save_checkpoint(engine, save, TrainingState(3, 6), parallel)
    iter_dir = Path(save, "iter_0000003")
    marker = Path(tmp, "marker")
    names = sorted(p.name for p in iter_dir.iterdir())
    out = {"names": names, "refused": {}, "finetune": {}}
    for name in names:
        load = Path(tmp, f"load_{name}")
        shutil.copytree(save, load)
        _plant(load / "iter_0000003" / name, marker)
        for key, kwargs in (
            ("refused", {}),
            ("finetune", dict(weights_only=True, restore_rng=False)),
        ):
            try:
                load_checkpoint(engine, str(load), 3, parallel, **kwargs)
                out[key][name] = None
            except ConfigError as e:
                out[key][name] = str(e)
    out["marker"] = marker.exists()
    out["clean"] = load_checkpoint(engine, save, 3, parallel)
    return out


def test_loaders_refuse_a_malicious_pickle_in_each_file(tmp_path):
    out = run_distributed(_malicious_worker, 1, str(tmp_path))[0]
    assert out["names"] == [
        METADATA_FILENAME,
        "mp_rank_00_model_states.pt",
        "rng_state_rank_00000.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ]
    for name in out["names"]:
        msg = out["refused"][name]
        path = tmp_path / f"load_{name}" / "iter_0000003" / name
        assert msg is not None and str(path) in msg and "\n" not in msg, (name, msg)
        if name.endswith(".pt"):
            assert "holds pickled objects other than tensors, numbers and strings" in msg
            assert "io.open" in msg
    # --finetune --no-load-rng reads only the model file (and metadata.json).
    refused = {name for name, msg in out["finetune"].items() if msg is not None}
    assert refused == {METADATA_FILENAME, "mp_rank_00_model_states.pt"}
    assert out["marker"] is False  # nothing ever ran
    assert out["clean"] == TrainingState(3, 6)


# ---------------------------------------------------------------------------------------
# Plain file-system pieces


def _complete(directory: Path, iteration: int) -> Path:
    path = directory / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / METADATA_FILENAME).write_text(json.dumps({"iteration": iteration}))
    return path


def test_replacing_without_an_atomic_swap_keeps_the_tracker_on_a_complete_one(
    tmp_path, monkeypatch
):
    def no_exchange(a, b):
        raise ckpt_save._NoExchange("not supported here")

    monkeypatch.setattr(ckpt_save, "_exchange", no_exchange)
    save = tmp_path / "save"
    _complete(save, 2)
    _complete(save, 4)
    (save / TRACKER_FILENAME).write_text("4\n")
    new = _complete(tmp_path, 4)  # the new iteration 4, complete in its temporary place
    trackers = []
    real_rename = os.rename

    def rename(a, b):  # the tracker while iter_0000004 is away
        trackers.append((save / TRACKER_FILENAME).read_text())
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    aside = ckpt_save._publish(str(save), str(new), 4, "abc")
    assert trackers == ["2\n", "2\n"] and aside.endswith("iter_0000004.del-abc")
    monkeypatch.setattr(os, "rename", real_rename)
    # With no other complete checkpoint to name meanwhile: refused, nothing touched.
    (save / TRACKER_FILENAME).write_text("4\n")
    shutil.rmtree(save / "iter_0000002")
    other = _complete(tmp_path / "other", 4)
    with pytest.raises(CheckpointSaveError, match="cannot replace .*iter_0000004 safely"):
        ckpt_save._publish(str(save), str(other), 4, "abd")
    assert other.exists() and (save / "iter_0000004").exists()


def test_retain_never_deletes_the_tracked_checkpoint(tmp_path):
    for it in (1, 2, 3, 4):
        path = _complete(tmp_path, it)
        os.utime(path / METADATA_FILENAME, (1000 + it, 1000 + it))
    (tmp_path / TRACKER_FILENAME).write_text("1\n")  # e.g. after a rollback to 1
    ckpt_save._retire(str(tmp_path), 2, "abc")
    assert _listing(str(tmp_path)) == ["iter_0000001", "iter_0000003", "iter_0000004",
                                       TRACKER_FILENAME]  # fmt: skip


def test_save_dir_is_created_and_test_written(tmp_path):
    check_save_dir(str(tmp_path / "new" / "ckpt"))
    assert _listing(str(tmp_path / "new" / "ckpt")) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^--save: .*/file exists and is not a directory$"):
        check_save_dir(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=r"^--save: cannot create .*/file/ckpt: Not a directory"):
        check_save_dir(str(tmp_path / "file" / "ckpt"))


def test_checkpoint_flags_are_cross_checked(tmp_path):
    def prepare(checkpoint, ds=None, stage=1):
        layout = RunLayout(world_size=1, tp_size=1, zero_stage=stage, ds_config=ds or {})
        return plan_resume(ResumeRequest(checkpoint, layout=layout))

    save = str(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="^--save-retain: must be an integer >= 1, got 0"):
        CheckpointConfig(save_retain=0)
    with pytest.raises(ConfigError, match="^--save-retain: needs --save"):
        CheckpointConfig(save_retain=2)
    load = str(tmp_path / "load")
    with pytest.raises(ConfigError, match="^--load-fallback: cannot be combined with --ckpt-step"):
        CheckpointConfig(load=load, ckpt_step=2, load_fallback=True)
    with pytest.raises(ConfigError, match="^--finetune: not supported with ZeRO stage 3"):
        prepare(CheckpointConfig(save=save, load=load, finetune=True), stage=3)
    with pytest.raises(ConfigError, match="'checkpoint.load_universal' is not supported"):
        prepare(CheckpointConfig(save=save), ds={"checkpoint": {"load_universal": True}})
    # A --load without a tracker is a fresh start, as in Megatron.
    plan = prepare(CheckpointConfig(save=save, load=load))
    assert (plan.action, plan.iteration) == (
        FRESH,
        None,
    ) and "training from scratch" in plan.warning


# ---------------------------------------------------------------------------------------
# A checkpoint that verifies but does not fit the model (issue 22 item 4)


def _no_older_checkpoint(candidate) -> None:
    """A recipe's check (ResumeRequest.checks) that refuses every checkpoint before 8."""
    if candidate.iteration < 8:
        raise ConfigError(f"--seed: iteration {candidate.iteration} was trained with another")


def _misfit_worker(rank, world_size, load, fallback, padded_ranks=(), finetune=False, checks=()):
    """The loaded state, or the line; with --load-fallback, (state, the plan carried out)."""
    from megatron_taco.parallel.state import init_parallel

    parallel = init_parallel(1)
    model_class = PaddedToyModel if rank in padded_ranks else ToyModel
    engine = _engine(_training(load), parallel, model_class=model_class).model_engine
    checksum = manifest.read_metadata(os.path.join(load, "iter_0000008"))["checksum"]
    if finetune:
        plan = ResumePlan(WEIGHTS, load, 8, checksum, note=f"fine-tuning from {load}")
    else:
        plan = ResumePlan(RESUME, load, 8, checksum, restore_optimizer=True, restore_rng=True)
    flags = CheckpointConfig(load=load, load_fallback=fallback, finetune=finetune)
    try:
        state, done = execute_plan(engine, plan, ResumeRequest(flags, checks=checks), parallel)
    except ConfigError as e:
        return str(e)
    return (state, done.action, done.iteration, done.note) if fallback else state


def _resave(path: Path, change) -> None:
    """The model file loaded, changed, saved again, its manifest re-signed: it verifies."""
    states = safe_files.safe_torch_load(str(path))
    torch.save(change(states), path)
    _rewrite_manifest(path.parent)
    manifest.verify_checkpoint(str(path.parent.parent), 8)


def _other_keys(states):
    module = states["module"]
    module["norm.gamma"] = module.pop("norm.weight")
    del module["out.bias"]
    module["embed.weight"] = torch.zeros(VOCAB + 1, 16)
    module["extra"] = torch.zeros(1)
    return states


def test_a_checkpoint_whose_tensors_do_not_fit_is_one_line_or_fallen_back_from(two_checkpoints):
    load, path = two_checkpoints, _model_file(two_checkpoints)
    _resave(path, _other_keys)
    lines = run_distributed(_misfit_worker, 2, str(load), False)
    assert (
        lines
        == [
            f"--load: {path} does not fit this model: it lacks norm.weight, out.bias; it has "
            "norm.gamma, extra, which this model does not; embed.weight has another shape there; "
            "the last complete checkpoint there is iteration 6: pass --ckpt-step 6, or "
            "--load-fallback to fall back automatically"
        ]
        * 2
    )
    # --load-fallback: the one before it, as for a checkpoint that does not verify.
    resumed = (
        TrainingState(6, 24),
        FALLBACK,
        6,
        f"resumed from {load} at iteration 6 (--load-fallback)",
    )
    assert run_distributed(_misfit_worker, 2, str(load), True) == [resumed] * 2
    # The checkpoint fallen back to passes the run's checks first (layout, tokenizer, recipe's).
    checked = run_distributed(
        _misfit_worker, 2, str(load), True, (), False, (_no_older_checkpoint,)
    )
    assert checked == ["--seed: iteration 6 was trained with another"] * 2
    # --finetune falls back the same way, and still restarts at iteration 0 (so says the banner).
    weights = (TrainingState(0, 0), WEIGHTS, 6, f"fine-tuning from {load}")
    assert run_distributed(_misfit_worker, 2, str(load), True, (), True) == [weights] * 2
    # A loadable pickle with other keys altogether (no "module" state dict).
    _resave(path, lambda states: {"weights": torch.zeros(2), "step": 8})
    lines = run_distributed(_misfit_worker, 2, str(load), False)
    assert lines[0] == lines[1] and "\n" not in lines[0]
    assert lines[0].startswith(
        f"--load: {path} holds no 'module' state dict (found dict step, weights): not a model "
        "states file; the last complete checkpoint there is iteration 6: pass --ckpt-step 6"
    )


def _views_worker(rank, world_size, loads):
    return _misfit_worker(rank, world_size, loads[rank], True)


def test_the_misfit_fallback_is_one_choice_for_every_rank(two_checkpoints, tmp_path):
    # Issue 27 item 8: rank 1 sees --load through a stale network-file-system view, in which
    # iteration 6 is another (valid) checkpoint. Rank 0's choice is broadcast; a rank that
    # sees other files stops every rank, instead of each loading its own pick.
    load, path = two_checkpoints, _model_file(two_checkpoints)
    _resave(path, _other_keys)
    stale = tmp_path / "stale_view"
    shutil.copytree(load, stale)
    meta_path = stale / "iter_0000006" / METADATA_FILENAME
    meta = json.loads(meta_path.read_text())
    meta.update(consumed_samples=99)
    meta["checksum"] = manifest.metadata_checksum(meta)
    meta_path.write_text(json.dumps(meta))
    lines = run_distributed(_views_worker, 2, [str(load), str(stale)])
    ours = json.loads((load / "iter_0000006" / METADATA_FILENAME).read_text())["checksum"]
    assert (
        lines
        == [
            f"--load-fallback: rank 0 chose iteration 6, which rank 1 sees otherwise (its "
            f"{METADATA_FILENAME} has checksum {meta['checksum']}, rank 0's {ours}): the ranks "
            "see different files in --load (a stale network-file-system view?)"
        ]
        * 2
    )


class PaddedToyModel(ToyModel):
    """The toy model with 64 more embedding rows: what another vocabulary padding gives."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 64, 16)


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("padded_ranks", [(0, 1), (1,)])
def test_a_model_that_fits_no_checkpoint_there_is_named_without_falling_back(
    two_checkpoints, fallback, padded_ranks
):
    """Model flags that differ from the checkpoints' (here the vocabulary padding) misfit
    every checkpoint the same way: neither --ckpt-step nor --load-fallback can help, and a
    fallback would verify every checkpoint (every byte, on every rank) to say so. Also when
    one rank alone finds the misfit (the others must not go on into DeepSpeed's load)."""
    load = two_checkpoints
    lines = run_distributed(_misfit_worker, 2, str(load), fallback, padded_ranks, timeout=180)
    assert (
        lines
        == [
            f"--load: {load / 'iter_0000008'} was saved by a model of another shape: embed.weight "
            "is torch.Size([64, 16]) there and torch.Size([128, 16]) here. Model flags must match "
            "the checkpoint's (its metadata.json lists them); TACO checkpoints written before the "
            "value heads became d_WE/h_WE and d_PE/h_PE wide load with --we-value-channels and "
            "--pe-value-channels set to their --kv-channels; iteration 6 before it does not fit "
            "in the same way: this model is not the one these checkpoints were saved from"
        ]
        * 2
    )


def test_the_cuda_generator_of_this_rank_from_either_format():
    """RNG files keep this rank's own CUDA generator state; those written before kept the
    list of every visible GPU's (get_rng_state_all), this rank's at its device index."""
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    assert rng.own_cuda_state(states[5], 5) is states[5]  # the current format
    assert rng.own_cuda_state(states[5], 0) is states[5]  # one GPU per task, device 0
    for device in (0, 3, 7):  # the old format, resumed at the same layout
        assert torch.equal(rng.own_cuda_state(states, device), states[device])
    # The old format of a one-GPU-per-task rank (a list of one), resumed on device 3.
    assert torch.equal(rng.own_cuda_state(states[2:3], 3), states[2])


def _fallback_worker(rank, world_size, load):
    from megatron_taco.parallel.state import init_parallel

    parallel = init_parallel(1)
    engine = _engine(_training(load), parallel).model_engine
    checkpoint = CheckpointConfig(save=load, load=load, load_fallback=True)
    request = ResumeRequest(checkpoint, RunLayout(world_size=2, tp_size=1, zero_stage=1))
    plan = plan_resume(request)
    state, done = execute_plan(engine, plan, request, parallel)
    return plan.action, state, done.iteration


def test_a_fallback_within_save_makes_the_tracker_name_what_it_loaded(two_checkpoints):
    """The fault campaign's trial 7 (a damaged tracker after the last save): the fallback
    resumed, found nothing left to train, and left the tracker damaged, so every later
    requeue needed --load-fallback again. The tracker now names the checkpoint loaded."""
    load = two_checkpoints
    (load / TRACKER_FILENAME).write_text("8C\n")
    results = run_distributed(_fallback_worker, 2, str(load))
    assert results == [("fallback", TrainingState(8, 32), 8)] * 2
    assert (load / TRACKER_FILENAME).read_text() == "8\n"
    assert chosen(load) == 8  # a plain requeue resumes it

"""plan_resume is the one decision of what a run does with its --load and --save (issue 35):
every action (fresh, resume, fall back, weights only, read) and every refusal line comes
from it, for the driver, fine-tuning, conversion and export alike. The checkpoints here are
whole as far as the verification goes (metadata, manifest, checksums); the protocol's own
files and DeepSpeed's are tested in test_checkpoint_safety.py and test_checkpoint_faults.py.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.checkpoint.layout import FORMAT, TRACKER_FILENAME
from megatron_taco.checkpoint.manifest import manifest_entry, write_metadata
from megatron_taco.checkpoint.plan import (
    FALLBACK,
    FRESH,
    READ,
    RESUME,
    WEIGHTS,
    ResumeRequest,
    RunLayout,
    find_checkpoint,
    plan_resume,
    with_initialisation,
)
from megatron_taco.errors import ConfigError

ZERO1 = {"zero_optimization": {"stage": 1}}


def _save(load: Path, iteration: int, *, model="SAS", world=2, tp=1, ds=ZERO1, **meta) -> Path:
    """A checkpoint the verification passes: one data file in its manifest."""
    iter_dir = load / f"iter_{iteration:07d}"
    iter_dir.mkdir(parents=True)
    (iter_dir / "mp_rank_00_model_states.pt.bin").write_bytes(bytes(range(256)) * iteration)
    entry = manifest_entry(str(iter_dir / "mp_rank_00_model_states.pt.bin"))
    base = {
        "format": FORMAT,
        "iteration": iteration,
        "consumed_samples": 4 * iteration,
        "world_size": world,
        "tensor_model_parallel_size": tp,
        "data_parallel_size": world // tp,
        "model": model,
        "configs": {"deepspeed": ds},
        "optimizer": "torch.optim.AdamW",
    }
    write_metadata(str(iter_dir), {**base, **meta}, {"mp_rank_00_model_states.pt.bin": entry})
    (load / TRACKER_FILENAME).write_text(f"{iteration}\n")
    return iter_dir


@pytest.fixture
def load(tmp_path) -> Path:
    """Checkpoints 6 and 8 of a SAS run at world 2 (ZeRO-1 fp32), the tracker naming 8."""
    directory = tmp_path / "load"
    _save(directory, 6)
    _save(directory, 8)
    return directory


LAYOUT = RunLayout(
    world_size=2, tp_size=1, zero_stage=1, optimizer="torch.optim.AdamW", deepspeed_config="ds.json"
)


def _plan(layout=LAYOUT, models=("SAS",), **flags):
    return plan_resume(ResumeRequest(CheckpointConfig(**flags), layout=layout, models=models))


def _refused(**kw) -> str:
    with pytest.raises(ConfigError) as e:
        _plan(**kw)
    line = str(e.value)
    assert "\n" not in line
    return line


def test_what_a_run_does(load, tmp_path):
    plan = _plan()
    assert (plan.action, plan.iteration, plan.note) == (FRESH, None, "starting from scratch")
    plan = _plan(load=str(tmp_path / "nothing_yet"))  # Megatron: a fresh start, said so
    assert (plan.action, plan.iteration) == (FRESH, None)
    assert plan.warning.endswith(f"no {TRACKER_FILENAME} found, training from scratch")
    plan = _plan(load=str(load))
    assert (plan.action, plan.iteration, plan.restore_optimizer, plan.restore_rng) == (
        RESUME,
        8,
        True,
        True,
    )
    assert plan.note == f"resumed from {load} at iteration 8" and plan.warning is None
    plan = _plan(load=str(load), ckpt_step=6, no_load_optim=True, no_load_rng=True)
    assert (plan.action, plan.iteration, plan.restore_optimizer, plan.restore_rng) == (
        RESUME,
        6,
        False,
        False,
    )
    # Each flag leaves out its own state only.
    plan = _plan(load=str(load), no_load_rng=True)
    assert (plan.restore_optimizer, plan.restore_rng) == (True, False)
    plan = _plan(load=str(load), no_load_optim=True, layout=RunLayout(2, 1, zero_stage=1))
    assert (plan.restore_optimizer, plan.restore_rng) == (False, True)
    # --finetune: the weights of another layout's checkpoint (world 4, ZeRO 0).
    plan = _plan(load=str(load), finetune=True, layout=RunLayout(4, 1))
    assert (plan.action, plan.iteration, plan.restore_optimizer) == (WEIGHTS, 8, False)
    plan = _plan(load=str(load), layout=None, models=None)  # a tool's read
    assert (plan.action, plan.iteration) == (READ, 8)
    assert find_checkpoint(str(load)).iteration == 8  # conversion and export go through it


def test_a_corrupt_latest_is_refused_or_fallen_back_from(load):
    (load / "iter_0000008" / "mp_rank_00_model_states.pt.bin").write_bytes(b"damaged")
    line = _refused(load=str(load))
    assert line.startswith(
        f"--load: checkpoint iteration 8 (named by {load / TRACKER_FILENAME}) is incomplete or "
        "corrupt: "
    )
    assert line.endswith(
        "the last complete checkpoint there is iteration 6: pass --ckpt-step 6, or "
        "--load-fallback to fall back automatically"
    )
    plan = _plan(load=str(load), load_fallback=True)
    assert (plan.action, plan.iteration, plan.restore_optimizer) == (FALLBACK, 6, True)
    assert plan.note == f"resumed from {load} at iteration 6 (--load-fallback)"
    assert "has 7 bytes, the manifest says" in plan.warning
    assert plan.warning.endswith("--load-fallback: loading iteration 6 instead")
    (load / "iter_0000006" / "mp_rank_00_model_states.pt.bin").write_bytes(b"damaged")
    assert _refused(load=str(load), load_fallback=True).endswith(
        f"no older checkpoint in {load} verifies either"
    )


def test_an_unreadable_tracker_names_the_way_on(load):
    (load / TRACKER_FILENAME).write_text("garbage\n")
    line = _refused(load=str(load))
    assert line.startswith(f"--load: {load / TRACKER_FILENAME} must hold an iteration number")
    assert line.endswith(
        "the last complete checkpoint there is iteration 8: pass --ckpt-step 8, or "
        "--load-fallback to fall back automatically"
    )
    plan = _plan(load=str(load), load_fallback=True)
    assert (plan.action, plan.iteration) == (FALLBACK, 8)


@pytest.mark.parametrize(
    "change,line",
    [
        (dict(models=("TACO",)), "is a SAS checkpoint; this run loads TACO checkpoints"),
        (
            dict(layout=RunLayout(2, 2)),
            "was saved with tensor parallel size 1, this run uses 2; convert it: ",
        ),
        (
            dict(layout=RunLayout(4, 1, zero_stage=1)),
            "was saved at data parallel size 2 with ZeRO stage 1",
        ),
        (
            dict(layout=RunLayout(2, 1, zero_stage=0)),
            "holds the optimizer state of ZeRO stage 1 in fp32, which DeepSpeed cannot load",
        ),
        (
            dict(layout=RunLayout(2, 1, zero_stage=1, precision="bf16")),
            "cannot load into ZeRO stage 1 in bf16",
        ),
        (
            dict(layout=RunLayout(2, 1, zero_stage=3)),
            "ZeRO-3 checkpoints resume only at their own layout",
        ),
        (
            dict(layout=RunLayout(4, 1, zero_stage=1), no_load_optim=True),
            "holds the RNG states of 2 ranks, this run has 4; pass --no-load-rng",
        ),
        (
            dict(layout=RunLayout(2, 1, zero_stage=1, optimizer="apex.optimizers.FusedAdam")),
            "holds the state of torch.optim.AdamW, this run uses apex.optimizers.FusedAdam",
        ),
        (
            dict(finetune=True, layout=RunLayout(2, 1, zero_stage=3)),
            "--finetune: not supported with ZeRO stage 3",
        ),
        (
            dict(no_load_optim=True, layout=RunLayout(2, 1, zero_stage=3)),
            "--no-load-optim: not supported with ZeRO stage 3",
        ),
        (
            dict(layout=RunLayout(2, 1, zero_stage=1, ds_config={"checkpoint": {"writer": 1}})),
            "--deepspeed-config: key 'checkpoint.writer' is not supported",
        ),
    ],
)
def test_each_checkpoint_this_run_cannot_resume_is_one_line(load, change, line):
    found = _refused(load=str(load), **change)
    assert line in found, found
    if "ZeRO stage 1 in fp32" in line or "data parallel size 2" in line:
        assert "taco-convert-checkpoint --load" in found  # the command that converts it


def test_a_save_holding_another_runs_checkpoints_is_refused(load, tmp_path):
    line = _refused(save=str(load))
    assert line.startswith(
        f"--save: {load} already holds checkpoints up to iteration 8 of another run"
    )
    assert _plan(save=str(load), load=str(load)).action == RESUME  # the same run again
    # A tool writing one new checkpoint (conversion) never writes next to others.
    line = _refused(save=str(load), load=str(load), layout=None, models=None)
    assert (
        line == f"--save: {load} already holds checkpoints up to iteration 8; give a new directory"
    )
    with pytest.raises(ConfigError, match=f"{TRACKER_FILENAME} does not exist; give --ckpt-step"):
        find_checkpoint(str(tmp_path))


def test_a_store_of_another_run_and_the_recipes_checks(load, tmp_path):
    store = tmp_path / "store"
    (store / "gen_00000").mkdir(parents=True)
    stores = (("--replacement-store", str(store)),)
    request = ResumeRequest(CheckpointConfig(save=str(tmp_path / "new")), LAYOUT, stores=stores)
    with pytest.raises(ConfigError, match="^--replacement-store: .* holds another run's data"):
        plan_resume(request)
    # --finetune restarts at iteration 0: it resumes no store either.
    finetune = CheckpointConfig(save=str(tmp_path / "new"), load=str(load), finetune=True)
    with pytest.raises(ConfigError, match="^--replacement-store: .* holds another run's data"):
        plan_resume(ResumeRequest(finetune, LAYOUT, models=("SAS",), stores=stores))
    # A resume restores the store its checkpoint needs (also into another --save).
    resume = CheckpointConfig(save=str(tmp_path / "resumed"), load=str(load))
    assert plan_resume(ResumeRequest(resume, LAYOUT, stores=stores)).action == RESUME

    def origin(candidate):
        raise ConfigError(f"--seed: differs from the store's ({candidate.iteration})")

    request = ResumeRequest(CheckpointConfig(load=str(load)), LAYOUT, checks=(origin,))
    with pytest.raises(ConfigError, match=r"^--seed: differs from the store's \(8\)$"):
        plan_resume(request)


def test_a_checkpoint_of_another_tokenizer_is_refused(load, tmp_path):
    ours, theirs = tmp_path / "ours.model", tmp_path / "theirs.model"
    ours.write_bytes(b"our pieces")
    theirs.write_bytes(b"their pieces")
    sha = hashlib.sha256(theirs.read_bytes()).hexdigest()
    record = {"type": "SentencePiece", "sha256": sha, "vocab_size": 7, "file": "tok/t.model"}
    _save(load, 10, tokenizer=record)
    data = SimpleNamespace(
        tokenizer_type="SentencePiece", tokenizer_model=str(ours), vocab_file=None
    )
    request = ResumeRequest(CheckpointConfig(load=str(load)), LAYOUT, tokenizer=data)
    with pytest.raises(ConfigError) as e:
        plan_resume(request)
    assert str(e.value).startswith(f"--tokenizer-model: {ours} (SentencePiece, sha256 ")
    assert "is not the tokenizer" in str(e.value) and os.fspath(load) in str(e.value)
    data.tokenizer_model = str(theirs)  # the same content anywhere is the same tokenizer
    assert plan_resume(request).iteration == 10


def test_a_readers_refusal_names_no_flag_it_does_not_take(load, tmp_path):
    """Conversion, export and fine-tuning's pretrained --load take --ckpt-step but not
    --load-fallback (fine-tuning's applies to its own --output/checkpoints): a reader's
    line names the iteration to pass, and find_checkpoint verifies what it finds."""
    (load / "iter_0000008" / "mp_rank_00_model_states.pt.bin").write_bytes(b"damaged")
    for damage in ("the checkpoint", "the tracker"):
        with pytest.raises(ConfigError) as e:
            find_checkpoint(str(load))
        line = str(e.value)
        assert line.endswith(
            "the last complete checkpoint there is iteration 6: pass --ckpt-step 6"
        )
        assert "--load-fallback" not in line, (damage, line)
        (load / TRACKER_FILENAME).write_text("garbage\n")
    assert find_checkpoint(str(load), 6).iteration == 6
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match=f"^--load: {missing} is not a directory$"):
        find_checkpoint(str(missing))


def test_a_fresh_run_says_what_its_weights_start_from(load, tmp_path):
    source = _plan(load=str(load), layout=None, models=None)  # fine-tuning's pretrained read
    fresh = _plan(load=str(tmp_path / "output" / "checkpoints"))  # its own: none yet
    assert fresh.warning is not None
    plan = with_initialisation(fresh, source, "starting from the pretrained SAS encoder")
    assert (plan.action, plan.note, plan.warning) == (
        FRESH,
        f"starting from the pretrained SAS encoder from {load / 'iter_0000008'}",
        None,  # not "training from scratch"
    )
    resumed = _plan(load=str(load))
    assert with_initialisation(resumed, source, "starting from") is resumed


def test_fine_tuning_resumes_its_output_at_another_world_size_with_its_own_flags(
    tmp_path, tokenizer_model
):
    """taco-finetune plans its --output/checkpoints as a run's resume: a requeued run on
    fewer ranks holds the RNG states of more, and the line that refuses it must name a flag
    that taco-finetune takes (before, its --no-load-rng was pretraining's alone)."""
    import dataclasses

    from megatron_taco.recipes.finetune import SPEC
    from megatron_taco.recipes.finetune_config import finetune_configs
    from megatron_taco.recipes.finetune_output import claim_output, run_record
    from megatron_taco.training.configure import build_parser
    from megatron_taco.training.optim import optimizer_implementation
    from tests.helpers import tiny_sas_config

    model = dataclasses.asdict(tiny_sas_config())
    data = {"tokenizer_model": tokenizer_model, "tokenizer_type": "SentencePiece"}
    _save(tmp_path / "pretrained", 4, configs={"deepspeed": ZERO1, "model": model, "data": data})
    (tmp_path / "sst2").mkdir()
    output = tmp_path / "run"
    argv = ["--load", str(tmp_path / "pretrained"), "--task", "sst2"]
    argv += ["--data-dir", str(tmp_path / "sst2"), "--output", str(output)]

    def configs(world_size: int, *flags: str):
        args = build_parser(SPEC).parse_args([*argv, *flags])
        return finetune_configs(SPEC, args, world_size=world_size, device_type="cpu")

    first = configs(2)  # the interrupted run, at world size 2: its run.json and a checkpoint
    claim_output(str(output), run_record(first), write=True)
    _save(
        output / "checkpoints",
        3,
        model="finetune",
        world=2,
        ds=first.deepspeed.config,
        optimizer=optimizer_implementation(),
    )
    assert configs(2).plan.action == RESUME
    with pytest.raises(ConfigError) as e:
        configs(1)
    line = str(e.value)
    assert "holds the RNG states of 2 ranks, this run has 1; pass --no-load-rng" in line
    plan = configs(1, "--no-load-rng").plan  # the flag the line names
    assert (plan.action, plan.iteration, plan.restore_rng) == (RESUME, 3, False)


def test_load_fallback_skips_a_checkpoint_of_another_tensor_parallel_size(tmp_path):
    load = tmp_path / "load"
    _save(load, 6)  # tp 1: fits this run
    _save(load, 8, tp=2)  # tp 2 (world 2): does not
    _save(load, 10)
    (load / "iter_0000010" / "mp_rank_00_model_states.pt.bin").write_bytes(b"torn")
    ck = CheckpointConfig(load=str(load), load_fallback=True)
    plan = plan_resume(ResumeRequest(ck, layout=LAYOUT, models=("SAS",)))
    assert (plan.action, plan.iteration) == (FALLBACK, 6)

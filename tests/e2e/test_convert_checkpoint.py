"""Changing a checkpoint's layout, on checkpoints written by the real training driver with
real DeepSpeed engines (gloo ranks from run_distributed; dropout off so that runs at
different layouts compute the same losses):

* taco-convert-checkpoint re-shards TACO (ZeRO-1 fp32, tp 1 x dp 2) and SAS^DA (ZeRO-0
  bf16) to tp 2 and back: every tensor of every DeepSpeed file comes back bitwise;
* a tp=2 run resumed from the converted TACO checkpoint logs the losses, learning rates
  and gradient norms of the original tp=1 run;
* resuming at another data-parallel size is refused before any process group (ZeRO >= 1,
  naming the converter) or works (ZeRO-0); --no-load-optim keeps the LR schedule;
* --consolidate writes one full fp32 state dict that a tp=1 model loads.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from megatron_taco.checkpoint.deepspeed_files import load_file
from megatron_taco.checkpoint.plan import FALLBACK
from megatron_taco.checkpoint.reshard import ModelLayout
from megatron_taco.cli.convert_checkpoint import main as convert_main
from megatron_taco.data.tokenizer import file_sha256
from megatron_taco.errors import ConfigError
from megatron_taco.recipes.registry import read_checkpoint
from megatron_taco.training.configure import build_parser, configs_from_args
from tests.helpers import (
    REPO,
    TACO_METRIC_KEYS,
    ZERO0_BF16,
    ZERO1_FP32,
    launch,
    run,
    run_distributed,
    tiny_pretrain_args,
    train_records,
)

pytestmark = pytest.mark.e2e


def pretrain(rank: int, world: int, module: str, argv: list[str]) -> int:
    import importlib

    return importlib.import_module(f"megatron_taco.cli.{module}").main(argv)


train_args = tiny_pretrain_args


def train(module: str, world: int, argv: list[str], timeout: float = 240) -> None:
    codes = run_distributed(pretrain, world, module, argv, timeout=timeout, exit_timeout=timeout)
    assert codes == [0] * world


TACO = ("--deepspeed-config", ZERO1_FP32)
SAS_DA = ("--disentangled-attention", "--deepspeed-config", ZERO0_BF16)


@pytest.fixture(scope="module")
def taco_run(taco_checkpoint) -> Path:
    """TACO at tp 1 x dp 2, ZeRO-1 fp32, 4 iterations, checkpoints at 2 and 4 (read only)."""
    return taco_checkpoint


@pytest.fixture(scope="module")
def sas_da_run(sas_da_checkpoint) -> Path:
    """SAS^DA at tp 1 x dp 1, ZeRO-0 bf16, 4 iterations, checkpoints at 2 and 4 (read only)."""
    return sas_da_checkpoint


@pytest.fixture(scope="module")
def taco_tp2(taco_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("taco_tp2") / "ckpt"
    args = ["--load", str(taco_run), "--ckpt-step", "2", "--save", str(out),
            "--tensor-model-parallel-size", "2", "--data-parallel-size", "1"]  # fmt: skip
    assert convert_main(args) == 0
    return out


def assert_same(a, b, where: str) -> None:
    """Equal structure, equal non-tensor values, bitwise-equal tensors of the same dtype."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, sorted(set(a) ^ set(b)))
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b) and vars(a) == vars(b), where  # DeepSpeed's LossScaler
    else:
        assert a == b, (where, a, b)


def assert_same_checkpoint(original: Path, copy: Path) -> None:
    names = sorted(p.name for p in original.glob("*.pt") if not p.name.startswith("rng_state"))
    assert names == sorted(p.name for p in copy.glob("*.pt")), names
    for name in names:
        assert_same(load_file(str(original / name)), load_file(str(copy / name)), name)


def round_trip(load: Path, tmp_path: Path, there: tuple, back: tuple) -> Path:
    """tp 1 -> 2 (with ``there``'s flags) -> 1 (with ``back``'s)."""
    mid, out = tmp_path / "tp2", tmp_path / "tp1"
    tp = ["--ckpt-step", "2", "--tensor-model-parallel-size"]
    assert convert_main(["--load", str(load), "--save", str(mid), *tp, "2", *there]) == 0
    files = sorted(os.listdir(mid / "iter_0000002"))
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(files)
    assert convert_main(["--load", str(mid), "--save", str(out), *tp, "1", *back]) == 0
    meta = json.loads((out / "iter_0000002" / "metadata.json").read_text())
    assert meta["tensor_model_parallel_size"] == 1 and meta["converted_from"]["load"] == str(mid)
    # the new --save holds the tokenizer too, as the run's did
    record = json.loads((load / "iter_0000002" / "metadata.json").read_text())["tokenizer"]
    assert meta["tokenizer"] == record
    assert file_sha256(out / record["file"]) == record["sha256"]
    return out


def test_taco_zero1_tp1_to_tp2_to_tp1_is_bitwise(taco_run, tmp_path):
    # dp 2 -> 1 -> 2 on the way: ZeRO's partitions are rebuilt too.
    back = round_trip(taco_run, tmp_path, ("--data-parallel-size", "1"),
                      ("--data-parallel-size", "2"))  # fmt: skip
    assert_same_checkpoint(taco_run / "iter_0000002", back / "iter_0000002")


def test_sas_da_zero0_bf16_tp1_to_tp2_to_tp1_is_bitwise(sas_da_run, tmp_path):
    # Through ZeRO-2 at dp 3 (uneven partitions, padding) and back to ZeRO-0 at dp 1.
    zero2 = ("--deepspeed-config", "ds_configs/zero2_bf16.json", "--data-parallel-size", "3")
    zero0 = ("--deepspeed-config", "ds_configs/zero0_bf16.json", "--data-parallel-size", "1")
    back = round_trip(sas_da_run, tmp_path, zero2, zero0)
    assert len(list((tmp_path / "tp2" / "iter_0000002").glob("bf16_zero_pp_rank_*"))) == 6
    assert_same_checkpoint(sas_da_run / "iter_0000002", back / "iter_0000002")
    # The SAS replacement store travels with the checkpoint.
    assert (back / "replacement_store").is_dir()


def test_tp2_resumed_from_converted_checkpoint_logs_the_same_losses(
    botchan_dataset, taco_run, taco_tp2, tmp_path
):
    resumed = tmp_path / "resumed"
    argv = train_args(botchan_dataset, resumed, *TACO, "--tensor-model-parallel-size", "2",
                      "--load", str(taco_tp2), "--no-load-rng")  # fmt: skip
    train("pretrain_taco", 2, argv)
    full, ours = train_records(taco_run / "metrics.jsonl"), train_records(resumed / "metrics.jsonl")
    assert sorted(ours) == [3, 4]
    for it in (3, 4):
        assert ours[it]["lr"] == full[it]["lr"] > 0
        # tp=2 sums partial products in another order than tp=1: equal to float tolerance.
        for key in (*TACO_METRIC_KEYS, "grad_norm"):
            assert ours[it][key] == pytest.approx(full[it][key], rel=1e-5, abs=1e-6), (it, key)


# zero1_bf16 builds DeepSpeed's BF16_Optimizer (fp32 gradient accumulation), whose files keep
# the alignment padding that ZeRO's strip: the converter's files must load into it too.
@pytest.mark.parametrize("stage", [1, 2])
def test_sas_da_converted_to_zero_at_tp2_resumes_with_the_same_losses(
    botchan_dataset, sas_da_run, tmp_path, stage
):
    out, resumed = tmp_path / "zero2_tp2", tmp_path / "resumed"
    zero2 = ("--deepspeed-config", f"ds_configs/zero{stage}_bf16.json")
    assert convert_main(["--load", str(sas_da_run), "--ckpt-step", "2", "--save", str(out),
                         "--tensor-model-parallel-size", "2", *zero2]) == 0  # fmt: skip
    argv = train_args(botchan_dataset, resumed, "--disentangled-attention", *zero2,
                      "--tensor-model-parallel-size", "2", "--load", str(out), "--no-load-rng")  # fmt: skip
    train("pretrain_sas", 2, argv)
    full, ours = (
        train_records(sas_da_run / "metrics.jsonl"),
        train_records(resumed / "metrics.jsonl"),
    )
    for it in (3, 4):
        assert ours[it]["lr"] == full[it]["lr"]
        assert ours[it]["loss"] == pytest.approx(full[it]["loss"], rel=1e-3), it


def configs(dataset, save: Path, world: int, *extra: str):
    from megatron_taco.cli.pretrain_taco import SPEC

    args = build_parser(SPEC).parse_args(train_args(dataset, save, *extra))
    return configs_from_args(SPEC, args, world_size=world, device_type="cpu")


def test_data_parallel_change_is_refused_before_rendezvous_or_converted(
    botchan_dataset, taco_run, tmp_path
):
    # ZeRO-1 partitions the optimizer state over the 2 data-parallel ranks of the save.
    with pytest.raises(ConfigError) as error:
        configs(
            botchan_dataset, tmp_path / "new", 1, *TACO, "--load", str(taco_run), "--no-load-rng"
        )
    message = str(error.value)
    assert "data parallel size 2 with ZeRO stage 1" in message and "\n" not in message
    assert f"taco-convert-checkpoint --load {taco_run} --ckpt-step 4" in message
    assert "--data-parallel-size 1" in message
    # --no-load-optim needs no optimizer state; or convert it, as the message says.
    configs(botchan_dataset, tmp_path / "new", 1, *TACO, "--load", str(taco_run), "--no-load-rng",
            "--no-load-optim")  # fmt: skip
    out = tmp_path / "dp1"
    assert convert_main(["--load", str(taco_run), "--save", str(out),
                         "--data-parallel-size", "1"]) == 0  # fmt: skip
    configs(botchan_dataset, tmp_path / "new", 1, *TACO, "--load", str(out), "--no-load-rng")
    with pytest.raises(ConfigError, match="holds no RNG states"):
        configs(botchan_dataset, tmp_path / "new", 1, *TACO, "--load", str(out))


def test_zero0_resumes_at_another_data_parallel_size(botchan_dataset, sas_da_run, tmp_path):
    # Stage 0 keeps the whole optimizer state on every rank: DeepSpeed loads it at dp 2.
    resumed = tmp_path / "resumed"
    argv = train_args(botchan_dataset, resumed, *SAS_DA, "--load", str(sas_da_run),
                      "--ckpt-step", "2", "--no-load-rng")  # fmt: skip
    train("pretrain_sas", 2, argv)
    full, ours = (
        train_records(sas_da_run / "metrics.jsonl"),
        train_records(resumed / "metrics.jsonl"),
    )
    for it in (3, 4):
        assert ours[it]["lr"] == full[it]["lr"]
        assert ours[it]["loss"] == pytest.approx(full[it]["loss"], rel=1e-4), it


def test_no_load_optim_keeps_the_lr_schedule(botchan_dataset, sas_da_run, tmp_path):
    resumed = tmp_path / "resumed"
    argv = train_args(botchan_dataset, resumed, *SAS_DA, "--load", str(sas_da_run),
                      "--ckpt-step", "2", "--no-load-optim")  # fmt: skip
    train("pretrain_sas", 1, argv)
    full, ours = (
        train_records(sas_da_run / "metrics.jsonl"),
        train_records(resumed / "metrics.jsonl"),
    )
    assert sorted(ours) == [3, 4]
    # Warmup is 1 iteration: a restarted schedule would run iteration 3 at lr 0.
    assert ours[3]["lr"] == full[3]["lr"] > 0
    assert ours[3]["loss"] == full[3]["loss"]  # same weights, same batch


def test_consolidate_writes_one_full_fp32_state_dict(taco_tp2, tmp_path):
    from safetensors.torch import load_file as load_safetensors

    from megatron_taco.parallel.state import single_process_state

    out = tmp_path / "taco.safetensors"
    assert convert_main(["--load", str(taco_tp2), "--consolidate", str(out)]) == 0
    full = load_safetensors(str(out))
    assert full["taco.embeddings.word_embeddings.weight"].shape == (800, 48)  # padding gone
    assert all(t.dtype == torch.float32 for t in full.values())
    states, config, build = read_checkpoint(str(taco_tp2))
    (padded,) = ModelLayout(build, 1, config.vocab_size).split(full)
    model = build(single_process_state(), config.vocab_size)
    model.load_state_dict(padded, strict=True)
    pt = tmp_path / "taco.pt"
    res = run([sys.executable, "tools/convert_checkpoint.py", "--load", str(taco_tp2),
               "--consolidate", str(pt)])  # fmt: skip
    assert "-> " in res.stdout
    again = torch.load(pt, weights_only=True)
    assert sorted(again) == sorted(full) and all(torch.equal(again[k], full[k]) for k in full)


def test_bad_requests_are_one_line(taco_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:  # a bad input file: one error line, exit 1
        convert_main(["--load", str(tmp_path / "nothing"), "--save", str(tmp_path / "x")])
    assert info.value.code == 1
    # Tiny TACO has 2 word-stream heads: tensor parallel 3 cannot split them.
    bad = [
        "--load",
        str(taco_run),
        "--save",
        str(tmp_path / "y"),
        "--tensor-model-parallel-size",
        "3",
    ]
    # Config errors go through argparse (usage line, then one error line, exit 2).
    for argv in (bad, ["--load", str(taco_run), "--save", str(taco_run)]):
        with pytest.raises(SystemExit) as info:
            convert_main(argv)
        assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 3, errors
    assert "is not a directory" in errors[0]
    assert "3" in errors[1] and "divisible" in errors[1]
    assert "already holds checkpoints" in errors[2]


# -- untrusted input (issue 15) -------------------------------------------------------------


def _store_copy(sas_da_run: Path, tmp_path: Path) -> Path:
    """A --load directory with iteration 4 of the SAS^DA run and a replacement store written
    by the store's own writer: generation 0 committed, generation 1 still being written."""
    import shutil

    import numpy as np

    from megatron_taco.data.replacement_store import (
        GenerationWriter,
        StoreLayout,
        commit_generation,
    )

    load = tmp_path / "load"
    load.mkdir(parents=True)
    shutil.copytree(sas_da_run / "iter_0000004", load / "iter_0000004")
    (load / "latest_checkpointed_iteration.txt").write_text("4\n")
    store = load / "replacement_store"
    layout = StoreLayout(num_instances=10, width=4, vocab_size=800, num_shards=2)
    for generation in (0, 1):
        with GenerationWriter(store, generation, layout, owned_shards=[0, 1]) as writer:
            ids = np.arange(10 if generation == 0 else 5)
            writer.write(ids, np.arange(len(ids) * 4).reshape(-1, 4) % 800)
    commit_generation(store, 0, layout)
    return load


def _convert_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        convert_main(argv)
    assert info.value.code == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    return line


def test_the_replacement_store_is_copied_by_its_manifests_only(sas_da_run, tmp_path, capsys):
    load = _store_copy(sas_da_run, tmp_path)
    store = load / "replacement_store"
    generations = ["gen_00000"]
    (store / "notes.txt").write_text("not a store file")  # junk: skipped, counted
    out = tmp_path / "out"
    assert convert_main(["--load", str(load), "--save", str(out)]) == 0
    said = capsys.readouterr().out
    # Generation 1 (uncommitted: layout + 2 shards) and the junk file stay behind.
    assert "replacement store: 1 committed generation(s), 4 files" in said, said
    assert "(4 not named by a manifest skipped)" in said, said
    copied = sorted(str(p.relative_to(out / "replacement_store"))
                    for p in (out / "replacement_store").rglob("*") if p.is_file())  # fmt: skip
    assert copied == ["gen_00000/layout.json", "gen_00000/manifest.json",
                      "gen_00000/shard_00000.bin", "gen_00000/shard_00001.bin"]  # fmt: skip
    for name in copied:
        assert (out / "replacement_store" / name).read_bytes() == (store / name).read_bytes()

    # A link to a private key, a link to /, a FIFO: refused by name, nothing followed.
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")

    def key(store: Path) -> str:
        (store / generations[0] / "key").symlink_to(secret)
        return "key is a symbolic link"

    def root(store: Path) -> str:
        (store / "root").symlink_to("/")
        return "root is a symbolic link"

    def fifo(store: Path) -> str:
        shard = store / "gen_00000" / "shard_00000.bin"
        shard.unlink()
        os.mkfifo(shard)
        return f"{shard.name} is a FIFO"

    for plant in (key, root, fifo):
        fresh = _store_copy(sas_da_run, tmp_path / plant.__name__)
        what = plant(fresh / "replacement_store")
        out = tmp_path / f"out_{plant.__name__}"
        line = _convert_error(["--load", str(fresh), "--save", str(out)], capsys)
        assert what in line and "(in the SAS replacement store of --load)" in line, line
        assert not (out / "latest_checkpointed_iteration.txt").exists()
    # A shard changed after its manifest was written: its checksum says so.
    fresh = _store_copy(sas_da_run, tmp_path / "changed")
    shard = fresh / "replacement_store" / "gen_00000" / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    line = _convert_error(["--load", str(fresh), "--save", str(tmp_path / "o_changed")], capsys)
    assert f"{shard} changed while it was copied" in line, line


def test_exports_are_readable_by_others_on_the_cluster(taco_run, tmp_path):
    import stat as stat_module

    umask = os.umask(0o022)
    try:
        out = tmp_path / "model.safetensors"
        assert convert_main(["--load", str(taco_run), "--consolidate", str(out)]) == 0
    finally:
        os.umask(umask)
    assert stat_module.S_IMODE(out.stat().st_mode) == 0o644


@pytest.mark.parametrize("kind", ["sas_in_taco", "taco_in_sas"])
def test_a_checkpoint_of_the_other_model_is_named_first(
    botchan_dataset, taco_run, sas_da_run, tmp_path, capsys, kind
):
    from megatron_taco.cli.pretrain_sas import main as sas_main
    from megatron_taco.cli.pretrain_taco import main as taco_main

    main, load, saved, runs, flags = {
        "sas_in_taco": (taco_main, sas_da_run, "SAS", "TACO", TACO),
        "taco_in_sas": (sas_main, taco_run, "TACO", "SAS", SAS_DA),
    }[kind]
    capsys.readouterr()
    argv = train_args(botchan_dataset, tmp_path / "out", *flags, "--load", str(load))
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert f"is a {saved} checkpoint; this run loads {runs} checkpoints" in err[0], err[0]


def test_the_converter_tracker_survives_a_power_cut(taco_run, tmp_path, monkeypatch):
    """The tracker is renamed into place and then its directory is fsynced: without the
    second fsync the rename itself may be lost, leaving --save without a tracker."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", os.fspath(dst)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "out"
    assert convert_main(["--load", str(taco_run), "--save", str(out)]) == 0
    tracker = str(out / "latest_checkpointed_iteration.txt")
    at = events.index(("replace", tracker))
    assert ("fsync", str(out)) in events[at + 1 :], events[at:]


def test_the_layout_checked_is_that_of_the_checkpoint_load_fallback_picks(
    botchan_dataset, taco_run, tmp_path
):
    import shutil

    from megatron_taco.checkpoint.manifest import metadata_checksum as _metadata_checksum

    load = tmp_path / "load"
    shutil.copytree(taco_run, load)
    # The tracker's iteration 4: saved by another layout (ZeRO-0) and now corrupt.
    meta_path = load / "iter_0000004" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["configs"]["deepspeed"]["zero_optimization"] = {"stage": 0}
    meta["checksum"] = _metadata_checksum(meta)
    meta_path.write_text(json.dumps(meta))
    model = load / "iter_0000004" / "mp_rank_00_model_states.pt"
    model.write_bytes(model.read_bytes()[:-100])
    cfg = configs(botchan_dataset, tmp_path / "new", 2, *TACO, "--load", str(load),
                  "--load-fallback")  # fmt: skip
    # iteration 2 has this run's layout: nothing to refuse
    assert (cfg.plan.action, cfg.plan.iteration) == (FALLBACK, 2)


# ---------------------------------------------------------------------------------------
# ZeRO-3: consolidated through DeepSpeed's zero_to_fp32, then like any other checkpoint


@pytest.fixture(scope="module")
def zero3_runs(botchan_dataset, tmp_path_factory) -> dict[str, Path]:
    """TACO at tensor parallel 2, 2 iterations: at data parallel 2 under ZeRO-3 with a
    persistence threshold of 0 (every parameter partitioned, even the tiny model's), and at
    data parallel 1 under ZeRO-0 (the same batches; sums in another order)."""
    root = tmp_path_factory.mktemp("zero3")
    ds = json.loads((REPO / "ds_configs" / "zero3_fp32.json").read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (root / "zero3.json").write_text(json.dumps(ds))
    runs = {"zero3": root / "zero3", "zero0": root / "zero0"}
    for name, world, config in (("zero3", 4, str(root / "zero3.json")),
                                ("zero0", 2, "ds_configs/zero0_fp32.json")):  # fmt: skip
        argv = train_args(botchan_dataset, runs[name], "--train-iters", "2",
                          "--tensor-model-parallel-size", "2", "--deepspeed-config", config)  # fmt: skip
        train("pretrain_taco", world, argv, timeout=900)
    return runs


def assert_states_close(got: dict, want: dict, rtol: float, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want))[:3])
    for name, tensor in want.items():
        scale = tensor.abs().max().item()
        err = (got[name].double() - tensor.double()).abs().max().item()
        assert err <= rtol * scale + 1e-30, f"{what} {name}: error {err:.3e}, scale {scale:.3e}"


def test_zero3_checkpoints_consolidate_export_convert_and_fine_tune(
    zero3_runs, botchan_dataset, tmp_path
):
    from safetensors.torch import load_file as load_safetensors

    from tests.helpers import write_marker_task

    zero3 = zero3_runs["zero3"] / "iter_0000002"
    files = sorted(p.name for p in zero3.glob("zero_pp_rank_*_model_states.pt"))
    assert files == [f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt"
                     for d in (0, 1) for t in (0, 1)]  # fmt: skip
    # The parameters really are partitioned: the model files hold empty placeholders.
    module = load_file(str(zero3 / files[0]))["module"]
    assert module and all(t.numel() == 0 for t in module.values())

    # The same weights and Adam moments as the ZeRO-0 run's (fp32; reduction order differs).
    states, config, _ = read_checkpoint(str(zero3_runs["zero3"]))
    reference, _, _ = read_checkpoint(str(zero3_runs["zero0"]))
    assert states.info.zero_stage == 3 and (states.info.tp_size, states.info.dp_size) == (2, 2)
    assert reference.info.zero_stage == 0
    full = states.full_state_dict()
    assert_states_close(full, reference.full_state_dict(), 1e-5, "weights")
    for key in ("exp_avg", "exp_avg_sq"):
        assert_states_close(states.families[key], reference.families[key], 1e-4, key)
    assert float(states.step) == 2.0

    # Exported: the file's tensors are the consolidated ones.
    from megatron_taco.cli.export_hf import main as export_main

    assert export_main(["--load", str(zero3_runs["zero3"]), "--output", str(tmp_path / "hf")]) == 0
    exported = load_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    word = "taco.embeddings.word_embeddings.weight"
    assert torch.equal(exported[word], full[word][: config.vocab_size])

    # Converted to ZeRO-1 at tp 1 x dp 2: every tensor and moment carried over bitwise.
    out = tmp_path / "zero1"
    assert convert_main(["--load", str(zero3_runs["zero3"]), "--save", str(out),
                         "--tensor-model-parallel-size", "1", "--data-parallel-size", "2",
                         "--deepspeed-config", "ds_configs/zero1_fp32.json"]) == 0  # fmt: skip
    converted, _, _ = read_checkpoint(str(out))
    assert converted.info.zero_stage == 1
    assert_states_close(converted.full_state_dict(), full, 0.0, "converted weights")
    for key in ("exp_avg", "exp_avg_sq"):
        assert_states_close(converted.families[key], states.families[key], 0.0, key)

    # Fine-tuned: the first steps are those from the ZeRO-0 checkpoint.
    write_marker_task(tmp_path / "marker")

    def losses(name: str) -> list[float]:
        output = tmp_path / f"ft_{name}"
        launch("tools/finetune.py", "--load", str(zero3_runs[name]),
               "--task", "custom", "--data-dir", str(tmp_path / "marker"), "--output",
               str(output), "--seq-length", "64", "--micro-batch-size", "16",
               "--global-batch-size", "16", "--epochs", "1", "--num-workers", "0",
               "--log-interval", "1", timeout=600)  # fmt: skip
        records = map(json.loads, (output / "metrics.jsonl").open())
        return [r["loss"] for r in records if r["split"] == "train"][:4]

    assert losses("zero3") == pytest.approx(losses("zero0"), rel=1e-5)

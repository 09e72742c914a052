"""A run never removes, replaces or rewinds checkpoints (or store data) it did not write
(issue 27 item 1): a --save that holds another run's checkpoints, or a replacement store
that holds another run's generations, is refused in one line before any process group
unless --load resumes them; --override-existing-checkpoints moves them aside, whole.
Real SAS runs through the real entry point (pretrain_sas.py's main)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.checkpoint.layout import TRACKER_FILENAME
from megatron_taco.checkpoint.ownership import check_own_save, set_aside
from megatron_taco.errors import ConfigError
from megatron_taco.training import driver
from megatron_taco.training.configure import build_parser, configs_from_args
from tests.helpers import run_in_process


def _flags(save: Path, **kw) -> CheckpointConfig:
    return CheckpointConfig(save=str(save), **kw)


def _hold(save: Path, *iterations: int) -> None:
    for it in iterations:
        (save / f"iter_{it:07d}").mkdir(parents=True)
        (save / f"iter_{it:07d}" / "metadata.json").write_text("{}")
    (save / TRACKER_FILENAME).write_text(f"{iterations[-1]}\n")


def test_a_save_holding_checkpoints_needs_a_matching_load_or_the_override(tmp_path):
    save = tmp_path / "ckpt"
    check_own_save(_flags(save))  # nothing there: a fresh start
    save.mkdir()
    check_own_save(_flags(save))  # an empty directory too
    _hold(save, 2, 4)
    refused = (
        f"--save: {save} already holds checkpoints up to iteration 4 of another run, which this "
        f"run's saves would replace, rewind or delete: pass --load {save} to resume them, or "
        "--override-existing-checkpoints to move them aside and start anew"
    )
    for load in (None, str(tmp_path / "typo"), str(tmp_path / "elsewhere")):
        with pytest.raises(ConfigError) as e:
            check_own_save(_flags(save, load=load))
        assert str(e.value) == refused
    # --finetune restarts at iteration 0: its first save would rewind the tracker, and
    # "--load to resume them" is no way on (issue 27: the lines named it).
    with pytest.raises(ConfigError) as e:
        check_own_save(_flags(save, load=str(save), finetune=True))
    assert str(e.value) == (
        f"--save: {save} already holds checkpoints up to iteration 4, which --finetune (it "
        "restarts at iteration 0) would replace, rewind or delete: give --finetune another "
        f"--save, and keep --load {save} to fine-tune from them"
    )
    pretrained = str(tmp_path / "pretrained")
    with pytest.raises(ConfigError) as e:
        check_own_save(_flags(save, load=pretrained, finetune=True))
    assert str(e.value) == (
        f"--save: {save} already holds checkpoints up to iteration 4 of another run, which "
        "--finetune (it restarts at iteration 0) would replace, rewind or delete: give "
        "--finetune another --save, or --override-existing-checkpoints to move them aside"
    )
    check_own_save(_flags(save, load=str(save)))  # resumes them
    check_own_save(_flags(save, load=f"{save}/."))  # the same directory
    check_own_save(_flags(save, override_existing_checkpoints=True))
    with pytest.raises(ConfigError, match="^--override-existing-checkpoints: --load .* is --save"):
        check_own_save(_flags(save, load=str(save), override_existing_checkpoints=True))
    check_own_save(_flags(save, load=pretrained, finetune=True, override_existing_checkpoints=True))
    # Moved aside first, the checkpoint --finetune loads would be gone (before: accepted;
    # rank 0 moved them, and the load failed once the process groups were up).
    with pytest.raises(ConfigError) as e:
        check_own_save(
            _flags(save, load=str(save), finetune=True, override_existing_checkpoints=True)
        )
    assert str(e.value) == (
        f"--override-existing-checkpoints: --finetune loads --load {save}, which is --save: "
        "its checkpoints up to iteration 4 would be moved aside before they are loaded; give "
        "--finetune another --save, without the flag"
    )
    # A tracker alone (a checkpoint directory deleted by hand) still marks another run's.
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / TRACKER_FILENAME).write_text("garbage")
    with pytest.raises(ConfigError, match=f"^--save: {lone} already holds checkpoints of"):
        check_own_save(_flags(lone))


def test_set_aside_moves_checkpoints_and_stores_and_deletes_nothing(tmp_path):
    save = tmp_path / "ckpt"
    _hold(save, 2, 4)
    (save / "iter_0000006.tmp-00ab").mkdir()  # a crashed save's leftover
    (save / "run.lock").write_text("{}")
    (save / "metrics.jsonl").write_text("{}\n")
    (save / "tokenizer" / "0123456789abcdef").mkdir(parents=True)  # issue 29's copy
    (save / "tokenizer" / "0123456789abcdef" / "spm.model").write_bytes(b"spm")
    inside, outside = save / "replacement_store", tmp_path / "store"
    for store in (inside, outside):
        (store / "gen_00000").mkdir(parents=True)
        (store / "gen_00000" / "shard_00000.bin").write_bytes(b"rows")
    empty = tmp_path / "empty_store"
    empty.mkdir()
    aside = Path(set_aside(str(save), (str(inside), str(outside), str(empty))))
    assert aside.parent == save and aside.name.startswith("superseded-")
    assert sorted(os.listdir(save)) == sorted([aside.name, "metrics.jsonl", "run.lock",
                                               "tokenizer"])  # fmt: skip
    assert sorted(os.listdir(aside)) == [
        "iter_0000002", "iter_0000004", "iter_0000006.tmp-00ab", TRACKER_FILENAME,
        "replacement_store", "tokenizer",
    ]  # fmt: skip
    # The checkpoints name their tokenizer copy relative to their folder's parent: it goes
    # with them, and stays for the new run.
    for root in (save, aside):
        assert (root / "tokenizer" / "0123456789abcdef" / "spm.model").read_bytes() == b"spm"
    assert (aside / "replacement_store" / "gen_00000" / "shard_00000.bin").read_bytes() == b"rows"
    assert not outside.exists()
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("store.superseded-")]
    assert (moved / "gen_00000" / "shard_00000.bin").read_bytes() == b"rows"
    assert empty.is_dir()  # nothing in it to keep apart
    assert set_aside(str(save), (str(empty),)) is None  # nothing left to move


# -- the real entry point ----------------------------------------------------------------


def _sas_main(argv: list[str]) -> int:
    from megatron_taco.recipes.sas import SPEC

    return driver.main(SPEC, argv)


def _sas_args(dataset: dict, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--model-size", "tiny", "--seq-length", "48",
        "--data-path", dataset["prefix"], "--tokenizer-model", dataset["tokenizer"],
        "--data-cache-path", str(tmp_path / "cache"), "--split", "80,10,10",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--lr-warmup-iters", "0", "--eval-iters", "0", "--num-workers", "0",
        "--no-progress-bar", "--deepspeed-config", "ds_configs/zero0_fp32.json",
        "--replacement-store-shards", "2", *extra,
    ]  # fmt: skip


def _contents(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_fresh_run_on_another_runs_save_is_refused_or_moves_it_aside(
    botchan_dataset, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    save = tmp_path / "ckpt"
    first = _sas_args(botchan_dataset, tmp_path, "--save", str(save), "--train-iters", "2",
                      "--save-interval", "2", "--metrics-file", str(tmp_path / "m1.jsonl"))  # fmt: skip
    assert run_in_process(_sas_main, first) == 0
    old = {name: h for name, h in _contents(save).items() if not name.endswith("run.lock")}
    assert (save / TRACKER_FILENAME).read_text() == "2\n"
    assert any(name.startswith("replacement_store/gen_00000/") for name in old)

    # No --load, a mistyped one, --load elsewhere: one line, before any process group.
    again = _sas_args(botchan_dataset, tmp_path, "--save", str(save), "--train-iters", "1",
                      "--save-interval", "1", "--metrics-file", str(tmp_path / "m2.jsonl"))  # fmt: skip
    for load in ([], ["--load", str(tmp_path / "ckpt_typo")]):
        assert _sas_main([*again, *load]) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [
            f"pretrain_sas.py: error: --save: {save} already holds checkpoints up to iteration 2 "
            f"of another run, which this run's saves would replace, rewind or delete: pass "
            f"--load {save} to resume them, or --override-existing-checkpoints to move them "
            "aside and start anew"
        ]
    # The store the old run's checkpoint needs, given to a run saving elsewhere.
    store = str(save / "replacement_store")
    elsewhere = _sas_args(botchan_dataset, tmp_path, "--save", str(tmp_path / "other"),
                          "--replacement-store", store, "--train-iters", "1")  # fmt: skip
    assert _sas_main(elsewhere) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain_sas.py: error: --replacement-store: {store} holds another run's data, which "
        "this run (it resumes no checkpoint) would overwrite: pass the --load of the run that "
        "wrote it to resume that run, or --override-existing-checkpoints to move it aside and "
        "start anew"
    ]
    # A requeued run naming its --save in --load that died before its first checkpoint:
    # its own store data, which no checkpoint needs, is rewritten.
    requeued = str(tmp_path / "requeued")
    own = _sas_args(botchan_dataset, tmp_path, "--save", requeued, "--load", requeued,
                    "--replacement-store", store, "--train-iters", "1")  # fmt: skip
    from megatron_taco.recipes.sas import SPEC

    configs_from_args(SPEC, build_parser(SPEC).parse_args(own), world_size=1, device_type="cpu")

    # Item 3: a resume whose flags would put the stored rows elsewhere (same store width:
    # ceil(0.14 * 46) = ceil(0.15 * 46) = 7 slots; same number of instances for --seed).
    resume = _sas_args(botchan_dataset, tmp_path, "--save", str(save), "--load", str(save),
                       "--train-iters", "3", "--metrics-file", str(tmp_path / "m3.jsonl"))  # fmt: skip
    layout = save / "replacement_store" / "gen_00000" / "layout.json"
    for flag, value, stored in (("--seed", "7", "1234"), ("--mask-prob", "0.14", "0.15")):
        assert _sas_main([*resume, flag, value]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"pretrain_sas.py: error: {flag}: the store was written with {flag} {stored}, this "
            f"run has {value}: its rows would be read onto other positions or instances; resume "
            f"with the store's {flag}, or start anew (--override-existing-checkpoints, without "
            f"--load) ({layout})"
        ]
    # Flags that do not decide the rows, and the same data files spelled through a symlink
    # and a relative path, resume (the configs pass every check before the process groups).
    link = tmp_path / "data_link"
    link.symlink_to(Path(botchan_dataset["prefix"]).parent)
    spelled = os.path.relpath(link / Path(botchan_dataset["prefix"]).name)
    same = [a if a != botchan_dataset["prefix"] else spelled for a in resume]
    same += ["--lr", "2e-3", "--log-interval", "3", "--train-iters", "5"]
    configs_from_args(SPEC, build_parser(SPEC).parse_args(same), world_size=1, device_type="cpu")
    # A store that is --save (or holds it) would be moved aside with the whole --save.
    assert (
        _sas_main([*again, "--override-existing-checkpoints", "--replacement-store", str(save)])
        == 2
    )
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain_sas.py: error: --replacement-store: {save} is or holds --save {save}: give "
        "the store a directory of its own (default: replacement_store under --save)"
    ]
    # --finetune of this --save's checkpoint with the flag: refused before anything moves.
    finetune = [*again, "--load", str(save), "--finetune", "--override-existing-checkpoints"]
    assert _sas_main(finetune) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain_sas.py: error: --override-existing-checkpoints: --finetune loads --load "
        f"{save}, which is --save: its checkpoints up to iteration 2 would be moved aside before "
        "they are loaded; give --finetune another --save, without the flag"
    ]
    now = _contents(save)
    assert {name: now.get(name) for name in old} == old  # untouched

    assert run_in_process(_sas_main, [*again, "--override-existing-checkpoints"]) == 0
    (aside,) = [p for p in save.iterdir() if p.name.startswith("superseded-")]
    # byte for byte, the store included, and the tokenizer copy its checkpoints name
    assert _contents(aside) == old and any(n.startswith("tokenizer/") for n in old)
    assert (save / TRACKER_FILENAME).read_text() == "1\n"
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000001"]


def test_a_save_holding_no_checkpoint_is_a_fresh_start(tmp_path):
    # What a run writes into --save besides checkpoints (issue 29's tokenizer copy, the lock,
    # the metrics, tensorboard) is not another run's checkpoints.
    save = tmp_path / "ckpt"
    (save / "tokenizer").mkdir(parents=True)
    (save / "tokenizer" / "tokenizer.model").write_bytes(b"model")
    (save / "tensorboard").mkdir()
    (save / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"ev")
    (save / "run.lock").write_text("{}")
    (save / "metrics.jsonl").write_text('{"iteration": 1}\n{"iter')
    check_own_save(_flags(save))


def test_set_aside_never_reuses_a_taken_name(tmp_path, monkeypatch):
    # Same second, same pid (a requeued container): a second override must not fail nor
    # mix its checkpoints into the first one's folder, nor replace an empty store folder.
    monkeypatch.setattr("time.strftime", lambda *a: "20260101-000000")
    save, store = tmp_path / "ckpt", tmp_path / "store"
    asides = []
    for rows in (b"first", b"second"):
        _hold(save, 2)
        (store / "gen_00000").mkdir(parents=True)
        (store / "gen_00000" / "shard_00000.bin").write_bytes(rows)
        asides.append(Path(set_aside(str(save), (str(store),))))
    assert asides[0] != asides[1] and all(sorted(os.listdir(a)) == [
        "iter_0000002", TRACKER_FILENAME] for a in asides)  # fmt: skip
    moved = sorted(p for p in tmp_path.iterdir() if p.name.startswith("store.superseded-"))
    assert [(p / "gen_00000" / "shard_00000.bin").read_bytes() for p in moved] == [
        b"first", b"second"]  # fmt: skip


def _origin(tmp_path: Path, data_path: str, **tokenizer) -> tuple:
    from megatron_taco.data.config import DataConfig
    from megatron_taco.data.sas_collator import ReplacementConfig
    from megatron_taco.recipes.sas_augmentation import SelfAugmentationConfig, store_origin

    data = DataConfig(data_path=(data_path,), **tokenizer)
    return store_origin(data, ReplacementConfig(), SelfAugmentationConfig())


def test_the_store_origin_names_files_by_content_not_by_path_spelling(tmp_path, monkeypatch):
    real = tmp_path / "corpus"
    real.mkdir()
    for ext, size in ((".bin", 7), (".idx", 3)):
        (real / f"wiki_text_document{ext}").write_bytes(b"x" * size)
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "alias_document.bin").symlink_to(real / "wiki_text_document.bin")
    (tmp_path / "alias_document.idx").symlink_to(real / "wiki_text_document.idx")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\n")
    moved = tmp_path / "moved_vocab.txt"
    moved.write_text(vocab.read_text())
    wordpiece = {"tokenizer_type": "BertWordPieceLowerCase"}
    monkeypatch.chdir(tmp_path)
    spellings = [
        _origin(tmp_path, str(real / "wiki_text_document"), vocab_file=str(vocab), **wordpiece),
        _origin(tmp_path, "corpus/wiki_text_document", vocab_file="vocab.txt", **wordpiece),
        _origin(tmp_path, "link/wiki_text_document", vocab_file=str(moved), **wordpiece),
        _origin(tmp_path, "alias_document", vocab_file=str(vocab), **wordpiece),
    ]
    assert all(s == spellings[0] for s in spellings), spellings
    assert dict(spellings[0])["--vocab-file"].startswith('"sha256:')
    moved.write_text(vocab.read_text() + "b\n")  # another vocabulary: other rows
    other = _origin(tmp_path, "alias_document", vocab_file=str(moved), **wordpiece)
    assert dict(other)["--vocab-file"] != dict(spellings[0])["--vocab-file"]

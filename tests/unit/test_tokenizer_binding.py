"""A tokenizer is bound to the datasets made with it and to the checkpoints trained with it.

Datasets: taco-preprocess-data's summary records the tokenizer's kind, content hash and
vocabulary size; pretraining and taco-build-samples refuse another tokenizer in one line
before any process group (a summary written before the hash: only the size is checked).
Checkpoints: metadata.json's "tokenizer" names the copy in --save; the readers (export,
conversion, fine-tuning) take the copy, so the original may move or go, and refuse a
tokenizer file whose content is not the recorded one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_taco.checkpoint.layout import FORMAT
from megatron_taco.checkpoint.manifest import write_metadata as _write_metadata
from megatron_taco.checkpoint.plan import find_checkpoint
from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer
from megatron_taco.data.config import DataConfig
from megatron_taco.data.tokenizer import (
    Tokenizer,
    dataset_summary,
    file_sha256,
    save_tokenizer_copy,
    saved_tokenizer_record,
)
from megatron_taco.errors import ConfigError
from megatron_taco.recipes.registry import checkpoint_tokenizer
from megatron_taco.training.configure import build_parser, configs_from_args


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, botchan_path) -> str:
    """Another sentencepiece model of the same size (BPE): only the hash tells them apart."""
    out = tmp_path_factory.mktemp("other")
    return train_tokenizer(
        TrainTokenizerConfig(
            input=(str(botchan_path),),
            model_prefix=str(out / "bpe"),
            vocab_size=800,
            model_type="bpe",
            num_threads=1,
        )
    )


def test_summary_records_the_tokenizer(botchan_dataset):
    path, summary = dataset_summary(botchan_dataset["prefix"])
    assert path == str(botchan_dataset["dir"] / "botchan_summary.json")
    record = summary["tokenizer"]
    assert record["type"] == "SentencePiece" and record["vocab_size"] == 800
    # what `sha256sum` prints, computed independently of file_sha256
    want = hashlib.sha256(Path(botchan_dataset["tokenizer"]).read_bytes()).hexdigest()
    assert record["sha256"] == want


def test_another_tokenizer_of_the_same_size_is_refused(botchan_dataset, other_model):
    config = DataConfig(data_path=(botchan_dataset["prefix"],), tokenizer_model=other_model)
    with pytest.raises(ConfigError) as info:
        config.validate_files()
    message = str(info.value)
    assert message.startswith(f"--tokenizer-model: {other_model} (SentencePiece, 800 pieces")
    assert "is not the tokenizer" in message and "botchan_summary.json" in message
    assert "\n" not in message


def test_a_moved_copy_is_the_same_tokenizer(botchan_dataset, tmp_path):
    copy = shutil.copy(botchan_dataset["tokenizer"], tmp_path / "renamed.model")
    DataConfig(data_path=(botchan_dataset["prefix"],), tokenizer_model=str(copy)).validate_files()


def _old_dataset(botchan_dataset, tmp_path) -> str:
    """The dataset as preprocessing wrote it before the hash was recorded."""
    src = Path(botchan_dataset["prefix"])
    for f in src.parent.glob(src.name + "*"):
        shutil.copy(f, tmp_path / f.name)
    summary = json.loads((src.parent / "botchan_summary.json").read_text())
    del summary["tokenizer"]
    (tmp_path / "botchan_summary.json").write_text(json.dumps(summary))
    return str(tmp_path / src.name)


def test_old_summary_checks_only_the_vocabulary_size(
    botchan_dataset, other_model, tmp_path, botchan_path
):
    prefix = _old_dataset(botchan_dataset, tmp_path)
    DataConfig(data_path=(prefix,), tokenizer_model=other_model).validate_files()  # same size
    smaller = train_tokenizer(
        TrainTokenizerConfig(
            input=(str(botchan_path),),
            model_prefix=str(tmp_path / "small"),
            vocab_size=500,
            num_threads=1,
        )
    )
    with pytest.raises(ConfigError, match=r"^--tokenizer-model: .* has 500 pieces, .* of 800"):
        DataConfig(data_path=(prefix,), tokenizer_model=smaller).validate_files()


def test_build_samples_refuses_in_one_line(botchan_dataset, other_model, capsys):
    from megatron_taco.cli.build_samples import main

    argv = ["--data-path", botchan_dataset["prefix"], "--tokenizer-model", other_model,
            "--data-cache-path", str(botchan_dataset["dir"] / "cache"), "--train-samples", "4"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "is not the tokenizer" in errors[0], errors


def test_pretraining_refuses_before_any_process_group(botchan_dataset, other_model, tmp_path):
    from megatron_taco.cli.pretrain_taco import SPEC

    argv = ["--model-size", "tiny", "--seq-length", "64", "--data-path", botchan_dataset["prefix"],
            "--tokenizer-model", other_model, "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "2", "--save", str(tmp_path / "s")]  # fmt: skip
    args = build_parser(SPEC).parse_args(argv)
    with pytest.raises(ConfigError, match="^--tokenizer-model: .* is not the tokenizer"):
        configs_from_args(SPEC, args, world_size=1, device_type="cpu")
    assert not torch.distributed.is_initialized()


# -- checkpoints --------------------------------------------------------------------------


def _checkpoint(save: Path, tokenizer: Tokenizer, *, record: bool = True) -> None:
    """A checkpoint's metadata.json as the driver writes it (no tensors: the tokenizer is
    resolved from the metadata alone), with the tokenizer copied into --save."""
    iter_dir = save / "iter_0000002"
    iter_dir.mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    meta = {"format": FORMAT, "iteration": 2, "consumed_samples": 8, "world_size": 1,
            "tensor_model_parallel_size": 1, "data_parallel_size": 1, "model": "TACO",
            "configs": {"data": {"tokenizer_model": tokenizer.model_path,
                                 "tokenizer_type": "SentencePiece", "vocab_file": None}}}  # fmt: skip
    if record:
        meta["tokenizer"] = saved_tokenizer_record(tokenizer)
        save_tokenizer_copy(str(save), tokenizer, meta["tokenizer"])
    _write_metadata(str(iter_dir), meta, {})


def test_checkpoint_reads_its_copy_after_the_original_is_gone(tokenizer_model, tmp_path):
    original = Path(shutil.copy(tokenizer_model, tmp_path / "tok.model"))
    _checkpoint(tmp_path / "save", Tokenizer(original))
    original.unlink()
    info = find_checkpoint(str(tmp_path / "save"), verify=False)
    path, kind = checkpoint_tokenizer(info, None)
    record = info.meta["tokenizer"]
    assert path == str(tmp_path / "save" / record["file"]) and kind == "SentencePiece"
    assert record["file"].startswith("tokenizer/") and not Path(record["file"]).is_absolute()
    assert file_sha256(path) == file_sha256(tokenizer_model)
    # the save directory moved too: the copy is found relative to it
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "save", moved)
    path, _ = checkpoint_tokenizer(find_checkpoint(str(moved), verify=False), None)
    assert path.startswith(str(moved))


def test_checkpoint_refuses_another_tokenizer(tokenizer_model, other_model, tmp_path):
    _checkpoint(tmp_path / "save", Tokenizer(tokenizer_model))
    info = find_checkpoint(str(tmp_path / "save"), verify=False)
    assert checkpoint_tokenizer(info, tokenizer_model)[0] == tokenizer_model  # the same: fine
    with pytest.raises(ConfigError, match=r"^--vocab-file: .* is not the tokenizer .* sha256"):
        checkpoint_tokenizer(info, other_model, "--vocab-file")


def test_damaged_copy_falls_back_to_the_intact_original(tokenizer_model, tmp_path):
    original = Path(shutil.copy(tokenizer_model, tmp_path / "tok.model"))
    _checkpoint(tmp_path / "save", Tokenizer(original))
    info = find_checkpoint(str(tmp_path / "save"), verify=False)
    copy = tmp_path / "save" / info.meta["tokenizer"]["file"]
    copy.write_bytes(copy.read_bytes()[:-7])  # truncated
    assert checkpoint_tokenizer(info, None) == (str(original), "SentencePiece")
    original.write_bytes(b"damaged too")
    with pytest.raises(ConfigError, match="are not the tokenizer") as e:
        checkpoint_tokenizer(info, None)
    assert str(copy) in str(e.value) and str(original) in str(e.value)
    assert "\n" not in str(e.value)


def test_old_checkpoint_reads_the_file_its_configs_name(tokenizer_model, tmp_path):
    _checkpoint(tmp_path / "save", Tokenizer(tokenizer_model), record=False)
    info = find_checkpoint(str(tmp_path / "save"), verify=False)
    assert checkpoint_tokenizer(info, None) == (tokenizer_model, "SentencePiece")


# -- resuming: --load's checkpoint was trained with this run's tokenizer --------------------


def _pretraining_configs(dataset: dict, tokenizer_model: str, load: Path):
    from megatron_taco.cli.pretrain_taco import SPEC

    argv = ["--model-size", "tiny", "--seq-length", "64", "--data-path", dataset["prefix"],
            "--tokenizer-model", tokenizer_model, "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "4", "--load", str(load)]  # fmt: skip
    args = build_parser(SPEC).parse_args(argv)
    return configs_from_args(SPEC, args, world_size=1, device_type="cpu")


def test_pretraining_resume_refuses_another_tokenizer_naming_both_files(
    botchan_dataset, other_model, tmp_path
):
    """The dataset is the given tokenizer's (its summary check passes); the checkpoint was
    trained with a tokenizer of the same size but other content."""
    given = botchan_dataset["tokenizer"]
    _checkpoint(tmp_path / "save", Tokenizer(other_model))
    copy = tmp_path / "save" / saved_tokenizer_record(Tokenizer(other_model))["file"]
    with pytest.raises(ConfigError) as info:
        _pretraining_configs(botchan_dataset, given, tmp_path / "save")
    message = str(info.value)
    assert message.startswith(f"--tokenizer-model: {given} (SentencePiece, sha256 ")
    assert f"is not the tokenizer {tmp_path / 'save' / 'iter_0000002'} was trained with" in message
    assert f"({copy}: SentencePiece, 800 pieces, sha256 {file_sha256(other_model)[:12]})" in message
    assert "\n" not in message
    assert not torch.distributed.is_initialized()


def test_pretraining_resume_accepts_the_same_tokenizer_at_another_path(botchan_dataset, tmp_path):
    elsewhere = Path(shutil.copy(botchan_dataset["tokenizer"], tmp_path / "elsewhere.model"))
    _checkpoint(tmp_path / "save", Tokenizer(elsewhere))
    elsewhere.unlink()  # neither its path nor its presence matters, its content does
    cfg = _pretraining_configs(botchan_dataset, botchan_dataset["tokenizer"], tmp_path / "save")
    assert cfg.plan.iteration == 2


def _finetune_configs(pretrained: Path, output: Path, data: Path, *extra: str):
    from megatron_taco.recipes.finetune import SPEC

    argv = ["--load", str(pretrained), "--task", "custom", "--data-dir", str(data),
            "--output", str(output), "--micro-batch-size", "4", "--global-batch-size", "4",
            "--seq-length", "32", *extra]  # fmt: skip
    args = build_parser(SPEC).parse_args(argv)
    return configs_from_args(SPEC, args, world_size=1, device_type="cpu")


def _finetune_checkpoint(output: Path, tokenizer: Tokenizer) -> None:
    """The checkpoint a fine-tuning run saved in OUTPUT/checkpoints (metadata only)."""
    save = output / "checkpoints"
    _checkpoint(save, tokenizer)
    meta = json.loads((save / "iter_0000002" / "metadata.json").read_text())
    meta.pop("checksum"), meta.pop("files")
    meta.update(model="finetune", task="custom", labels=["neg", "pos"],
                pretrained={"model": "TACO"})  # fmt: skip
    _write_metadata(str(save / "iter_0000002"), meta, {})


def test_finetuning_resume_checks_its_own_checkpoints_tokenizer(
    tokenizer_model, other_model, tmp_path
):
    """Resuming --output: the run's checkpoint must have been trained with the tokenizer the
    pretrained checkpoint gives now (here --load's directory was trained again with another
    vocabulary of the same size since the run saved); the same tokenizer given at another
    path resumes."""
    from megatron_taco.recipes.finetune_output import claim_output, run_record
    from tests.helpers import write_marker_task

    write_marker_task(tmp_path / "task")
    pretrained, output = tmp_path / "pretrained", tmp_path / "ft"
    _checkpoint(pretrained, Tokenizer(tokenizer_model))
    cfg = _finetune_configs(pretrained, output, tmp_path / "task")
    claim_output(str(output), run_record(cfg), write=True)  # run.json, as the run writes it
    _finetune_checkpoint(output, Tokenizer(other_model))
    with pytest.raises(ConfigError) as info:
        _finetune_configs(pretrained, output, tmp_path / "task")
    message = str(info.value)
    assert message.startswith(f"--tokenizer-model: {cfg.data.tokenizer_model} (SentencePiece")
    assert f"{output / 'checkpoints' / 'iter_0000002'} was trained with" in message
    assert f"{output / 'checkpoints' / 'tokenizer'}" in message and "\n" not in message
    assert not torch.distributed.is_initialized()

    shutil.rmtree(output / "checkpoints")
    _finetune_checkpoint(output, Tokenizer(tokenizer_model))
    elsewhere = shutil.copy(tokenizer_model, tmp_path / "elsewhere.model")
    resumed = _finetune_configs(pretrained, output, tmp_path / "task",
                                "--tokenizer-model", str(elsewhere))  # fmt: skip
    assert resumed.plan.iteration == 2 and resumed.data.tokenizer_model == str(elsewhere)


def test_pretraining_resumes_a_checkpoint_written_before_the_record(
    botchan_dataset, other_model, tmp_path
):
    """A checkpoint without metadata.json's "tokenizer" (written before it was recorded)
    resumes unchecked: nothing tells its tokenizer's content, and refusing would strand it."""
    _checkpoint(tmp_path / "save", Tokenizer(other_model), record=False)
    cfg = _pretraining_configs(botchan_dataset, botchan_dataset["tokenizer"], tmp_path / "save")
    assert cfg.plan.iteration == 2


def test_pretraining_resume_refuses_another_tokenizer_when_the_recorded_file_is_gone(
    botchan_dataset, other_model, tmp_path
):
    """The record's hash still decides when neither the copy in --save nor the original is
    left: the message says the file is gone and what the record describes."""
    original = Path(shutil.copy(other_model, tmp_path / "other.model"))
    _checkpoint(tmp_path / "save", Tokenizer(original))
    original.unlink()
    shutil.rmtree(tmp_path / "save" / "tokenizer")
    with pytest.raises(ConfigError) as info:
        _pretraining_configs(botchan_dataset, botchan_dataset["tokenizer"], tmp_path / "save")
    assert (
        f"(its file is gone: SentencePiece, 800 pieces, sha256 {file_sha256(other_model)[:12]})"
        in str(info.value)
    )

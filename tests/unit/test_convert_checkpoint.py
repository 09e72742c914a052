"""The partition layout of a model (checkpoint/reshard.py), without DeepSpeed:

* splitting a tp=1 model's state dict for tp=2 gives exactly what the models built at
  tp=2 ranks 0 and 1 hold (the parallel layers initialise tp-invariantly), for TACO (fused
  stride-2 projections) and SAS^DA; merging gives the tp=1 state dict back, vocabulary
  padding removed and restored;
* the vocabulary-parallel parameters are found by their shape alone;
* plan_resume refuses each layout change DeepSpeed cannot load, in one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.checkpoint.layout import FORMAT
from megatron_taco.checkpoint.manifest import read_metadata
from megatron_taco.checkpoint.manifest import write_metadata as _write_metadata
from megatron_taco.checkpoint.plan import Candidate, ResumeRequest, RunLayout, plan_resume
from megatron_taco.checkpoint.reshard import ModelLayout
from megatron_taco.errors import ConfigError
from megatron_taco.models.sas.model import SasForPretraining
from megatron_taco.models.taco.model import TacoForPretraining
from megatron_taco.parallel.state import ParallelState
from tests.helpers import VOCAB, tiny_config, tiny_sas_config

MODELS = {
    "taco": (TacoForPretraining, tiny_config),
    "sas_da": (SasForPretraining, lambda: tiny_sas_config(disentangled_attention=True)),
}


def builder(name: str):
    model_cls, make_config = MODELS[name]
    config = dataclasses.replace(make_config(), hidden_dropout=0.0, attention_dropout=0.0)

    def build(parallel, vocab_size: int):
        return model_cls(config.with_vocab_size(vocab_size), parallel)

    return build


def built_at(build, tp: int, rank: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    parallel = ParallelState(world_size=tp, rank=rank, tp_size=tp, tp_group=None, dp_group=None)
    return build(parallel, VOCAB).state_dict()


@pytest.mark.parametrize("name", MODELS)
def test_split_equals_the_models_built_at_tp2_and_merge_inverts_it(name):
    build = builder(name)
    one, two = ModelLayout(build, 1, VOCAB), ModelLayout(build, 2, VOCAB)
    full = one.merge([built_at(build, 1, 0)], "tp1")
    parts = two.split(full)
    for rank in (0, 1):
        expected = built_at(build, 2, rank)
        assert list(parts[rank]) == list(expected)
        for key, tensor in expected.items():
            assert torch.equal(parts[rank][key], tensor), (rank, key)
    merged = two.merge(parts, "tp2")
    assert all(torch.equal(merged[k], full[k]) for k in full)
    (padded,) = one.split(merged)
    assert all(torch.equal(padded[k], v) for k, v in built_at(build, 1, 0).items())


def test_layout_of_taco_at_tp2():
    layout = ModelLayout(builder("taco"), 2, VOCAB)
    vocab = sorted(n for n, p in layout.params.items() if p.vocab)
    assert vocab == ["heads.mlm_bias", "taco.embeddings.word_embeddings.weight"]
    word = layout.params["taco.embeddings.word_embeddings.weight"]
    assert (word.shape[0], layout.padded_vocab_size) == (128, 256)
    assert layout.full_shape("taco.embeddings.word_embeddings.weight")[0] == VOCAB
    assert layout.params["taco.layers.0.attention.relative_kq.weight"].stride == 2
    assert not layout.params["taco.embeddings.we_layernorm.weight"].split
    grouped = [n for names in layout.groups for n in names]
    assert sorted(grouped) == sorted(layout.params)  # each parameter in one optimizer group


def test_a_meta_build_allocates_nothing():
    layout = ModelLayout(builder("sas_da"), 2, 50_000)
    assert layout.params["sas.embeddings.word_embeddings.weight"].shape == (25_088, 32)


def _checkpoint(tmp_path, *, tp=1, dp=2, stage=1, precision="fp32", **extra):
    iter_dir = tmp_path / "ckpt" / "iter_0000004"
    iter_dir.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4\n")
    ds = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}
    meta = {"format": FORMAT, "iteration": 4, "consumed_samples": 16, "world_size": tp * dp,
            "tensor_model_parallel_size": tp, "data_parallel_size": dp,
            "configs": {"deepspeed": ds}, **extra}  # fmt: skip
    _write_metadata(str(iter_dir), meta, {})
    return str(tmp_path / "ckpt")


def _request(load, world=2, tp=1, stage=1, precision="fp32", optimizer=None, **flags):
    layout = RunLayout(
        world_size=world,
        tp_size=tp,
        zero_stage=stage,
        precision=precision,
        optimizer=optimizer,
        deepspeed_config="ds.json",
    )
    return ResumeRequest(CheckpointConfig(load=load, **flags), layout=layout)


def _check(load, **kwargs):
    plan_resume(_request(load, **kwargs))


def test_resume_layout_checks(tmp_path):
    load = _checkpoint(tmp_path)
    _check(load)  # the same layout
    cases = [
        (dict(world=1), "data parallel size 2 with ZeRO stage 1"),
        (dict(world=2, tp=2), "tensor parallel size 1, this run uses 2"),
        (dict(stage=0), "ZeRO stage 1 in fp32, which DeepSpeed cannot load into ZeRO stage 0"),
        (dict(precision="bf16"), "cannot load into ZeRO stage 1 in bf16"),
        (dict(stage=3), "ZeRO-3 checkpoints resume only at their own layout"),
        (dict(world=1, no_load_optim=True), "RNG states of 2 ranks, this run has 1"),
    ]
    for kwargs, expected in cases:
        with pytest.raises(ConfigError) as error:
            _check(load, **kwargs)
        assert expected in str(error.value) and "\n" not in str(error.value), kwargs
    assert "taco-convert-checkpoint --load" in str(
        pytest.raises(ConfigError, _check, load, world=1).value
    )
    _check(load, world=1, no_load_optim=True, no_load_rng=True)
    # --finetune loads the module only: another data-parallel layout and ZeRO stage pass,
    # another tensor-parallel size does not (its shards are other tensors).
    _check(load, world=4, tp=1, stage=0, finetune=True)
    with pytest.raises(ConfigError, match="saved with tensor parallel size 1, this run uses 2"):
        _check(load, world=4, tp=2, finetune=True)


def test_zero0_may_change_data_parallel_size(tmp_path):
    load = _checkpoint(tmp_path, stage=0, dp=1)
    _check(load, world=2, stage=0, no_load_rng=True)


def test_converted_checkpoint_without_rng_states(tmp_path):
    load = _checkpoint(tmp_path, converted_from={"iteration": 4}, rng_states=False)
    with pytest.raises(ConfigError, match="holds no RNG states"):
        _check(load)
    _check(load, no_load_rng=True)


def test_resume_with_another_adam_is_refused(tmp_path):
    # apex's FusedAdam keeps "step" per parameter group, torch's AdamW per parameter.
    load = _checkpoint(tmp_path, optimizer="apex.optimizers.FusedAdam")

    def check(optimizer, **flags):
        _check(load, optimizer=optimizer, **flags)

    with pytest.raises(ConfigError) as error:
        check("torch.optim.AdamW")
    message = str(error.value)
    assert message.startswith(
        f"--load: {load}/iter_0000004 holds the state of apex.optimizers.FusedAdam, this run "
        "uses torch.optim.AdamW"
    )
    assert "--no-load-optim" in message and "\n" not in message
    check("apex.optimizers.FusedAdam")
    check("torch.optim.AdamW", no_load_optim=True)
    check("torch.optim.AdamW", finetune=True)


def test_a_checkpoint_that_does_not_name_its_adam_is_left_to_deepspeed(tmp_path):
    _check(_checkpoint(tmp_path), optimizer="torch.optim.AdamW")


def test_a_fallback_checkpoint_with_another_adam_is_refused(tmp_path):
    """The driver's check of a --load-fallback checkpoint chosen after the rendezvous is the
    one of the checkpoint verified before it: the Adam implementation included."""
    load = _checkpoint(tmp_path, optimizer="apex.optimizers.FusedAdam")
    request = _request(load, optimizer="torch.optim.AdamW", load_fallback=True)
    candidate = Candidate(load, 4, read_metadata(f"{load}/iter_0000004"))
    with pytest.raises(
        ConfigError, match="holds the state of apex.optimizers.FusedAdam, this run uses torch"
    ):
        request.check(candidate)

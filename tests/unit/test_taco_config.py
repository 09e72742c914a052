import argparse
import dataclasses

import pytest

from megatron_taco.errors import ConfigError
from megatron_taco.models.taco.config import PRESETS, TacoConfig


def test_defaults_are_taco_base_table7():
    c = TacoConfig()
    assert (c.num_layers, c.we_hidden_size, c.pe_hidden_size) == (12, 648, 120)
    assert (c.we_ffn_hidden_size, c.pe_ffn_hidden_size) == (2592, 480)
    assert (c.we_attention_heads, c.pe_attention_heads, c.kv_channels) == (12, 6, 64)
    assert (c.max_relative_distance, c.relative_embedding_size, c.max_position_embeddings) == (
        511,
        768,
        512,
    )
    assert c.hidden_dropout == c.attention_dropout == 0.1
    assert c.layernorm_epsilon == 1e-12
    assert c.hidden_size == 768
    assert c.num_relative_buckets == 1024 and c.mask_bucket == 1023
    assert c.conv_in_channels(first_layer=True) == 3 * 12 + 6
    assert c.conv_in_channels(first_layer=False) == 4 * 12 + 2 * 6
    assert c.conv_out_channels == 18


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TacoConfig().num_layers = 3


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_record_their_name(name):
    c = TacoConfig.preset(name)
    assert c.model_size == name
    for field, value in PRESETS[name].items():
        assert getattr(c, field) == value
    c.validate_parallel(2)


def test_preset_overrides_win():
    c = TacoConfig.preset("small", num_layers=3, vocab_size=77)
    assert c.num_layers == 3 and c.vocab_size == 77 and c.we_hidden_size == 192


def test_unknown_preset_names_the_flag():
    with pytest.raises(ConfigError, match="--model-size"):
        TacoConfig.preset("huge")
    with pytest.raises(ConfigError, match="--model-size"):
        TacoConfig(model_size="huge")


def test_relative_distance_must_be_below_max_positions():
    with pytest.raises(ConfigError, match="--max-relative-distance"):
        TacoConfig(max_relative_distance=512, max_position_embeddings=512)
    TacoConfig(max_relative_distance=100, max_position_embeddings=512)


@pytest.mark.parametrize(
    "field, flag",
    [
        ("num_layers", "--num-layers"),
        ("we_hidden_size", "--we-hidden-size"),
        ("pe_attention_heads", "--pe-attention-heads"),
        ("kv_channels", "--kv-channels"),
        ("relative_embedding_size", "--relative-embedding-size"),
    ],
)
def test_non_positive_sizes_name_the_flag(field, flag):
    with pytest.raises(ConfigError, match=flag):
        TacoConfig(**{field: 0})


@pytest.mark.parametrize(
    "field, flag",
    [("hidden_dropout", "--hidden-dropout"), ("attention_dropout", "--attention-dropout")],
)
def test_dropout_range(field, flag):
    with pytest.raises(ConfigError, match=flag):
        TacoConfig(**{field: 1.0})


def test_epsilon_and_std_positive():
    with pytest.raises(ConfigError, match="--layernorm-epsilon"):
        TacoConfig(layernorm_epsilon=0.0)
    with pytest.raises(ConfigError, match="--init-method-std"):
        TacoConfig(init_method_std=-1.0)


@pytest.mark.parametrize(
    "overrides, tp, flag",
    [
        ({}, 5, "--we-attention-heads"),  # 12 WE heads
        ({"we_attention_heads": 8, "pe_attention_heads": 6}, 4, "--pe-attention-heads"),
        (
            {"we_attention_heads": 4, "pe_attention_heads": 4, "we_ffn_hidden_size": 30},
            4,
            "--we-ffn-hidden-size",
        ),
        (
            {"we_attention_heads": 4, "pe_attention_heads": 4, "pe_ffn_hidden_size": 30},
            4,
            "--pe-ffn-hidden-size",
        ),
    ],
)
def test_validate_parallel_names_the_flag(overrides, tp, flag):
    c = TacoConfig(**overrides)
    with pytest.raises(ConfigError, match=flag) as err:
        c.validate_parallel(tp)
    assert "--tensor-model-parallel-size" in str(err.value)


def test_base_splits_over_2_and_3_and_6():
    for tp in (1, 2, 3, 6):
        TacoConfig().validate_parallel(tp)


def test_vocab_size_required_by_the_model():
    c = TacoConfig()
    with pytest.raises(ConfigError, match="--vocab-size"):
        c.require_vocab()
    c.with_vocab_size(32000).require_vocab()


def _parse(argv):
    parser = argparse.ArgumentParser()
    TacoConfig.add_args(parser)
    return TacoConfig.from_args(parser.parse_args(argv))


def test_flags_without_preset():
    c = _parse(["--num-layers", "6", "--we-hidden-size", "600", "--recompute-activations"])
    assert c.num_layers == 6 and c.we_hidden_size == 600 and c.recompute_activations
    assert c.pe_hidden_size == 120 and c.model_size is None
    assert _parse([]) == TacoConfig()


def test_explicit_flags_override_the_preset():
    c = _parse(["--model-size", "small", "--num-layers", "12", "--hidden-dropout", "0.0"])
    assert c.model_size == "small"
    assert c.num_layers == 12  # explicitly given, even though it equals the base default
    assert c.we_hidden_size == 192 and c.hidden_dropout == 0.0


def test_unknown_preset_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        _parse(["--model-size", "huge"])


def test_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError, match="--max-relative-distance"):
        _parse(["--max-position-embeddings", "128"])  # k=511 >= 128


# Paper configurations (vocab 30522, k = 511): Table 5 varies (d_WE, d_PE) with 6+6 heads
# and relative width d_PE; Table 6 varies the heads at (648, 120); Table 3 is TACO-base
# (relative width 768). FFNs are 4x each stream's hidden size. The paper counts the
# encoder (embeddings and layers), not the pre-training heads.
PAPER_COUNTS = [
    (dict(we_hidden_size=648, pe_hidden_size=120, we_attention_heads=6, pe_attention_heads=6,
          we_ffn_hidden_size=2592, pe_ffn_hidden_size=480, relative_embedding_size=120), 80.4),
    (dict(we_hidden_size=576, pe_hidden_size=192, we_attention_heads=6, pe_attention_heads=6,
          we_ffn_hidden_size=2304, pe_ffn_hidden_size=768, relative_embedding_size=192), 71.1),
    (dict(we_hidden_size=504, pe_hidden_size=264, we_attention_heads=6, pe_attention_heads=6,
          we_ffn_hidden_size=2016, pe_ffn_hidden_size=1056, relative_embedding_size=264), 64.3),
    (dict(we_attention_heads=12, pe_attention_heads=6, relative_embedding_size=120), 87.5),
    (dict(we_attention_heads=12, pe_attention_heads=12, relative_embedding_size=120), 88.6),
    (dict(), 100.1),
]  # fmt: skip


@pytest.mark.parametrize("sizes,paper_millions", PAPER_COUNTS)
def test_parameter_counts_match_the_paper(sizes, paper_millions):
    import torch

    from megatron_taco.models.taco.model import TacoModel
    from megatron_taco.parallel.state import single_process_state

    config = TacoConfig(vocab_size=30522, **sizes)
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = TacoModel(config, single_process_state())
    emb = model.embeddings.word_embeddings
    padding = (emb.padded_vocab_size - emb.vocab_size) * config.we_hidden_size
    count = sum(p.numel() for p in model.parameters()) - padding
    assert abs(count / 1e6 - paper_millions) < 0.1, (sizes, count)


def test_value_head_size_defaults_to_hidden_over_heads():
    base = TacoConfig()
    assert (base.we_value_size, base.pe_value_size) == (54, 20)
    assert TacoConfig(we_value_channels=64, pe_value_channels=64).we_value_size == 64
    c = _parse(["--we-value-channels", "32", "--pe-value-channels", "16"])
    assert (c.we_value_size, c.pe_value_size) == (32, 16)
    with pytest.raises(ConfigError, match="--we-value-channels: defaults to --we-hidden-size"):
        TacoConfig(we_hidden_size=650)
    with pytest.raises(ConfigError, match="--pe-value-channels: must be a positive integer"):
        TacoConfig(pe_value_channels=0)

"""TrainingConfig validation, the DeepSpeed JSON merge, the shipped ds_configs, and the
CLI's promise to reject bad configs before any process-group or file work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_taco.arguments import dataclass_from_args
from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.cli.pretrain_taco import SPEC, main
from megatron_taco.errors import ConfigError
from megatron_taco.parallel.state import single_process_state
from megatron_taco.training.config import DEFAULT_WARMUP_ITERS, TrainingConfig
from megatron_taco.training.configure import build_parser, configs_from_args, flag_configs
from megatron_taco.training.deepspeed_config import resolve_deepspeed_config

REPO = Path(__file__).resolve().parents[2]
DS_CONFIGS = REPO / "ds_configs"


def cfg(**kw) -> TrainingConfig:
    values = dict(train_iters=100, lr_warmup_iters=10)
    values.update(kw)
    return TrainingConfig(**values)


def write_json(tmp_path: Path, data: dict, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


# -- TrainingConfig ---------------------------------------------------------------------


def test_defaults_follow_megatron():
    c = TrainingConfig(train_iters=20000)
    assert (c.lr, c.min_lr, c.weight_decay, c.clip_grad) == (1e-4, 0.0, 0.01, 1.0)
    assert (c.adam_beta1, c.adam_beta2, c.adam_eps) == (0.9, 0.999, 1e-6)
    assert c.lr_decay_style == "linear"
    # The default warm-up: 10% of the decay iterations, at most DEFAULT_WARMUP_ITERS.
    assert c.warmup_iters == 2000 and c.decay_iters == 20000
    assert TrainingConfig(train_iters=500_000).warmup_iters == DEFAULT_WARMUP_ITERS


def test_batch_layout_and_errors_name_the_flags():
    c = cfg(micro_batch_size=4, global_batch_size=32)
    assert c.batch_layout(2) == (32, 4)
    assert c.batch_layout(8) == (32, 1)
    with pytest.raises(ConfigError) as e:
        c.batch_layout(3)
    msg = str(e.value)
    assert "--global-batch-size 32" in msg and "--micro-batch-size 4" in msg
    assert "data-parallel size 3" in msg
    # Without --global-batch-size: one micro-batch per data-parallel rank.
    assert cfg(micro_batch_size=4).batch_layout(3) == (12, 1)


def test_global_batch_must_be_a_multiple_of_micro_batch():
    with pytest.raises(
        ConfigError, match=r"^--global-batch-size: 10 is not a multiple of --micro-batch-size 4"
    ):
        cfg(micro_batch_size=4, global_batch_size=10)


@pytest.mark.parametrize(
    "kw,flag",
    [
        (dict(train_iters=0), "--train-iters"),
        (dict(micro_batch_size=0), "--micro-batch-size"),
        (dict(lr=0.0), "--lr"),
        (dict(min_lr=1.0), "--min-lr"),
        (dict(lr_decay_style="step"), "--lr-decay-style"),
        (dict(adam_beta2=1.0), "--adam-beta2"),
        (dict(clip_grad=-1.0), "--clip-grad"),
        (dict(eval_iters=-1), "--eval-iters"),
        (dict(lr_warmup_fraction=0.1), "--lr-warmup-fraction"),  # with --lr-warmup-iters
        (dict(lr_warmup_iters=100), "--lr-warmup-iters"),  # not fewer than the decay iters
        # Megatron's sample-based flags: exclusive with the -iters forms.
        (dict(total_train_samples=100), "--train-iters"),  # with --train-iters
        (dict(train_iters=None, total_train_samples=0), "--train-samples"),
        (dict(lr_warmup_iters=None, lr_warmup_samples=8), "--lr-warmup-samples"),
        (dict(lr_warmup_iters=None, lr_decay_samples=80), "--lr-decay-samples"),
        (dict(train_iters=None, total_train_samples=800), "--lr-warmup-iters"),
        (
            dict(
                train_iters=None, total_train_samples=800, lr_warmup_iters=None, lr_decay_iters=50
            ),
            "--lr-decay-iters",
        ),  # fmt: skip
        (
            dict(
                train_iters=None,
                total_train_samples=800,
                lr_warmup_iters=None,
                lr_warmup_samples=800,
            ),
            "--lr-warmup-samples",
        ),  # not fewer than the decay  # fmt: skip
        (
            dict(
                train_iters=None,
                total_train_samples=800,
                lr_warmup_iters=None,
                lr_warmup_samples=8,
                lr_warmup_fraction=0.1,
            ),
            "--lr-warmup-fraction",
        ),  # fmt: skip
        (dict(bf16=True, fp16=True), "--fp16"),
    ],
)
def test_invalid_values_name_their_flag(kw, flag):
    with pytest.raises(ConfigError) as e:
        cfg(**kw)
    assert str(e.value).startswith(flag + ":"), str(e.value)


@pytest.mark.parametrize(
    "kw,flag",
    [
        (dict(save_interval=5), "--save-interval"),  # needs --save
        (dict(save="ck", save_interval=0), "--save-interval"),
        (dict(ckpt_step=3), "--ckpt-step"),  # needs --load
        (dict(load="ck", ckpt_step=-1), "--ckpt-step"),
        (dict(save=""), "--save"),
        (dict(override_existing_checkpoints=True), "--override-existing-checkpoints"),
        (dict(load_fallback=True), "--load-fallback"),  # needs --load
    ],
)
def test_invalid_checkpoint_values_name_their_flag(kw, flag):
    with pytest.raises(ConfigError) as e:
        CheckpointConfig(**kw)
    assert str(e.value).startswith(flag + ":"), str(e.value)


def test_default_warmup_is_a_tenth_of_a_short_run():
    assert TrainingConfig(train_iters=50).warmup_iters == 5
    assert TrainingConfig(train_iters=300, lr_decay_iters=200).warmup_iters == 20
    # Given explicitly, a warm-up as long as the decay is refused with both flags named.
    with pytest.raises(ConfigError, match=r"^--lr-warmup-iters: 50 warmup iterations"):
        TrainingConfig(train_iters=50, lr_warmup_iters=50)


def test_warmup_fraction_is_of_the_decay_iters():
    c = TrainingConfig(train_iters=100, lr_decay_iters=80, lr_warmup_fraction=0.25)
    assert (c.warmup_iters, c.decay_iters) == (20, 80)


def test_train_samples_become_megatrons_iterations_and_sample_schedule():
    c = TrainingConfig(total_train_samples=1000, micro_batch_size=4, lr_warmup_samples=60)
    # Megatron's update_train_iters: train_samples // global batch size, here 4 x dp 3.
    r = c.resolve_length(3)
    assert (r.train_iters, r.global_batch_size, r.total_train_samples) == (83, 12, 1000)
    assert r.schedule() == (60, 1000, 12) and r.warmup_iters == 5
    assert r.describe_schedule() == "warmup 60 samples, linear decay over 1000 samples"
    assert r.resolve_length(3) is r and r.train_samples(3) == 83 * 12
    # The default warm-up: 10% of the decay samples, at most 10000 global batches.
    assert TrainingConfig(total_train_samples=500, lr_decay_samples=400).warmup_samples == 40
    with pytest.raises(ConfigError, match=r"^--train-samples: 10 is fewer than one global batch"):
        TrainingConfig(
            total_train_samples=10, global_batch_size=16, micro_batch_size=8
        ).resolve_length(1)
    # An iteration-based config is unchanged, its schedule in iterations.
    assert cfg().resolve_length(4) == cfg() and cfg().schedule() == (10, 100, 1)


def test_metrics_file_defaults():
    assert cfg().metrics_path(None) is None
    assert cfg().metrics_path("ck") == "ck/metrics.jsonl"  # in --save
    assert cfg(tensorboard_dir="tb").metrics_path("ck") == "tb/metrics.jsonl"
    assert cfg(metrics_file="m.jsonl").metrics_path("ck") == "m.jsonl"


# -- DeepSpeed JSON ---------------------------------------------------------------------


def test_our_values_are_written_into_the_json(tmp_path):
    path = write_json(tmp_path, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    c = cfg(micro_batch_size=2, global_batch_size=16, clip_grad=0.5, deepspeed_config=path)
    s = resolve_deepspeed_config(c, 2, device_type="cpu")
    assert s.config["train_batch_size"] == 16
    assert s.config["train_micro_batch_size_per_gpu"] == 2
    assert s.config["gradient_accumulation_steps"] == 4
    assert s.config["gradient_clipping"] == 0.5
    assert (s.zero_stage, s.precision, s.source) == (2, "bf16", path)
    assert (s.global_batch_size, s.grad_accum_steps) == (16, 4)


def test_matching_or_auto_values_are_accepted(tmp_path):
    path = write_json(
        tmp_path,
        {
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_clipping": 1.0,
        },
    )
    c = cfg(micro_batch_size=2, global_batch_size=16, deepspeed_config=path)
    assert (
        resolve_deepspeed_config(c, 2, device_type="cpu").config["train_micro_batch_size_per_gpu"]
        == 2
    )


@pytest.mark.parametrize(
    "key,value,flag",
    [
        ("train_batch_size", 64, "--global-batch-size"),
        ("train_micro_batch_size_per_gpu", 8, "--micro-batch-size"),
        ("gradient_accumulation_steps", 1, "--global-batch-size / --micro-batch-size"),
        ("gradient_clipping", 0.0, "--clip-grad"),
    ],
)
def test_conflicting_json_values_name_file_key_and_flag(tmp_path, key, value, flag):
    path = write_json(tmp_path, {key: value})
    c = cfg(micro_batch_size=2, global_batch_size=16, deepspeed_config=path)
    with pytest.raises(ConfigError) as e:
        resolve_deepspeed_config(c, 2, device_type="cpu")
    msg = str(e.value)
    assert path in msg and repr(key) in msg and flag in msg


@pytest.mark.parametrize(
    ("flag", "data", "want"),
    [("bf16", None, "bf16"),  # no JSON: the flag chooses
     ("fp16", None, "fp16"),
     ("bf16", "zero0_fp32.json", "bf16"),  # an fp32 JSON: the flag overrides it
     ("bf16", "zero2_bf16.json", "bf16"),
     ("fp16", "zero1_fp16.json", "fp16")],
)  # fmt: skip
def test_precision_flags_choose_or_override_the_json(flag, data, want):
    path = None if data is None else str(DS_CONFIGS / data)
    settings = resolve_deepspeed_config(
        cfg(**{flag: True}, deepspeed_config=path), 1, device_type="cuda"
    )
    assert settings.precision == want and settings.config[want]["enabled"] is True
    if data == "zero1_fp16.json":  # the JSON's own keys of the section are kept
        assert settings.config["fp16"]["loss_scale"] == json.loads(
            (DS_CONFIGS / data).read_text())["fp16"]["loss_scale"]  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "data"), [("bf16", "zero2_fp16.json"), ("fp16", "zero2_bf16.json")]
)
def test_a_precision_flag_contradicting_the_json_is_one_line(flag, data):
    other = "fp16" if flag == "bf16" else "bf16"
    with pytest.raises(ConfigError) as e:
        resolve_deepspeed_config(cfg(**{flag: True}, deepspeed_config=str(DS_CONFIGS / data)), 1,
                                 device_type="cuda")  # fmt: skip
    assert str(e.value) == (
        f"--{flag}: --deepspeed-config {DS_CONFIGS / data} enables {other}; drop the flag or "
        f"use a {flag} config (e.g. ds_configs/zero2_{flag}.json)"
    )


def test_fp16_flag_on_cpu_names_the_flag():
    with pytest.raises(ConfigError, match=r"^--fp16: fp16 needs a GPU"):
        resolve_deepspeed_config(cfg(fp16=True), 1, device_type="cpu")


def test_a_wandb_section_is_refused_pointing_at_the_flags(tmp_path):
    path = write_json(tmp_path, {"wandb": {"enabled": True, "project": "x"}})
    with pytest.raises(ConfigError) as e:
        resolve_deepspeed_config(cfg(deepspeed_config=path), 1, device_type="cpu")
    assert "\n" not in str(e.value) and f"{path}: key 'wandb' is not supported" in str(e.value)
    assert "--wandb-project" in str(e.value)


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_optimizer_and_scheduler_sections_are_refused(tmp_path, section):
    path = write_json(tmp_path, {section: {"type": "Adam", "params": {}}})
    with pytest.raises(ConfigError, match=rf"{path}: key '{section}' is not allowed"):
        resolve_deepspeed_config(cfg(deepspeed_config=path), 1, device_type="cpu")


def test_fp16_is_refused_on_cpu_only(tmp_path):
    path = write_json(tmp_path, {"fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match="fp16 needs a GPU; use a bf16 or fp32 config"):
        resolve_deepspeed_config(cfg(deepspeed_config=path), 1, device_type="cpu")
    assert (
        resolve_deepspeed_config(cfg(deepspeed_config=path), 1, device_type="cuda").precision
        == "fp16"
    )


@pytest.mark.parametrize(
    "data,match",
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
        ({"amp": {"enabled": True}}, "'amp'"),
        # DeepSpeed would stop with NotImplementedError after the rendezvous.
        (
            {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
            r"'data_types.grad_accum_dtype' 'fp32' differs from the model's bf16, which "
            "DeepSpeed supports only with ZeRO stage 1-3",
        ),
        ({"data_types": {"grad_accum_dtype": "fp33"}}, "'fp33' is not a dtype DeepSpeed knows"),
        # DeepSpeed's ZeRO-1/2 optimizer raises ValueError in the engine build otherwise.
        (
            {"zero_optimization": {"stage": 2, "compute_grad_norm": False}},
            r"'zero_optimization.compute_grad_norm' false leaves no norm to clip with: set "
            r"--clip-grad 0 .* \(--clip-grad is 1\)",
        ),
    ],
)
def test_bad_json_settings(tmp_path, data, match):
    path = write_json(tmp_path, data)
    with pytest.raises(ConfigError, match=match):
        resolve_deepspeed_config(cfg(deepspeed_config=path), 1, device_type="cuda")


def test_no_norm_is_accepted_without_clipping(tmp_path):
    path = write_json(tmp_path, {"zero_optimization": {"stage": 2, "compute_grad_norm": False}})
    settings = resolve_deepspeed_config(cfg(deepspeed_config=path, clip_grad=0.0), 1,
                                        device_type="cpu")  # fmt: skip
    assert settings.config["zero_optimization"]["compute_grad_norm"] is False


def test_missing_or_broken_json_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"^--deepspeed-config: .*nope.json does not exist"):
        resolve_deepspeed_config(
            cfg(deepspeed_config=str(tmp_path / "nope.json")), 1, device_type="cpu"
        )
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"^--deepspeed-config: .*bad.json is not valid JSON"):
        resolve_deepspeed_config(cfg(deepspeed_config=str(bad)), 1, device_type="cpu")


def test_no_json_means_zero0_fp32():
    s = resolve_deepspeed_config(cfg(), 1, device_type="cpu")
    assert (s.zero_stage, s.precision, s.source) == (0, "fp32", "<default>")


def test_throughput_timer_off_unless_the_json_turns_it_on():
    from deepspeed.runtime.config import DeepSpeedConfig

    def resolved(ds_json):
        config = resolve_deepspeed_config(cfg(), 1, device_type="cpu", ds_json=ds_json).config
        return DeepSpeedConfig(config, mpu=single_process_state()).timers_config

    assert not resolved({}).enabled
    assert not resolved({"timers": {"throughput": {"synchronized": False}}}).enabled
    assert resolved({"timers": {"throughput": {"enabled": True}}}).enabled


SHIPPED = sorted(DS_CONFIGS.glob("*.json"))


def test_every_zero_stage_and_precision_is_shipped():
    names = {p.stem for p in SHIPPED}
    assert names == {f"zero{s}_{p}" for s in range(4) for p in ("fp32", "bf16", "fp16")}


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_ds_configs_are_valid_for_deepspeed(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    stage, precision = int(path.stem[4]), path.stem.split("_")[1]
    c = cfg(micro_batch_size=4, global_batch_size=8, deepspeed_config=str(path))
    # fp16 files are for GPU users: check them as a GPU run would, for validity only.
    s = resolve_deepspeed_config(c, 1, device_type="cuda" if precision == "fp16" else "cpu")
    assert (s.zero_stage, s.precision) == (stage, precision)
    ds = DeepSpeedConfig(s.config, mpu=single_process_state())
    assert ds.zero_optimization_stage == stage
    assert (
        ds.train_batch_size,
        ds.train_micro_batch_size_per_gpu,
        ds.gradient_accumulation_steps,
    ) == (8, 4, 2)
    assert ds.bfloat16_config.enabled == (precision == "bf16")
    assert ds.float16_config.enabled == (precision == "fp16")
    # DeepSpeed's throughput timer would synchronise the device around every micro-batch.
    assert not ds.timers_config.enabled
    assert not json.loads(path.read_text())["timers"]["throughput"]["enabled"]
    if precision == "fp16":
        assert ds.float16_config.loss_scale == 0  # dynamic loss scaling: overflow steps are skipped
    if precision != "fp16":
        with pytest.raises(ConfigError):
            resolve_deepspeed_config(
                c,
                1,
                device_type="cpu",
                ds_json={**json.loads(path.read_text()), "fp16": {"enabled": True}},
            )


# -- the CLI validates everything before process-group work -------------------------------


def cli_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--data-path", str(tmp_path / "missing_prefix"),
        "--tokenizer-model", str(tmp_path / "missing.model"),
        "--model-size", "tiny", "--seq-length", "32",
        "--train-iters", "4", "--lr-warmup-iters", "1",
        "--micro-batch-size", "2", "--save", str(tmp_path / "ckpt"),
        *extra,
    ]  # fmt: skip


def test_fp16_on_cpu_is_refused_before_process_group_work(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    fp16 = str(DS_CONFIGS / "zero2_fp16.json")
    assert main(cli_args(tmp_path, "--deepspeed-config", fp16)) == 2
    err = capsys.readouterr().err
    assert "fp16 needs a GPU; use a bf16 or fp32 config" in err and fp16 in err
    # Refused before the data files were even looked at (they do not exist), before any
    # process group, and before anything was written.
    assert "--data-path" not in err
    assert not dist.is_initialized()
    assert "MASTER_PORT" not in __import__("os").environ
    assert not (tmp_path / "ckpt").exists()


def parse(tmp_path, *extra, world_size=1):
    args = build_parser(SPEC).parse_args(cli_args(tmp_path, *extra))
    return configs_from_args(SPEC, args, world_size=world_size, device_type="cpu")


def test_cli_checks_batch_arithmetic_against_the_launcher_world(tmp_path):
    with pytest.raises(
        ConfigError,
        match="--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2",
    ):
        parse(
            tmp_path, "--global-batch-size", "6", "--tensor-model-parallel-size", "2", world_size=4
        )


@pytest.mark.parametrize("extra", [("--eval-iters", "0"), ("--split", "100,0,0")])
def test_exit_on_collapse_without_a_validation_is_refused_before_any_file(tmp_path, extra):
    # Nothing would ever read a collapse figure: the flag would do nothing, silently.
    with pytest.raises(ConfigError, match="^--exit-on-collapse: needs a validation"):
        parse(tmp_path, "--exit-on-collapse", *extra)


def test_cli_checks_parallel_sizes(tmp_path):
    with pytest.raises(
        ConfigError, match="^--tensor-model-parallel-size: 4 does not divide the world size 2"
    ):
        parse(tmp_path, "--tensor-model-parallel-size", "4", world_size=2)
    # tiny has 4 WE heads and 2 PE heads: tp=4 cannot split the PE heads.
    with pytest.raises(ConfigError, match="^--pe-attention-heads"):
        parse(tmp_path, "--tensor-model-parallel-size", "4", world_size=4)


def test_cli_checks_seq_length_against_positions(tmp_path):
    with pytest.raises(
        ConfigError, match="^--seq-length: 128 exceeds --max-position-embeddings 64"
    ):
        parse(tmp_path, "--seq-length", "128")


@pytest.mark.parametrize(
    ("spec_module", "extra", "want"),
    [("pretrain_taco", ("--model-size", "tiny"), 64),
     ("pretrain_sas", ("--model-size", "tiny"), 64),
     ("pretrain_taco", ("--model-size", "small"), 512),
     ("pretrain_taco", ("--model-size", "tiny", "--max-position-embeddings", "48",
                       "--max-relative-distance", "40"), 48),
     ("pretrain_taco", ("--model-size", "tiny", "--seq-length", "32"), 32)],
)  # fmt: skip
def test_seq_length_defaults_to_the_models_positions(tmp_path, spec_module, extra, want):
    # A preset brings its sequence length: `--model-size tiny` alone used to keep 512 and
    # fail against its 64 positions.
    import importlib

    spec = importlib.import_module(f"megatron_taco.cli.{spec_module}").SPEC
    args = build_parser(spec).parse_args(
        ["--data-path", str(tmp_path / "x"), "--tokenizer-model", str(tmp_path / "t.model"),
         "--train-iters", "10", "--lr-warmup-iters", "1", *extra]
    )  # fmt: skip
    data = flag_configs(spec, args, world_size=1, device_type="cpu").data
    assert data.seq_length == want
    assert "its preset's unless given" in " ".join(build_parser(spec).format_help().split())


def test_cli_checks_files_last(tmp_path):
    with pytest.raises(ConfigError, match="^--data-path: dataset"):
        parse(tmp_path)


def test_cli_accepts_deepspeed_launcher_flags(tmp_path):
    path = str(DS_CONFIGS / "zero1_bf16.json")
    args = build_parser(SPEC).parse_args(
        cli_args(tmp_path, "--local_rank=1", "--deepspeed", "--deepspeed_config", path)
    )
    assert args.deepspeed_config == path and args.local_rank == 1
    args = build_parser(SPEC).parse_args(
        cli_args(tmp_path, "--local-rank", "0", "--deepspeed-config", path)
    )
    assert args.deepspeed_config == path


def test_cli_precision_and_sample_flags(tmp_path):
    # Megatron's spelling is accepted (it used to print the usage and "unrecognized
    # arguments: --bf16"); --train-samples resolves at the launcher's data-parallel size.
    args = build_parser(SPEC).parse_args(
        [a for a in cli_args(tmp_path, "--bf16", "--train-samples", "100", "--lr-warmup-samples",
                             "8") if a not in ("--train-iters", "4", "--lr-warmup-iters", "1")]
    )  # fmt: skip
    cfg = flag_configs(SPEC, args, world_size=2, device_type="cpu")
    training = cfg.training
    assert cfg.deepspeed.precision == "bf16" and training.bf16
    assert (training.train_iters, training.global_batch_size) == (25, 4)  # 100 // (2 x 2)
    with pytest.raises(
        ConfigError, match="^--train-iters: give exactly one of --train-iters, --train-samples"
    ):
        flag_configs(SPEC, build_parser(SPEC).parse_args(cli_args(tmp_path, "--train-samples", "100")),
            world_size=1, device_type="cpu",
        )  # fmt: skip


def test_cli_checkpoint_switches(tmp_path):
    args = build_parser(SPEC).parse_args(
        cli_args(tmp_path, "--lr", "1e-4", "--load", "ck", "--no-load-optim", "--no-load-rng",
                 "--finetune")
    )  # fmt: skip
    t = dataclass_from_args(CheckpointConfig, args)
    assert (t.load, t.no_load_optim, t.no_load_rng, t.finetune) == ("ck", True, True, True)
    args = build_parser(SPEC).parse_args(cli_args(tmp_path, "--lr", "1"))
    t = dataclass_from_args(CheckpointConfig, args)
    assert (t.no_load_optim, t.no_load_rng, t.finetune) == (False, False, False)
    with pytest.raises(SystemExit):
        build_parser(SPEC).parse_args(cli_args(tmp_path, "--no-no-load-optim"))


def test_train_iters_or_epochs_exactly_one():
    one = "exactly one of --train-iters, --train-samples and --train-epochs"
    with pytest.raises(ConfigError, match=one):
        TrainingConfig()
    with pytest.raises(ConfigError, match=one):
        TrainingConfig(train_iters=5, train_epochs=2)
    with pytest.raises(ConfigError, match=one):
        TrainingConfig(total_train_samples=50, train_epochs=2)
    t = TrainingConfig(train_epochs=3, lr_warmup_iters=10)
    assert t.train_iters is None and t.decay_iters is None
    with pytest.raises(ConfigError, match="--train-epochs: this model has no fixed epochs"):
        t.train_samples(1)
    resolved = t.with_train_iters(30)
    assert (resolved.train_iters, resolved.train_epochs, resolved.decay_iters) == (30, None, 30)
    with pytest.raises(ConfigError, match="--lr-warmup-iters"):
        t.with_train_iters(8)  # warmup 10 >= 8 decay iterations: re-validated


def test_taco_refuses_train_epochs_before_process_groups(tmp_path):
    args = [a for a in cli_args(tmp_path) if a not in ("--train-iters", "4")]
    with pytest.raises(ConfigError, match="^--train-epochs: TACO trains a number of iterations"):
        configs_from_args(
            SPEC,
            build_parser(SPEC).parse_args([*args, "--train-epochs", "2"]),
            world_size=1,
            device_type="cpu",
        )


@pytest.mark.parametrize(
    ("spec_module", "size", "want"),
    [("pretrain_taco", "small", 5e-4), ("pretrain_taco", "base", 1e-4),
     ("pretrain_sas", "small", 1e-3), ("pretrain_sas", "base", 2e-4)],
)  # fmt: skip
def test_lr_defaults_to_the_model_sizes_and_a_given_lr_wins(
    botchan_dataset, tmp_path, spec_module, size, want
):
    import importlib

    spec = importlib.import_module(f"megatron_taco.cli.{spec_module}").SPEC
    base = [
        "--data-path", botchan_dataset["prefix"], "--tokenizer-model", botchan_dataset["tokenizer"],
        "--data-cache-path", str(tmp_path / "cache"), "--model-size", size, "--seq-length", "32",
        "--train-iters", "40", "--micro-batch-size", "2",
    ]  # fmt: skip
    if spec_module == "pretrain_sas":
        base.append("--no-self-augmentation")

    def resolved(*extra):
        args = build_parser(spec).parse_args([*base, *extra])
        return configs_from_args(spec, args, world_size=1, device_type="cpu").training

    t = resolved()
    assert (t.lr, t.warmup_iters) == (want, 4)  # and the warm-up: 10% of a 40-iteration run
    assert resolved("--lr", "3e-5").lr == 3e-5
    assert f"small {spec.model_config.DEFAULT_LR['small']:g}" in build_parser(spec).format_help()


@pytest.mark.parametrize(
    "json_name,global_batch,noted",
    [
        ("zero0_bf16", 8, True),  # 2 micro-batches of 2 on 2 ranks: summed in bf16
        ("zero0_bf16", 4, False),  # one micro-batch: nothing is summed
        ("zero1_bf16", 8, False),  # fp32 accumulation (data_types.grad_accum_dtype)
        ("zero0_fp32", 8, False),
    ],
)
def test_the_banner_notes_half_precision_accumulation(json_name, global_batch, noted):
    from megatron_taco.training.driver import accumulation_note

    training = cfg(micro_batch_size=2, global_batch_size=global_batch,
                   deepspeed_config=str(DS_CONFIGS / f"{json_name}.json"))  # fmt: skip
    note = accumulation_note(resolve_deepspeed_config(training, 2, device_type="cpu"))
    if noted:
        assert note == ("ZeRO-0 bf16 sums the gradients of the 2 micro-batches in bf16 "
                        "(DeepSpeed accumulates in fp32 only with ZeRO 1-3, e.g. "
                        "ds_configs/zero1_bf16.json)")  # fmt: skip
    else:
        assert note is None


def test_every_preset_has_a_default_lr():
    # A preset without one would end `--model-size NEW` without --lr in a KeyError traceback.
    from megatron_taco.models.sas.config import SasConfig
    from megatron_taco.models.taco.config import TacoConfig

    for config in (TacoConfig, SasConfig):
        assert set(config.DEFAULT_LR) == set(config.PRESETS) | {"base"}, config.__name__

"""What every model config shares: named size presets that explicit flags override, the
vocabulary size set from the tokenizer, and the positive-integer checks."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_taco.arguments import add_dataclass_args, flag_of, option, require
from megatron_taco.errors import ConfigError


def opt(default: Any, help: str, flag: str | None = None, **kw: Any) -> Any:
    # Positional flag keeps a model config's field table on one line per field.
    return option(default, help, flag=flag, **kw)


class PresetConfig:
    """Mixin for a frozen model-config dataclass with a ``PRESETS`` table, a ``model_size``
    field (the preset's name) and a ``vocab_size`` field (0 until set)."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}
    ARGS_TITLE: ClassVar[str] = "model"
    # Pretraining's peak learning rate when --lr is not given, by preset ("base" also for a
    # config without one); each model's table says where its values come from.
    DEFAULT_LR: ClassVar[dict[str, float]] = {}

    def default_lr(self) -> float:
        return self.DEFAULT_LR[self.model_size or "base"]

    @classmethod
    def default_lr_help(cls) -> str:
        sizes = ", ".join(f"{name} {lr:g}" for name, lr in cls.DEFAULT_LR.items())
        return f"by --model-size: {sizes} (base also without a preset)"

    @classmethod
    def preset(cls, name: str, **overrides: Any):
        if name not in cls.PRESETS:
            raise ConfigError(
                f"{flag_of(cls, 'model_size')}: unknown preset {name!r}; "
                f"choose one of {sorted(cls.PRESETS)}"
            )
        return cls(**{**cls.PRESETS[name], **overrides, "model_size": name})

    def with_vocab_size(self, vocab_size: int):
        return dataclasses.replace(self, vocab_size=vocab_size)

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add the flags; unspecified ones stay absent from the namespace so that
        ``from_args`` can tell a preset value from an explicit override."""
        add_dataclass_args(parser, cls, title=cls.ARGS_TITLE)
        dests = {f.name for f in dataclasses.fields(cls)}
        for action in parser._actions:
            if action.dest in dests:
                action.default = argparse.SUPPRESS

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any):
        given = {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(cls)
            if hasattr(args, f.name) and getattr(args, f.name) is not None
        }
        given.update(overrides)
        name = given.pop("model_size", None)
        return cls.preset(name, **given) if name is not None else cls(**given)

    def require_vocab(self) -> None:
        require(
            self.vocab_size >= 1,
            type(self),
            "vocab_size",
            "vocabulary size is not set; build the config with with_vocab_size(tokenizer.vocab_size)",
        )

    def require_positive_ints(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                type(self),
                name,
                f"must be a positive integer, got {value!r}",
            )

    def require_divisible(self, tp_size: int, *names: str) -> None:
        """Tensor parallelism splits whole heads and FFN columns across ranks."""
        for name in names:
            value = getattr(self, name)
            require(
                value % tp_size == 0,
                type(self),
                name,
                f"{value} is not divisible by --tensor-model-parallel-size {tp_size}",
            )


@dataclass(frozen=True)
class EncoderConfig(PresetConfig):
    """Fields every encoder config has (before the model's own, which follow)."""

    vocab_size: int = option(
        0, "Real vocabulary size; 0 until set from the tokenizer (with_vocab_size).", cli=False
    )
    hidden_dropout: float = option(
        0.1, "Dropout on embeddings and residual branches.", flag="--hidden-dropout"
    )
    attention_dropout: float = option(
        0.1, "Dropout on attention probabilities.", flag="--attention-dropout"
    )
    layernorm_epsilon: float = option(
        1e-12, "LayerNorm epsilon (BERT's 1e-12).", flag="--layernorm-epsilon"
    )
    init_method_std: float = option(
        0.02, "Std of the normal weight initialisation.", flag="--init-method-std"
    )
    recompute_activations: bool = option(
        False,
        "Recompute each layer in the backward pass to save activation memory.",
        flag="--recompute-activations",
    )
    compile: bool = option(
        False,
        "torch.compile each encoder layer (at its first call; a compile that fails runs the "
        "layers eagerly after one warning). Off by default: benchmarks/bench_*_step.py "
        "--compile measures it against eager (README, Benchmarks).",
        flag="--compile",
    )

    def validate_common(self) -> None:
        cls = type(self)
        require(
            isinstance(self.vocab_size, int) and self.vocab_size >= 0,
            cls,
            "vocab_size",
            f"must be a non-negative integer (0 = not set yet), got {self.vocab_size!r}",
        )
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, cls, name, f"must be in [0, 1), got {value}")
        # None: the model resolves its own default (SAS: by variant).
        eps = self.layernorm_epsilon
        require(eps is None or eps > 0, cls, "layernorm_epsilon", f"must be > 0, got {eps}")
        require(self.init_method_std > 0, cls, "init_method_std", "must be > 0")
        require(
            self.model_size is None or self.model_size in cls.PRESETS,
            cls,
            "model_size",
            f"unknown preset {self.model_size!r}; choose one of {sorted(cls.PRESETS)}",
        )


def require_tracker_for_tp_dropout(config: EncoderConfig, tp_size: int, rng_tracker) -> None:
    if tp_size > 1 and config.attention_dropout > 0 and rng_tracker is None:
        # Without the tracker every rank would draw the same dropout mask for its different
        # heads: silently correlated, unlike tp=1.
        raise ValueError(
            "tensor parallelism with attention dropout needs the rng_tracker "
            "(parallel.random.model_parallel_seed) to drop different elements per rank"
        )

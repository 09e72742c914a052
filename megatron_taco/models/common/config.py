"""What every model config shares: named size presets that explicit flags override, the
vocabulary size set from the tokenizer, and the positive-integer checks."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, ClassVar

from megatron_taco.arguments import ConfigError, add_dataclass_args, flag_of, require


class PresetConfig:
    """Mixin for a frozen model-config dataclass with a ``PRESETS`` table, a ``model_size``
    field (the preset's name) and a ``vocab_size`` field (0 until set)."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}
    ARGS_TITLE: ClassVar[str] = "model"

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

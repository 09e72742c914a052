"""Frozen config dataclasses <-> Megatron-style command-line flags.

Every config field is declared with :func:`option`, which records the flag name
(Megatron-LM's spelling where one exists) and the help text. The parser is built
from those declarations, so ``--help`` and the dataclass can never disagree.
This module sits below every subpackage and imports none of them (but errors.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from megatron_taco.errors import ConfigError


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    choices: Sequence[Any] | None = None,
    default_factory: Any = dataclasses.MISSING,
    cli: bool = True,
    switch: bool = False,
) -> Any:
    """A config field and its flag. ``switch``: a bool that is a plain Megatron switch
    (store_true: ``--finetune``), not a ``--x/--no-x`` pair (``--no-no-load-optim``)."""
    metadata = {"help": help, "flag": flag, "choices": choices, "cli": cli, "switch": switch}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# Each tool's script (tools/*.py, pretrain_*.py) and the command pyproject.toml installs.
COMMANDS = {
    "train_tokenizer.py": "taco-train-tokenizer",
    "preprocess_data.py": "taco-preprocess-data",
    "merge_datasets.py": "taco-merge-datasets",
    "build_samples.py": "taco-build-samples",
    "pretrain_taco.py": "taco-pretrain",
    "pretrain_sas.py": "taco-pretrain-sas",
    "count_flops.py": "taco-count-flops",
    "convert_checkpoint.py": "taco-convert-checkpoint",
    "export_hf.py": "taco-export-hf",
    "launch.py": "taco-launch",
    "finetune.py": "taco-finetune",
    "glue_score.py": "taco-glue-score",
    "word_order_probe.py": "taco-word-order-probe",
}


def program_name(script: str) -> str:
    """The name a tool's usage and error lines show: the one it was started by, its
    installed command (taco-pretrain) or its script (pretrain_taco.py); the script's when
    main(argv) is called from Python."""
    invoked = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return invoked if invoked in (script, COMMANDS.get(script)) else script


def flag_of(cls: type, name: str) -> str:
    """The command-line spelling of field ``name`` (for error messages)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("flag") or "--" + name.replace("_", "-")
    raise KeyError(name)


def require(cond: bool, cls: type, name: str, message: str) -> None:
    """Raise ConfigError naming the flag of ``cls.name`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{flag_of(cls, name)}: {message}")


def set_parser_defaults(
    parser: argparse.ArgumentParser, defaults: dict[str, Any], shown: dict[str, str] | None = None
) -> None:
    """parser.set_defaults that also corrects the "(default: ...)" of each flag's help
    (``shown``: what the help says instead of the value, e.g. for a default resolved later)."""
    shown = shown or {}
    for action in parser._actions:
        if action.dest in defaults:
            action.default = defaults[action.dest]
            if action.help and "(default:" in action.help:
                action.help = action.help[: action.help.rindex("(default:")].rstrip()
            if action.help is not None:
                action.help += f" (default: {shown.get(action.dest, defaults[action.dest])})"


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str | None = None,
    *,
    exclude: Sequence[str] = (),
) -> None:
    """One flag per field of ``cls`` (fields with cli=False and those named in ``exclude``
    are left out: a tool that sets them itself, e.g. fine-tuning's --save)."""
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True) or f.name in exclude:
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        tp, optional = _unwrap_optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help", "")}
        if default is not None and kwargs["help"]:
            kwargs["help"] += f" (default: {default})"
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
        if tp is bool and f.metadata.get("switch"):
            kwargs["action"] = "store_true"
            kwargs.pop("help")
            kwargs["help"] = f.metadata.get("help", "")
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = default
        elif typing.get_origin(tp) in (tuple, list):
            (elem, *_rest) = typing.get_args(tp) or (str,)
            kwargs["nargs"] = "+" if not optional else "*"
            kwargs["type"] = elem if elem is not Ellipsis else str
            kwargs["default"] = default
        else:
            kwargs["type"] = tp if tp in (int, float, str) else str
            kwargs["default"] = default
        if f.metadata.get("choices"):
            kwargs["choices"] = list(f.metadata["choices"])
        if required:
            kwargs["required"] = True
        group.add_argument(flag, **kwargs)


def dataclass_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """Build ``cls`` from parsed args; validation happens in its ``__post_init__``."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        if not f.metadata.get("cli", True) or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        tp, _ = _unwrap_optional(hints[f.name])
        if value is not None and typing.get_origin(tp) is tuple:
            value = tuple(value)
        values[f.name] = value
    return cls(**values)


def run_cli(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    body: Callable[[argparse.Namespace], Any],
    *,
    user_errors: tuple[type[BaseException], ...] = (),
) -> int:
    """The shared shell of the tools' main(): parse, log at INFO, run ``body``. A ConfigError
    is a usage error (exit 2, with the usage line); ``user_errors`` (bad input files and the
    like) print ``prog: error: ...`` and exit 1, without a traceback."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        body(args)
    except ConfigError as e:
        # A kind of ConfigError listed in ``user_errors`` (a CheckpointError) is a bad input
        # file, not a usage error.
        if any(issubclass(u, ConfigError) and isinstance(e, u) for u in user_errors):
            parser.exit(1, f"{parser.prog}: error: {e}\n")
        parser.error(str(e))
    except user_errors as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    return 0

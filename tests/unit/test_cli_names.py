"""Every tool names itself the way it was started: `taco-pretrain --help` shows
`usage: taco-pretrain`, `python pretrain_taco.py --help` shows `usage: pretrain_taco.py`
(and so do their error lines), for every command pyproject.toml installs."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import tomllib

from megatron_taco.arguments import COMMANDS

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_installed_command_has_its_script():
    assert set(SCRIPTS) == set(COMMANDS.values())
    for script, command in COMMANDS.items():
        path = REPO / script if script.startswith("pretrain_") else REPO / "tools" / script
        module = SCRIPTS[command].split(":")[0]
        assert path.is_file() and f"from {module} import main" in path.read_text(), script


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_help_shows_the_name_it_was_started_by(script, monkeypatch, capsys):
    module, _, func = SCRIPTS[COMMANDS[script]].partition(":")
    main = getattr(importlib.import_module(module), func)
    for argv0, shown in ((f"/usr/bin/{COMMANDS[script]}", COMMANDS[script]),
                         (f"tools/{script}", script), ("-c", script)):  # fmt: skip
        monkeypatch.setattr(sys, "argv", [argv0, "--help"])
        with pytest.raises(SystemExit) as info:
            main(["--help"])
        assert info.value.code == 0
        usage = capsys.readouterr().out.lstrip()
        assert usage.startswith(f"usage: {shown} "), (argv0, usage[:80])

"""The hf extra (transformers, safetensors) missing: the tools that need it say how to install
it in one line, before reading any checkpoint (the import is simulated missing by a None
entry in sys.modules, which makes ``import`` raise ImportError)."""

import sys

import pytest

from megatron_taco.cli import convert_checkpoint, export_hf


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("module", ["transformers", "safetensors"])
def test_export_hf_says_how_to_install_the_extra(tmp_path, capsys, monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(SystemExit) as exit_info:
        export_hf.main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")])
    assert exit_info.value.code == 1
    (line,) = _error_lines(capsys)
    assert f"needs {module} (the hf extra): pip install -e '.[hf]'" in line
    assert "requirements/cpu.txt" in line


def test_consolidate_to_safetensors_says_how_to_install_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    out = tmp_path / "model.safetensors"
    with pytest.raises(SystemExit) as exit_info:
        convert_checkpoint.main(["--load", str(tmp_path / "ckpt"), "--consolidate", str(out)])
    assert exit_info.value.code == 1
    (line,) = _error_lines(capsys)
    assert f"--consolidate {out} needs safetensors (the hf extra)" in line


def test_consolidate_to_torch_file_does_not_need_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(SystemExit):
        convert_checkpoint.main(
            ["--load", str(tmp_path / "ckpt"), "--consolidate", str(tmp_path / "model.pt")]
        )
    assert "hf extra" not in capsys.readouterr().err  # it fails on the missing checkpoint

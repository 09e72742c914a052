"""The hf extra (pyproject.toml): transformers and safetensors, which only the tools that
write transformers folders or safetensors files need. Checked before any work, so that a
missing one is an install hint rather than "No module named" halfway through."""

from __future__ import annotations

import importlib

HF_MODULES = ("transformers", "safetensors")


class MissingExtra(ImportError):
    """A tool's optional dependencies are not installed (its main prints the one line)."""


def require_hf_extra(purpose: str, modules: tuple[str, ...] = HF_MODULES) -> None:
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise MissingExtra(
            f"{purpose} needs {' and '.join(missing)} (the hf extra): pip install -e '.[hf]' "
            "in the clone, or pip install -r requirements/cpu.txt"
        )

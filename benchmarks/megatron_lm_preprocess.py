"""Run Megatron-LM's own tools/preprocess_data.py, unmodified, on this offline CPU machine.

    python -m benchmarks.megatron_lm_preprocess MEGATRON_LM_CHECKOUT [its arguments...]

Used by bench_preprocess as the peer (run from the repository root). Nothing of Megatron-LM is copied here: the checkout
(a tag whose megatron/core matches the installed megatron-core, e.g. core_v0.16.1) is given
on the command line, and its script runs as ``__main__`` after three environment shims:

* ``megatron.training`` is registered as a bare package of the checkout's folder, so that
  importing its ``tokenizer`` and ``arguments`` modules does not run its ``__init__``,
  which pulls in the GPU training stack (triton, transformer engine) the tool never uses;
  the names its modules import from the package are taken from its ``global_vars``.
* ``nltk.download`` does nothing (no network here; the tool calls it before splitting).
* ``nltk.load`` of ``tokenizers/punkt/<lang>.pickle`` returns nltk's PunktTokenizer for
  that language, built from the punkt_tab data (the same trained parameters in nltk's
  pickle-free format, found offline as for taco-preprocess-data). Its ``tokenize`` is the
  method the tool calls.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import types


def main() -> None:
    root = os.path.abspath(sys.argv[1])
    tool = os.path.join(root, "tools", "preprocess_data.py")
    if not os.path.isfile(tool):
        raise SystemExit(f"{root}: no tools/preprocess_data.py (not a Megatron-LM checkout)")
    training = types.ModuleType("megatron.training")
    training.__path__ = [os.path.join(root, "megatron", "training")]
    sys.modules["megatron.training"] = training
    global_vars = importlib.import_module("megatron.training.global_vars")
    training.__dict__.update(
        {k: getattr(global_vars, k) for k in dir(global_vars) if k.startswith(("get_", "set_"))}
    )

    import nltk
    from nltk.tokenize.punkt import PunktTokenizer

    from megatron_taco.preprocessing.text import find_punkt_tab

    nltk.data.path.append(find_punkt_tab())
    nltk.download = lambda *args, **kwargs: True
    load = nltk.load

    def load_punkt(resource_url, *args, **kwargs):
        name = os.path.basename(str(resource_url))
        if "punkt" in str(resource_url) and name.endswith(".pickle"):
            return PunktTokenizer(name[: -len(".pickle")])
        return load(resource_url, *args, **kwargs)

    nltk.load = load_punkt
    sys.argv = [tool, *sys.argv[2:]]
    runpy.run_path(tool, run_name="__main__")


if __name__ == "__main__":
    main()

"""apex is used only when its CUDA extensions import. An apex built without them (a common
broken install: `pip install apex` without --cuda_ext, or a CUDA mismatch) imports fine and
fails when FusedLayerNorm() / FusedAdam() load their kernels, at model or optimizer
construction. Here an apex package laid out like NVIDIA's, whose classes load their
extension modules on construction as NVIDIA's do, stands in for the install (NVIDIA apex is
not on PyPI); the guards under test are ours."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ENV, REPO

APEX = {
    "apex/__init__.py": "",
    "apex/normalization/__init__.py": (
        "import importlib\nimport torch\n\n"
        "class FusedLayerNorm(torch.nn.LayerNorm):\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        global fused_layer_norm_cuda\n"
        "        fused_layer_norm_cuda = importlib.import_module('fused_layer_norm_cuda')\n"
        "        super().__init__(*args, **kwargs)\n"
    ),
    "apex/optimizers/__init__.py": (
        "import torch\n\n"
        "class FusedAdam(torch.optim.AdamW):\n"
        "    def __init__(self, params, adam_w_mode=True, **kwargs):\n"
        "        import amp_C  # RuntimeError in NVIDIA's when multi_tensor_applier is missing\n"
        "        super().__init__(params, **kwargs)\n"
    ),
}
EXTENSIONS = {"fused_layer_norm_cuda.py": "", "amp_C.py": ""}

PROBE = """
import json, torch
from megatron_taco.models.common import layers
from megatron_taco.training import optim
from megatron_taco.training.config import TrainingConfig
norm = layers.LayerNorm(8, 1e-5)
adam, _ = optim.build_optimizer(torch.nn.Linear(2, 2), TrainingConfig(train_iters=1, lr=1e-3))
print(json.dumps([layers.HAVE_APEX, optim._ApexFusedAdam is not None,
                  type(norm).__module__ + "." + type(norm).__name__,
                  optim.optimizer_implementation(), type(adam).__module__]))
"""


def _probe(tmp_path, files: dict[str, str]) -> list:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {**ENV, "PYTHONPATH": f"{tmp_path}:{REPO}"}
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("with_extensions", [False, True])
def test_apex_is_used_only_with_its_cuda_extensions(tmp_path, with_extensions):
    files = {**APEX, **(EXTENSIONS if with_extensions else {})}
    have_norm, have_adam, norm, recorded, built = _probe(tmp_path, files)
    if with_extensions:
        assert (have_norm, have_adam, norm) == (True, True, "apex.normalization.FusedLayerNorm")
    else:
        assert (have_norm, have_adam) == (False, False)
        assert norm == "torch.nn.modules.normalization.LayerNorm"
    # FusedAdam runs CUDA tensors only: a CPU process builds torch's AdamW even where apex
    # and its extensions import, and records that one in its checkpoints.
    assert (recorded, built) == ("torch.optim.AdamW", "torch.optim.adamw")

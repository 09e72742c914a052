"""Every RNG's state of a rank (Python, numpy's legacy global, torch CPU and this rank's device,
the model-parallel tracker's streams), saved as tensors and numbers only so that the file
loads with weights_only=True.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from megatron_taco.checkpoint.safe_files import safe_torch_load
from megatron_taco.errors import ConfigError
from megatron_taco.parallel.random import RNGTracker

logger = logging.getLogger(__name__)


RNG_FORMAT = 2


def get_rng_states(rng_tracker: RNGTracker | None) -> dict[str, Any]:
    """numpy's legacy global state on purpose: third-party code draws from it."""
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()  # noqa: NPY002
    return {
        "format": RNG_FORMAT,
        "python": {
            "version": version,
            "state": torch.tensor(mt, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(cached),
        },
        "torch_cpu": torch.get_rng_state(),
        # This rank's own device (the current one, set from LOCAL_RANK), not every visible
        # GPU by index: a resume with another ranks-per-node layout restores it there.
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": rng_tracker.get_states() if rng_tracker is not None else None,
    }


def set_rng_states(states: dict[str, Any], rng_tracker: RNGTracker | None) -> None:
    py, npy = states["python"], states["numpy"]
    random.setstate((int(py["version"]), tuple(py["state"].tolist()), py["gauss"]))
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, npy["pos"], npy["has_gauss"], npy["gauss"]))  # noqa: NPY002
    torch.set_rng_state(states["torch_cpu"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(own_cuda_state(states["cuda"], torch.cuda.current_device()))
    if rng_tracker is not None and states.get("tracker") is not None:
        foreign = rng_tracker.load_states(states["tracker"])
        if foreign:
            logger.warning(
                "--load: the RNG stream(s) %s were saved by a generator of another device type "
                "than this run's %s; they restart from their seed (dropout masks of split "
                "activations differ from an uninterrupted run's)",
                ", ".join(foreign),
                rng_tracker.device_type,
            )


def own_cuda_state(saved: Any, current_device: int) -> torch.Tensor:
    """The saved CUDA generator state of this rank's device: one tensor; checkpoints written
    before it was saved so held a list, every visible device's by index, of which this rank's
    was its current one (``current_device``: the same layout resumes it exactly; a device
    index past the list, after a layout change, takes one of them rather than failing)."""
    if torch.is_tensor(saved):
        return saved
    return saved[current_device % len(saved)]


def load_rng_file(path: str) -> dict[str, Any]:
    states = safe_torch_load(path, hint="; pass --no-load-rng to resume without the RNG states")
    if not isinstance(states, dict) or states.get("format") != RNG_FORMAT:
        found = states.get("format") if isinstance(states, dict) else type(states).__name__
        raise ConfigError(
            f"--load: {path} is not an RNG state file of format {RNG_FORMAT} (found "
            f"{found!r}); pass --no-load-rng to resume without the RNG states"
        )
    return states

"""training/engine.py's deepspeed_device_env: LOCAL_RANK (and Open MPI's copy) read as this
rank's device while DeepSpeed builds its engine, and the environment exactly as it was after."""

from __future__ import annotations

import contextlib
import os

import pytest

from megatron_taco.training.engine import deepspeed_device_env

KEYS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


@pytest.mark.parametrize("before", [{}, {"LOCAL_RANK": "3"}, dict.fromkeys(KEYS, "3")])
@pytest.mark.parametrize("deepspeed_raises", [False, True])
def test_device_env_during_and_restored_after(monkeypatch, before, deepspeed_raises):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(os, "environ", {**os.environ, **before})
    expect = pytest.raises(RuntimeError) if deepspeed_raises else contextlib.nullcontext()
    with expect, deepspeed_device_env(0):
        # LOCAL_RANK always (zero.Init reads it), Open MPI's only where the launcher set it.
        assert os.environ["LOCAL_RANK"] == "0"
        ompi = "0" if "OMPI_COMM_WORLD_LOCAL_RANK" in before else None
        assert os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") == ompi
        os.environ["OMPI_COMM_WORLD_LOCAL_RANK"] = "5"  # DeepSpeed may write it
        if deepspeed_raises:
            raise RuntimeError("invalid device ordinal")
    assert {k: os.environ.get(k) for k in KEYS} == {k: before.get(k) for k in KEYS}

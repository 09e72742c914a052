"""DeepSpeed's checkpoint engine made safe: every file it loads goes through
safe_torch_load (weights_only), every file it writes is fsynced, and a write that fails
(disk full) is recorded instead of raised, so every rank keeps to DeepSpeed's sequence of
collectives and the save fails as a whole afterwards (save.save_checkpoint).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from megatron_taco import io
from megatron_taco.checkpoint.safe_files import safe_torch_load


def free_space(path: str) -> str:
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "free space unknown"
    return f"{free / 2**20:.1f} MiB free there"


def underlying_os_error(error: BaseException) -> OSError | None:
    """The OSError behind ``error``: torch.save reports a failed write of its zip writer as a
    RuntimeError whose context is the file object's OSError."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError):
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None


def describe_write_error(path: str, error: OSError) -> str:
    return f"{path}: {error.strerror or error} ({free_space(os.path.dirname(path) or '.')})"


class SafeCheckpointEngine:
    """Mixed into DeepSpeed's TorchCheckpointEngine (_engine_class; deepspeed is imported only
    once a run starts): loads go through safe_torch_load; each file is fsynced; a write that
    fails (disk full) is recorded instead of raised, so every rank keeps to DeepSpeed's
    sequence of collectives and the save fails as a whole afterwards (save_checkpoint)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.zipfile_serialization = True  # the opcode scan and weights_only need zip files
        self.begin()

    def begin(self) -> None:
        self.written: list[str] = []
        self.error: str | None = None

    def attempt(self, path: str, fn: Callable[..., Any], *args: Any) -> None:
        if self.error is not None:
            return
        try:
            fn(*args)
        except Exception as e:  # re-raised below unless an OSError is behind it
            os_error = underlying_os_error(e)
            if os_error is None:
                raise
            self.error = describe_write_error(os_error.filename or path, os_error)
            if os.path.isfile(path):
                io.remove(path)

    def save(self, state_dict: Any, path: str) -> None:
        self.attempt(path, io.write_durably, path, lambda f: torch.save(state_dict, f))
        if self.error is None:  # written (attempt skips every write after a failed one)
            self.written.append(path)

    def load(self, path: str, map_location: Any = None) -> Any:
        return safe_torch_load(path, map_location)


@functools.cache
def _engine_class() -> type:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return type("SafeTorchCheckpointEngine", (SafeCheckpointEngine, TorchCheckpointEngine), {})


def safe_engine(engine) -> SafeCheckpointEngine:
    writer = getattr(engine, "checkpoint_engine", None)
    if isinstance(writer, SafeCheckpointEngine):
        return writer
    writer = _engine_class()()
    engine.checkpoint_engine = writer
    # DeepSpeed's rank 0 copies zero_to_fp32.py into --save with shutil at every ZeRO save;
    # a full disk there must fail the save like any other write, not raise on rank 0 alone.
    copy = getattr(engine, "_copy_recovery_script", None)
    if copy is not None:
        engine._copy_recovery_script = lambda path: writer.attempt(path, copy, path)
    return writer

"""Every error of reading, verifying, saving and loading checkpoints: one family. The
reading ones are ConfigErrors (one line, exit 2): the user acts on the files or the flags;
a failed save is a RunError (exit 1).
"""

from typing import Any

from megatron_taco.errors import ConfigError, RunError


class CheckpointError(ConfigError):
    """A checkpoint cannot be read, verified or used; the message names the file."""


class CheckpointSaveError(RunError):
    """A save failed on some rank (a full disk): it failed as a whole on every rank, the
    partial checkpoint removed and the tracker still naming the previous one."""


class CheckpointInvalid(CheckpointError):
    """The checkpoint to load is incomplete or corrupt (an older one may still verify)."""


class CheckpointUnreadable(CheckpointError):
    """The checkpoint cannot be read now (an I/O error other than a missing file, after
    retries: EIO, ESTALE...): not proven corrupt, so never fallen back from or skipped."""


class CheckpointTooNew(CheckpointError):
    """Written by a newer version of megatron_taco: upgrade, never fall back from it."""


class CheckpointMisfit(CheckpointInvalid):
    """A checkpoint that verifies but whose tensors do not fit the model (found after the
    engine exists; --load-fallback falls back from it as from one that does not verify).
    ``how``: what differs, per rank; equal for two checkpoints the model misfits alike."""

    def __init__(self, message: str, how: Any = None) -> None:
        super().__init__(message)
        self.how = how

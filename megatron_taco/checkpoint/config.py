"""Every checkpoint flag (Megatron's names): where a run saves and what it loads."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from megatron_taco.arguments import option, require


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = option(None, "Directory to save checkpoints to.", flag="--save")
    save_interval: int | None = option(
        None,
        "Save a checkpoint every this many iterations (and always at the end when --save is "
        "given).",
        flag="--save-interval",
    )
    load: str | None = option(
        None,
        "Directory to resume from (its latest_checkpointed_iteration.txt names the checkpoint; "
        "a directory without it starts from scratch).",
        flag="--load",
    )
    ckpt_step: int | None = option(
        None,
        "Load the checkpoint of this iteration from --load instead of the latest one.",
        flag="--ckpt-step",
    )
    no_load_optim: bool = option(
        False,
        "Do not load the optimizer and LR-scheduler states.",
        flag="--no-load-optim",
        switch=True,
    )
    no_load_rng: bool = option(
        False, "Do not load the RNG states.", flag="--no-load-rng", switch=True
    )
    finetune: bool = option(
        False,
        "Load only the model weights from --load and start at iteration 0 with fresh "
        "optimizer, scheduler, RNG and data position.",
        flag="--finetune",
        switch=True,
    )
    save_retain: int | None = option(
        None,
        "Keep only the newest N complete checkpoints in --save (by save time), deleting older "
        "ones after each save; the one latest_checkpointed_iteration.txt names is never "
        "deleted. Default: keep all.",
        flag="--save-retain",
    )
    load_fallback: bool = option(
        False,
        "When the checkpoint --load's tracker names is missing, incomplete or corrupt, load "
        "the newest older checkpoint in --load that verifies instead of stopping.",
        flag="--load-fallback",
    )
    override_existing_checkpoints: bool = option(
        False,
        "Start anew in a --save that holds another run's checkpoints (which a run without "
        "--load naming --save refuses to do): they, and the stores they need (SAS: the "
        "replacement store), are moved aside into --save/superseded-<time>/ before the first "
        "save; nothing is deleted.",
        flag="--override-existing-checkpoints",
    )
    save_lock_flock_local: bool = option(
        False,
        "--save's file system keeps flock locks to each host (NFS with local_lock=flock, "
        "Lustre with -o localflock): a run.lock recorded by another host is then refused "
        "even when its lock is free, instead of taken over as a gone run's.",
        flag="--save-lock-flock-local",
    )

    def __post_init__(self) -> None:
        cls = CheckpointConfig
        for name in ("save", "load"):
            value = getattr(self, name)
            if value is not None:
                require(
                    isinstance(value, (str, os.PathLike)) and str(value) != "",
                    cls,
                    name,
                    f"expected a path, got {value!r}",
                )
                object.__setattr__(self, name, os.fspath(value))
        for name, minimum, needs in (
            ("save_interval", 1, "save"),
            ("ckpt_step", 0, "load"),
            ("save_retain", 1, "save"),
        ):
            value = getattr(self, name)
            if value is not None:
                good = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
                require(good, cls, name, f"must be an integer >= {minimum}, got {value!r}")
                require(getattr(self, needs) is not None, cls, name, f"needs --{needs}")
        for name in (f.name for f in fields(cls) if f.type == "bool"):  # every switch
            value = getattr(self, name)
            require(isinstance(value, bool), cls, name, f"must be true or false, got {value!r}")
        if self.override_existing_checkpoints:
            require(self.save is not None, cls, "override_existing_checkpoints", "needs --save")
        if self.load_fallback:
            require(self.load is not None, cls, "load_fallback", "needs --load")
            require(
                self.ckpt_step is None,
                cls,
                "load_fallback",
                "cannot be combined with --ckpt-step, which names the one checkpoint to load",
            )

    @property
    def resumes_save(self) -> bool:
        """Whether the run continues the checkpoints in --save (--load names --save, not as
        --finetune, which restarts at iteration 0): only then may its saves replace or
        retire them."""
        return not self.finetune and same_directory(self.load, self.save)


def same_directory(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)

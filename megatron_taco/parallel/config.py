"""Parallelism and the process groups' timeouts (``--tensor-model-parallel-size``,
``--distributed-timeout-minutes``, ``--filesystem-timeout-minutes``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

from megatron_taco.arguments import option, require

# Above a year, timedelta or torch's timeout overflows: a traceback at the rendezvous, after
# the data set-up (before: 1e13 raised OverflowError there).
MAX_TIMEOUT_MINUTES = 525_600


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = option(
        1,
        "Number of ranks each layer's weights are split over (Megatron tensor parallelism). "
        "Must divide the world size; the remaining factor is data parallelism.",
        flag="--tensor-model-parallel-size",
    )
    distributed_timeout_minutes: float = option(
        10.0,
        "Timeout of every collective (and of the rendezvous): a rank that hangs this long makes "
        "the others exit with an error (fractions allowed).",
        flag="--distributed-timeout-minutes",
    )
    filesystem_timeout_minutes: float = option(
        60.0,
        "Timeout of the waits for file-system work that rank 0 does alone while the others "
        "wait (removing old checkpoints and leftovers, committing and verifying the SAS "
        "store, verifying a fallback checkpoint): apart from --distributed-timeout-minutes, "
        "so that a slow file system is not taken for a hung rank.",
        flag="--filesystem-timeout-minutes",
    )

    def __post_init__(self) -> None:
        require(
            isinstance(self.tensor_model_parallel_size, int)
            and self.tensor_model_parallel_size >= 1,
            ParallelConfig,
            "tensor_model_parallel_size",
            f"must be an integer >= 1, got {self.tensor_model_parallel_size!r}",
        )
        for name in ("distributed_timeout_minutes", "filesystem_timeout_minutes"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            require(
                number and math.isfinite(value) and 0 < value <= MAX_TIMEOUT_MINUTES,
                ParallelConfig,
                name,
                f"must be > 0 and at most {MAX_TIMEOUT_MINUTES} (a year), got {value!r}",
            )

    @property
    def distributed_timeout(self) -> timedelta:
        return timedelta(minutes=self.distributed_timeout_minutes)

    @property
    def filesystem_timeout(self) -> timedelta:
        return timedelta(minutes=self.filesystem_timeout_minutes)


def check_world_size(world_size: int, tp_size: int) -> None:
    """Raise ConfigError (naming --tensor-model-parallel-size) unless tp_size divides world_size."""
    ParallelConfig(tensor_model_parallel_size=tp_size)  # tp_size >= 1
    require(
        world_size % tp_size == 0,
        ParallelConfig,
        "tensor_model_parallel_size",
        f"{tp_size} does not divide the world size {world_size} "
        f"(world size = tensor parallel size x data parallel size)",
    )

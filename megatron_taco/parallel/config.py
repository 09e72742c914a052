"""Tensor-parallel configuration (the ``--tensor-model-parallel-size`` flag)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_taco.arguments import option, require


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = option(
        1,
        "Number of ranks each layer's weights are split over (Megatron tensor parallelism). "
        "Must divide the world size; the remaining factor is data parallelism.",
        flag="--tensor-model-parallel-size",
    )

    def __post_init__(self) -> None:
        require(
            isinstance(self.tensor_model_parallel_size, int)
            and self.tensor_model_parallel_size >= 1,
            ParallelConfig,
            "tensor_model_parallel_size",
            f"must be an integer >= 1, got {self.tensor_model_parallel_size!r}",
        )


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

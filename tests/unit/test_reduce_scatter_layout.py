"""The NCCL branch of parallel.mappings._reduce_scatter, checked on CPU.

No CPU test runs that branch (gloo has no reduce-scatter; the fallback all-reduces and keeps
this rank's chunk). If the layout it hands reduce_scatter_tensor were wrong, a GPU run would
silently give each rank the wrong heads' fused logits. Here every rank's input goes through
the branch's own layout function, reduce_scatter_tensor is simulated on the raw memory the
way NCCL reads it, and the result must equal what the fallback keeps on each rank.
"""

from __future__ import annotations

import pytest
import torch

from megatron_taco.parallel.mappings import rank_chunk, stack_dim_chunks


def _nccl_reduce_scatter(inputs: list[torch.Tensor], out_shape: torch.Size) -> list[torch.Tensor]:
    """reduce_scatter_tensor: rank r receives the sum over ranks of block r of the input's
    flat memory (it reads data_ptr, ignoring strides)."""
    world = len(inputs)
    block = out_shape.numel()
    outs = []
    for r in range(world):
        total = torch.zeros(block, dtype=inputs[0].dtype)
        for x in inputs:
            assert x.numel() == world * block
            flat = torch.as_strided(x, (world * block,), (1,), x.storage_offset())
            total += flat[r * block : (r + 1) * block]
        outs.append(total.view(out_shape))
    return outs


def _check(layout, inputs: list[torch.Tensor], dim: int) -> None:
    world = len(inputs)
    stacked = [layout(x, world, dim) for x in inputs]
    received = _nccl_reduce_scatter(stacked, stacked[0][0].shape)
    # The gloo fallback: all-reduce (sum over ranks), then keep this rank's chunk.
    total = torch.stack(inputs).sum(0)
    for r in range(world):
        torch.testing.assert_close(received[r], rank_chunk(total, world, r, dim), rtol=0, atol=0)


def _rank_inputs(world: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    # Integer-valued float64: the sums are exact in any order, so equality is bitwise.
    g = torch.Generator().manual_seed(world)
    return [torch.randint(-1000, 1000, shape, generator=g).double() for _ in range(world)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("shape", "dim"),
    [
        ((12, 50), 0),  # the attention conv: [C_out, b*s*s] split over output heads
        ((4, 8, 12), 0),
        ((4, 8, 12), 1),
        ((4, 8, 12), 2),
        ((4, 8, 12), -1),
        ((3, 8, 5, 4), 1),
    ],
)
def test_nccl_layout_equals_gloo_fallback(world, shape, dim):
    inputs = _rank_inputs(world, shape)
    _check(stack_dim_chunks, inputs, dim)
    assert stack_dim_chunks(inputs[0], world, dim).is_contiguous()


def _stack_as_view(x, world, dim):
    # Same values as stack_dim_chunks in the same logical order, but a strided view.
    return torch.stack(x.chunk(world, dim=dim), dim=dim).movedim(dim, 0)


def _concatenated(x, world, dim):
    # Forgetting the stack: the chunks stay interleaved in memory unless dim is 0.
    return x.contiguous().view(world, *x.shape[:dim], x.shape[dim] // world, *x.shape[dim + 1 :])


@pytest.mark.parametrize("layout", [_stack_as_view, _concatenated])
def test_the_check_catches_a_wrong_layout(layout):
    inputs = _rank_inputs(2, (4, 8, 12))
    with pytest.raises(AssertionError):
        _check(layout, inputs, 1)

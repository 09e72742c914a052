"""The train line's CUDA memory (training/observability/log.py memory_metrics): the caching
allocator's peak allocated and reserved since the previous line, read without a device
sync and reset for the next one."""

from __future__ import annotations

from tests.helpers import require_gpus


def test_cuda_memory_is_the_peak_since_the_previous_line():
    require_gpus(1)
    import torch

    from megatron_taco.training.observability.log import GIB, memory_metrics

    torch.cuda.init()
    memory_metrics()  # the previous line
    block = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # 0.5 GiB
    del block
    with torch.cuda.device(0):
        first = memory_metrics()
        assert first["mem_max_allocated_gib"] >= 0.5
        assert first["mem_max_reserved_gib"] >= first["mem_max_allocated_gib"]
        # The block is freed: the next line's peak is what is allocated now.
        second = memory_metrics()
        assert second["mem_max_allocated_gib"] == torch.cuda.memory_allocated() / GIB
        assert "host_rss_gib" not in second

"""Dense 16-bit tensor-core peaks of GPUs, the denominator of MFU (model FLOPs utilisation):
the training log's ``mfu`` and the benchmarks (benchmarks/timing.py) read this one table.

Figures are NVIDIA's data-sheet dense (no 2:4 sparsity) bf16 = fp16 peaks in FLOP/s, per GPU.
The first entry whose name appears as a word in torch.cuda.get_device_name() wins, so the specific names
come first ("H100 PCIe" before "H100", "GB200" before "B200", "A10G" before "A10"). None: no
published figure (MFU is then not computed; the benchmarks measure a GEMM instead).
"""

from __future__ import annotations

import re

import torch

GPU_BF16_PEAKS: tuple[tuple[str, float | None], ...] = (
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H800 PCIe", 756e12),  # the H100 PCIe's compute, export interconnect
    ("H800", 989e12),  # SXM5
    ("GB200", 2500e12),  # per Blackwell GPU of a GB200 (NVL72: 180 PFLOP/s over 72 GPUs)
    ("B200", 2250e12),  # HGX B200
    ("A100", 312e12),  # SXM4 and PCIe
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", None),
    ("A10", 125e12),
    ("L4", 121e12),
)

# Precisions whose matmuls run on the 16-bit tensor cores (DeepSpeedSettings.precision).
TENSOR_CORE_PRECISIONS = ("bf16", "fp16")


def gpu_bf16_peak(device_name: str) -> float | None:
    # A whole-word match: "A100" must not match "NVIDIA RTX A1000", nor "L4" "L40".
    for name, peak in GPU_BF16_PEAKS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])", device_name):
            return peak
    return None


def device_peak(device: torch.device, precision: str) -> float | None:
    """FLOP/s MFU divides by for a run in ``precision`` on ``device``; None where the table
    has no figure (CPUs, unlisted GPUs, fp32 runs, whose peak depends on TF32)."""
    device = torch.device(device)
    if device.type != "cuda" or precision not in TENSOR_CORE_PRECISIONS:
        return None
    return gpu_bf16_peak(torch.cuda.get_device_name(device))


def mfu(flops_per_s_per_rank: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, a fraction in [0, 1] (None without a peak)."""
    return None if peak is None else flops_per_s_per_rank / peak

"""The GPU peak table MFU divides by (megatron_taco/training/observability/peaks.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_taco.training.observability.peaks import (
    GPU_BF16_PEAKS,
    device_peak,
    gpu_bf16_peak,
    mfu,
)


@pytest.mark.parametrize(
    "device_name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H800 PCIe", 756e12),
        ("NVIDIA H800", 989e12),
        ("NVIDIA GB200", 2500e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A10G", None),
        ("NVIDIA GeForce RTX 4090", None),
        # Names that contain a listed name without being that GPU.
        ("NVIDIA RTX A1000 6GB Laptop GPU", None),
        ("NVIDIA L4", 121e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H20", None),
    ],
)
def test_data_sheet_peaks(device_name, peak):
    assert gpu_bf16_peak(device_name) == peak


def test_specific_names_come_before_the_names_they_contain():
    # First match wins: an entry after one whose name it contains could never be chosen.
    names = [name for name, _ in GPU_BF16_PEAKS]
    shadowed = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if a in b]
    assert shadowed == []


def test_no_peak_and_no_mfu_on_cpu_or_in_fp32():
    assert device_peak(torch.device("cpu"), "bf16") is None
    assert device_peak(torch.device("cuda", 0), "fp32") is None  # TF32 or not: unknown
    assert mfu(1e12, None) is None
    assert mfu(494.5e12, 989e12) == pytest.approx(0.5)

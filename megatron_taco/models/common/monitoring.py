"""What a pretraining model returns in eval mode for training/observability/monitor.py's learning figures
(collapse of its vectors, accuracy against the most-frequent-target baseline), under the
names of megatron_taco/model_outputs.py."""

from __future__ import annotations

import torch

from megatron_taco.model_outputs import LABEL_COUNTS_SUFFIX, REPRESENTATION, REPRESENTATION_MASK


def label_counts(labels: torch.Tensor, num_classes: int, ignore_index: int = -100) -> torch.Tensor:
    """[num_classes] int64 counts of the labels that are not ``ignore_index``, without a host
    sync."""
    valid = labels != ignore_index
    counts = torch.zeros(num_classes, dtype=torch.int64, device=labels.device)
    return counts.scatter_add_(0, labels.masked_fill(~valid, 0).flatten(), valid.flatten().long())


def monitoring_outputs(
    vectors: torch.Tensor, mask: torch.Tensor, **labels: tuple[torch.Tensor, int]
) -> dict[str, torch.Tensor]:
    """The eval-mode outputs: ``vectors`` [rows, s, H] with ``mask`` [rows, s], and for each
    head ``name=(labels, num_classes)`` its target counts."""
    out = {REPRESENTATION: vectors.detach(), REPRESENTATION_MASK: mask.bool()}
    for name, (target, classes) in labels.items():
        out[name + LABEL_COUNTS_SUFFIX] = label_counts(target, classes)
    return out

"""The numbers a forward needs on the host (how many tokens carry a label, the span of the
position ids, whether any token is padding), counted on the CPU batch the collator built.

Read back from the device inside a forward, each would be a host-device synchronisation:
the CPU stops queueing kernels until the GPU has caught up, and the GPU then idles while the
CPU queues the rest of the micro-batch. The recipes wrap their collator in
``WithHost(collator, Model.host_layout)``: the batch then carries ``batch[HOST_KEY]``, a dict
of Python numbers that ``to_device`` leaves alone and DataLoader workers compute in parallel.
A batch without it (tests and tools that call a model directly) gets the same numbers from
its tensors, one synchronisation each on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HOST_KEY = "host"

Layout = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class WithHost:
    """collate_fn wrapper: ``batch[HOST_KEY] = layout(batch)`` on the collated CPU batch.
    Picklable when ``collate`` is and ``layout`` is a module-level function or a static
    method (DataLoader workers)."""

    collate: Callable[[list], dict[str, Any]]
    layout: Layout

    def __call__(self, samples: list) -> dict[str, Any]:
        batch = self.collate(samples)
        batch[HOST_KEY] = self.layout(batch)
        return batch


def host_numbers(batch: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """The batch's host numbers: the collator's, else ``layout`` of its tensors (syncs)."""
    host = batch.get(HOST_KEY)
    return host if host is not None else layout(batch)

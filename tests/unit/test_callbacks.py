"""What a callback may add to a micro-batch's outputs (CallbackList.after_micro_batch): 0-d
tensors on the outputs' device under new names. Anything else would be dropped from the log
without a word (MetricAccumulator sums 0-d tensors only), replace a value the model logs, or
stop the first GPU run at its first logging step (a CPU count stacked with CUDA sums)."""

from __future__ import annotations

import pytest
import torch

from megatron_taco.training.callbacks import Callback, CallbackList
from megatron_taco.training.loop import MetricAccumulator


class Adds(Callback):
    def __init__(self, **added):
        self.added = added

    def after_micro_batch(self, trainer, state, batch, outputs):
        outputs.update(self.added)


def _outputs() -> dict:
    return {"loss": torch.tensor(2.0), "mlm_tokens": torch.tensor(5), "logits": torch.ones(3, 4)}


def test_a_callbacks_counts_are_summed_with_the_models():
    outputs = _outputs()
    CallbackList([Adds(kept_tokens=torch.tensor(3))]).after_micro_batch(None, None, {}, outputs)
    acc = MetricAccumulator()
    acc.add(outputs)
    acc.add(outputs)
    assert acc.finish(acc.reduced(None).tolist(), iterations=1) == {
        "loss": 2.0, "mlm_tokens": 10.0, "kept_tokens": 6.0
    }  # fmt: skip


@pytest.mark.parametrize(
    ("added", "match"),
    [
        ({"kept_tokens": torch.ones(2)}, "'kept_tokens': .*not a 0-d tensor"),
        ({"kept_tokens": 3}, "'kept_tokens': .*not a 0-d tensor"),
        ({"mlm_tokens": torch.tensor(1)}, "'mlm_tokens': over the model's value"),
        ({"loss": torch.tensor(0.0)}, "'loss': over the model's value"),
    ],
)
def test_a_callback_adding_what_the_loop_cannot_sum_is_named(added, match):
    callbacks = CallbackList([Adds(**added)])
    with pytest.raises(TypeError, match=f"callback 'callback' added {match}"):
        callbacks.after_micro_batch(None, None, {}, _outputs())


def test_a_callback_adding_a_count_on_another_device_is_named():
    outputs = {"loss": torch.tensor(2.0, device="meta")}  # a GPU's loss, on a CPU
    with pytest.raises(TypeError, match="'kept_tokens': a count on cpu, not meta"):
        CallbackList([Adds(kept_tokens=torch.tensor(3))]).after_micro_batch(None, None, {}, outputs)

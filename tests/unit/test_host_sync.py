"""No host-device synchronisation inside a training micro-batch, for TACO, SAS and SAS^DA
pretraining and for fine-tuning.

A sync (a device value read on the host: .item(), .tolist(), bool(t), a nonzero or boolean
mask whose output size the host must know, a blocking copy either way) makes the CPU wait
for the GPU's queue to drain, after which the GPU idles while the CPU queues the next
kernels. On CPU none of these is a sync, but each one is visible: the real driver
(pretrain() with the recipe's collator, engine and callbacks) runs two iterations of two
micro-batches under a TorchDispatchMode and a TorchFunctionMode that record every such op
from the model's forward to the end of the micro-batch's callbacks (SAS's store write
included). The steady-state micro-batch that does not end a step (step 2's first) must
record none. A read of a host buffer filled by an asynchronous copy (SAS's rows, read one
micro-batch after their copy was queued) is not a sync: its copy finished long before; the
same read in the micro-batch that queued the copy would wait for the whole backward. Between steps, one that
logs nothing (and neither saves nor evaluates) reads nothing either; the step that logs reads
once, every unread step's checks and the interval's sums in one transfer.
The models alone are also run, under the same recorder, on batches with padding and
without, and the fine-tuning model (each encoder, each head) on its collator's batches.
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_taco.models.common.host import HOST_KEY
from megatron_taco.recipes.finetune import finetune_collate
from tests.helpers import (
    build,
    build_sas,
    finetune_features,
    finetune_model,
    make_batch,
    make_sas_batch,
    run_distributed,
    tiny_config,
    tiny_sas_config,
)

aten = torch.ops.aten
# Ops that read a device value on the host, or whose output shape depends on device values.
_SYNC_OPS = {
    aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    aten.nonzero.default,
    aten.item.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
    aten.lift_fresh.default,  # torch.tensor(python data): a blocking host->device copy
}
_HOST_READS = {"tolist", "numpy", "cpu", "item", "__bool__", "__int__", "__float__", "__index__"}


def _where() -> str:
    """The innermost frame of the package (or DeepSpeed) that led to the op."""
    for frame in reversed(traceback.extract_stack()):
        if "/megatron_taco/" in frame.filename or "/deepspeed/" in frame.filename:
            return f"{frame.filename.rpartition('site-packages/')[2]}:{frame.lineno}"
    return "?"


def _bool_index(func, args) -> bool:
    """index / index_put with a boolean mask: a nonzero on the GPU."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    return any(t is not None and t.dtype == torch.bool for t in args[1])


class SyncRecorder(TorchDispatchMode):
    """Records what would synchronise a GPU while ``active``."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.found: list[str] = []
        self.region = 0  # the micro-batch being recorded
        # Storages filled by copy_(..., non_blocking=True) (host staging buffers) -> the
        # micro-batch that queued the copy. Reading one in a later micro-batch is free.
        self.staging: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.active:
            if func in _SYNC_OPS or _bool_index(func, args):
                self.found.append(f"{func} at {_where()}")
            elif func in (aten._to_copy.default, aten.copy_.default):
                src, dst = (args[0], out) if func is aten._to_copy.default else (args[1], args[0])
                if src.device != dst.device and dst.device.type == "cpu":
                    self.found.append(f"{func} to cpu at {_where()}")
        return out


class HostReads(TorchFunctionMode):
    """The Python-level host reads a CPU run cannot see in the dispatcher (.tolist() and
    .numpy() of a CPU tensor dispatch nothing)."""

    def __init__(self, recorder: SyncRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.recorder
        name = getattr(func, "__name__", "")
        if rec.active and name == "copy_" and (kwargs.get("non_blocking") or args[2:3] == (True,)):
            rec.staging[args[0].untyped_storage().data_ptr()] = rec.region
        elif (
            rec.active
            and name in _HOST_READS
            and torch.is_tensor(args[0])
            and rec.staging.get(args[0].untyped_storage().data_ptr(), rec.region) == rec.region
        ):
            rec.found.append(f"Tensor.{name} at {_where()}")
        return func(*args, **kwargs)


def _count_syncs(rank, world, spec_name, args):
    from megatron_taco.recipes import sas, taco
    from megatron_taco.training.callbacks import Callback
    from megatron_taco.training.configure import build_parser, configs_from_args
    from megatron_taco.training.driver import run as pretrain

    spec = {"TACO": taco.SPEC, "SAS": sas.SPEC}[spec_name]
    recorder = SyncRecorder()
    reads = HostReads(recorder)
    per_micro: list[list[str]] = []
    between: list[list[str]] = []  # from the end of a micro-batch to the next one's forward
    logged: list[list[str]] = []  # from a step's last micro-batch to its log line's metrics

    def start(module, inputs):
        if module.training and recorder.region:
            between.append(recorder.found)
        recorder.active, recorder.found = True, []
        recorder.region += 1

    class End(Callback):
        """Last callback: ends each micro-batch's recorded region."""

        name = "end_of_micro_batch"

        def on_train_start(self, trainer, state):
            trainer.model_engine.module.register_forward_pre_hook(start)

        def after_micro_batch(self, trainer, state, batch, outputs):
            if trainer.model_engine.module.training:
                per_micro.append(recorder.found)
                recorder.found = []  # recording on: the step's end, up to the next forward

        def metrics(self, sums):  # last of the callbacks' metrics, after the loop's read
            logged.append(recorder.found)
            recorder.found = []
            return {}

    def build(ctx, recipe=spec.build):
        parts = recipe(ctx)
        parts.callbacks.append(End())
        return parts

    spec = dataclasses.replace(spec, build=build)
    cfg = configs_from_args(spec, build_parser(spec).parse_args(args), world_size=world,
                                 device_type="cpu")  # fmt: skip
    with recorder, reads:
        assert pretrain(cfg, spec, keep_process_group=True) == 0
    return per_micro, between, logged


@pytest.mark.parametrize("model", ["taco", "sas", "sas_da"])
def test_no_host_sync_inside_a_micro_batch(model, botchan_dataset, tmp_path):
    args = [
        "--model-size", "tiny", "--seq-length", "48",
        "--data-path", botchan_dataset["prefix"], "--tokenizer-model", botchan_dataset["tokenizer"],
        "--data-cache-path", str(tmp_path / "cache"), "--split", "80,10,10",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--lr", "1e-3", "--lr-warmup-iters", "0", "--eval-iters", "0", "--num-workers", "1",
        "--no-progress-bar", "--deepspeed-config", "ds_configs/zero0_fp32.json",
    ]  # fmt: skip
    if model != "taco":
        args += ["--save", str(tmp_path / "ckpt")]  # the replacement store's home
    if model == "sas_da":
        args.append("--disentangled-attention")
    spec = "TACO" if model == "taco" else "SAS"
    ((per_micro, between, logged),) = run_distributed(_count_syncs, 1, spec, args)
    assert len(per_micro) == 4  # 2 iterations x 2 micro-batches
    # Step 2's first micro-batch: steady state (caches built), not a step boundary.
    assert per_micro[2] == []
    # Between two micro-batches of a step nothing, and nothing at the end of step 1, which
    # logs, saves and evaluates nothing (--log-interval 100): its flags and gradient norm
    # stay on the device.
    assert between == [[], [], []], between
    # Step 2 logs (the last): the loop reads once, both steps' flags and norms and the
    # interval's sums together, SAS's augmentation counts among them (its callback adds them
    # to the outputs the loop sums).
    assert len(logged) == 1
    sites = [site.split(" at ")[0] + (" loop" if "training/loop.py" in site else "")
             for site in logged[0]]  # fmt: skip
    assert sites == ["Tensor.tolist loop"], logged[0]


def _syncs_in_a_step(model, batch) -> list[str]:
    """What a forward and backward of ``model`` on ``batch`` (host numbers included, as the
    recipe's collator gives them) would synchronise in the steady state: after a first step
    has built the per-length caches (SAS^DA's relative index, copied to the device once)."""
    model(batch)["loss"].backward()
    recorder = SyncRecorder()
    with recorder, HostReads(recorder):
        recorder.active = True
        model(batch)["loss"].backward()
        recorder.active = False
    return recorder.found


@pytest.mark.parametrize("padding", [True, False])
@pytest.mark.parametrize("model", ["taco", "sas", "sas_da"])
def test_pretraining_forwards_with_and_without_padding(model, padding):
    """The driver test above sees the batches the data happen to give; here each model runs
    a batch with padding and one without (the masking pass skipped), host numbers from
    the layout the recipe's collator wraps in."""
    if model == "taco":
        net, batch = build(tiny_config()), make_batch(b=2, seed=3)
    else:
        net = build_sas(tiny_sas_config(disentangled_attention=model == "sas_da"))
        batch = make_sas_batch(b=2, seed=3)
    if not padding:
        batch["attention_mask"][:] = True
    batch[HOST_KEY] = type(net).host_layout(batch)
    assert batch[HOST_KEY]["has_padding"] is padding
    assert _syncs_in_a_step(net.train(), batch) == []


@pytest.mark.parametrize("task_kind", ["classification", "span", "multiple_choice"])
@pytest.mark.parametrize("encoder", ["TACO", "SAS", "SAS^DA"])
def test_finetuning_forwards(encoder, task_kind):
    """TaskModel on a batch of the fine-tuning recipe's own collator (dynamic padding)."""
    features = finetune_features(task_kind, n=4)
    batch = finetune_collate(dynamic=True)([features[i] for i in range(4)])
    model = finetune_model(encoder, task_kind).train()
    assert _syncs_in_a_step(model, batch) == []

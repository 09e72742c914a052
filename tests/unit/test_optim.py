"""Weight-decay groups, the optimizer choice and Megatron's LR schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megatron_taco.param_groups import split_weight_decay
from megatron_taco.training.config import TrainingConfig
from megatron_taco.training.optim import (
    AnnealingLR,
    annealing_lr,
    build_optimizer,
    build_scheduler,
    param_groups,
)

# -- schedule -----------------------------------------------------------------------------


def lr(step, style="linear", warmup=10, decay=110, max_lr=1.0, min_lr=0.1):
    return annealing_lr(
        step,
        max_lr=max_lr,
        min_lr=min_lr,
        warmup_steps=warmup,
        decay_steps=decay,
        decay_style=style,
    )


def test_warmup_is_linear_from_zero():
    # Megatron: the first iteration runs after 0 steps, at lr 0.
    assert lr(0) == 0.0
    assert lr(5) == pytest.approx(0.5)
    assert lr(10) == pytest.approx(1.0)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_decay_endpoints(style):
    assert lr(10, style) == pytest.approx(1.0)
    assert lr(60, style) == pytest.approx(0.55)  # halfway: both styles are at the midpoint
    assert lr(110, style) == pytest.approx(0.1)
    assert lr(500, style) == 0.1


def test_linear_and_cosine_shapes():
    assert lr(35, "linear") == pytest.approx(0.1 + 0.9 * 0.75)
    assert lr(35, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1))
    assert lr(35, "cosine") > lr(35, "linear")


def test_constant_after_warmup():
    assert [lr(s, "constant") for s in (0, 5, 10, 11, 10**6)] == pytest.approx([0, 0.5, 1, 1, 1])


def test_no_warmup_starts_at_peak():
    assert lr(0, warmup=0) == 1.0


def tiny_optimizer(lr_value=1.0):
    return torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=lr_value)


def test_scheduler_follows_the_schedule_and_resumes():
    training = TrainingConfig(train_iters=20, lr=2.0, min_lr=0.2, lr_warmup_iters=4)
    opt = tiny_optimizer()
    sched = build_scheduler(opt, training)
    seen = []
    for _ in range(25):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [
        annealing_lr(
            i, max_lr=2.0, min_lr=0.2, warmup_steps=4, decay_steps=20, decay_style="linear"
        )
        for i in range(25)
    ]
    assert seen == pytest.approx(expected)
    assert seen[0] == 0 and seen[4] == 2.0 and seen[20] == pytest.approx(0.2)

    # A scheduler restored from a state dict (as DeepSpeed checkpoints it) continues where
    # the saved one was, on a fresh optimizer.
    opt = tiny_optimizer()
    sched = build_scheduler(opt, training)
    for _ in range(7):
        opt.step()
        sched.step()
    opt2 = tiny_optimizer()
    sched2 = build_scheduler(opt2, training)
    sched2.load_state_dict(sched.state_dict())
    for i in range(7, 12):
        opt2.step()
        sched2.step()
        assert opt2.param_groups[0]["lr"] == pytest.approx(expected[i + 1])


def test_scheduler_sets_every_param_group():
    opt = torch.optim.AdamW(
        [
            {"params": [nn.Parameter(torch.zeros(1))]},
            {"params": [nn.Parameter(torch.zeros(1))], "weight_decay": 0},
        ],
        lr=1.0,
    )
    sched = AnnealingLR(
        opt, max_lr=1.0, min_lr=0.0, warmup_steps=2, decay_steps=10, decay_style="linear"
    )
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]


# -- weight decay groups ----------------------------------------------------------------


class FusedLayerNorm(nn.Module):
    """Stands in for apex's FusedLayerNorm, which is not an nn.LayerNorm subclass."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.embed_norm = nn.LayerNorm(4)
        self.linear = nn.Linear(4, 4)
        self.prelu = nn.PReLU(4)
        self.fused_norm = FusedLayerNorm(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_no_decay_on_biases_norms_and_prelu():
    decay, no_decay = split_weight_decay(Toy())
    assert decay == ["embed.weight", "linear.weight"]
    assert no_decay == [
        "embed_norm.weight",
        "embed_norm.bias",
        "linear.bias",
        "prelu.weight",
        "fused_norm.weight",
        "fused_norm.bias",
    ]
    groups = param_groups(Toy(), 0.05)
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    assert [len(g["params"]) for g in groups] == [2, 6]


def test_real_taco_groups():
    from megatron_taco.models.taco.config import TacoConfig
    from megatron_taco.models.taco.model import TacoForPretraining
    from megatron_taco.parallel.state import single_process_state

    model = TacoForPretraining(TacoConfig.preset("tiny", vocab_size=100), single_process_state())
    decay, no_decay = split_weight_decay(model)
    assert decay and no_decay
    assert "taco.embeddings.word_embeddings.weight" in decay
    for name in no_decay:
        p = dict(model.named_parameters())[name]
        assert p.ndim < 2 or "layernorm" in name, name
    for name in decay:
        assert "layernorm" not in name and "prelu" not in name and not name.endswith("bias"), name
    assert any("prelu" in n for n in no_decay) and any("layernorm" in n for n in no_decay)
    assert len(decay) + len(no_decay) == len(list(model.parameters()))


def test_cpu_optimizer_is_torch_adamw_with_our_hyperparameters():
    training = TrainingConfig(
        train_iters=10,
        lr_warmup_iters=1,
        lr=3e-4,
        weight_decay=0.1,
        adam_beta1=0.8,
        adam_beta2=0.98,
        adam_eps=1e-8,
    )
    opt, impl = build_optimizer(Toy(), training)
    assert isinstance(opt, torch.optim.AdamW) and impl == "torch.optim.AdamW"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"]) == (3e-4, (0.8, 0.98), 1e-8)


def test_resumed_scheduler_keeps_this_runs_schedule(caplog):
    # A resumed run that trains longer decays over its own --train-iters, from the
    # checkpoint's step, and says that the schedule changed.
    short = TrainingConfig(train_iters=10, lr=1.0, lr_warmup_iters=2)
    long = TrainingConfig(train_iters=20, lr=1.0, lr_warmup_iters=2)
    opt = tiny_optimizer()
    sched = build_scheduler(opt, short)
    for _ in range(6):
        opt.step()
        sched.step()
    opt2 = tiny_optimizer()
    sched2 = build_scheduler(opt2, long)
    with caplog.at_level("WARNING"):
        sched2.load_state_dict(sched.state_dict())
    assert "decay_steps 10 -> 20" in caplog.text
    assert sched2.last_epoch == 6
    assert opt2.param_groups[0]["lr"] == pytest.approx(1.0 - 4 / 18)


# -- sample-based schedule (--train-samples) ------------------------------------------------


def _megatron_lrs(batches, *, warmup, decay, style, max_lr=1.0, min_lr=0.1):
    """Megatron-LM's OptimizerParamScheduler (megatron-core), stepped as its train_step does
    (by the step's samples): the LR each step trains at."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = tiny_optimizer()
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=max_lr, min_lr=min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
        wd_incr_steps=decay, wd_incr_style="constant",
    )  # fmt: skip
    seen = []
    for batch in batches:
        seen.append(opt.param_groups[0]["lr"])
        sched.step(increment=batch)
    return seen


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_sample_schedule_is_megatrons_across_a_global_batch_change(style):
    # 10 steps of 16 samples, saved, resumed with a global batch of 48 (a sample-based
    # schedule is how a recipe survives the change): the LRs are Megatron-LM's, and they
    # reach the end of the decay at --lr-decay-samples, not at an iteration count.
    def config(global_batch):
        return TrainingConfig(
            total_train_samples=1000, lr_warmup_samples=96, lr_decay_samples=900,
            lr_decay_style=style, lr=1.0, min_lr=0.1, micro_batch_size=16,
            global_batch_size=global_batch,
        ).resolve_length(1)  # fmt: skip

    first, second = config(16), config(48)
    assert (first.train_iters, second.train_iters) == (62, 20)  # 1000 // global batch
    opt = tiny_optimizer()
    sched = build_scheduler(opt, first)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    opt2 = tiny_optimizer()
    sched2 = build_scheduler(opt2, second)
    sched2.load_state_dict(sched.state_dict())
    for _ in range(20):
        seen.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    want = _megatron_lrs([16] * 10 + [48] * 20, warmup=96, decay=900, style=style)
    assert seen == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert seen[6] == 1.0  # the warmup ends at sample 96 = step 6 of 16
    assert seen[-1] == pytest.approx(0.1)  # 160 + 18 * 48 = 1024 > 900 samples: min_lr
    assert sched2.num_steps == 160 + 20 * 48


def test_iteration_schedule_counts_optimizer_steps_as_before(caplog):
    # An iteration-based run steps by 1 per optimizer step; a checkpoint written before the
    # sample count existed (no num_steps) resumes at its optimizer step.
    training = TrainingConfig(train_iters=20, lr=1.0, lr_warmup_iters=2)
    sched = build_scheduler(tiny_optimizer(), training)
    assert (sched.warmup_steps, sched.decay_steps, sched.step_size) == (2, 20, 1)
    state = {k: v for k, v in sched.state_dict().items() if k not in ("num_steps", "step_size")}
    state["last_epoch"] = 6
    opt = tiny_optimizer()
    resumed = build_scheduler(opt, training)
    resumed.load_state_dict(state)
    assert resumed.num_steps == 6
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0 - 4 / 18)


def test_resume_switching_between_iterations_and_samples_keeps_the_position(caplog):
    # 10 steps of 16 samples, then the run resumes counting the other unit: the count in
    # the checkpoint means nothing there, the schedule continues at step 10 / sample 160.
    iters = TrainingConfig(train_iters=62, lr=1.0, min_lr=0.1, lr_warmup_iters=6,
                           micro_batch_size=16, global_batch_size=16)  # fmt: skip
    samples = TrainingConfig(total_train_samples=1000, lr=1.0, min_lr=0.1, lr_warmup_samples=96,
                             micro_batch_size=16, global_batch_size=16).resolve_length(1)  # fmt: skip

    def ten_steps(training):
        opt = tiny_optimizer()
        sched = build_scheduler(opt, training)
        for _ in range(10):
            opt.step()
            sched.step()
        return sched.state_dict()

    opt = tiny_optimizer()
    to_iters = build_scheduler(opt, iters)
    to_iters.load_state_dict(ten_steps(samples))  # 160 samples are not 160 iterations
    assert to_iters.num_steps == 10 and not to_iters.units_changed
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0 - 0.9 * 4 / 56, rel=1e-12)

    opt = tiny_optimizer()
    to_samples = build_scheduler(opt, samples)
    to_samples.load_state_dict(ten_steps(iters))
    assert to_samples.units_changed  # the driver knows the consumed samples
    to_samples.resume_at(10, 160)
    assert to_samples.num_steps == 160 and not to_samples.units_changed
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0 - 0.9 * 64 / 904, rel=1e-12)

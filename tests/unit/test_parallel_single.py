"""megatron_taco.parallel in one process without torch.distributed (tp=1, groups None)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_taco.errors import ConfigError
from megatron_taco.parallel.config import ParallelConfig, check_world_size
from megatron_taco.parallel.cross_entropy import (
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from megatron_taco.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    merge_partitions,
    pad_vocab_size,
    param_is_not_tensor_parallel_duplicate,
    split_partition,
)
from megatron_taco.parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGTracker,
    checkpoint,
    model_parallel_seed,
)
from megatron_taco.parallel.state import (
    cuda_device_index,
    dp_group_ranks,
    init_parallel,
    single_process_state,
    tp_group_ranks,
)
from tests.helpers import vocab_parallel_accuracy


@pytest.fixture
def state(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return init_parallel(1)


def test_single_process_state(state):
    assert state.tp_group is None and state.dp_group is None
    assert (state.world_size, state.rank, state.tp_size, state.dp_size) == (1, 0, 1, 1)
    assert state.get_model_parallel_world_size() == 1
    assert state.get_data_parallel_group_ranks() == [0]
    # DeepSpeed treats an mpu with this method as "sequence parallel: ignore my DP group".
    assert not hasattr(state, "initialize_sequence_parallel")


def test_config_validation():
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size"):
        ParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(
        ConfigError, match="--tensor-model-parallel-size.*does not divide the world size 2"
    ):
        check_world_size(2, 4)
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size"):
        check_world_size(6, 4)
    check_world_size(8, 4)


def test_init_parallel_rejects_tp_larger_than_single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size"):
        init_parallel(2)


def test_init_parallel_validates_env_world_size_before_rendezvous(monkeypatch):
    # WORLD_SIZE=2 with tp=4 must fail with the flag named, not hang waiting for peers.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size.*world size 2"):
        init_parallel(4)


def test_group_layout_megatron():
    assert tp_group_ranks(4, 2) == [[0, 1], [2, 3]]
    assert dp_group_ranks(4, 2) == [[0, 2], [1, 3]]
    assert tp_group_ranks(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dp_group_ranks(8, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_pad_vocab_size():
    assert pad_vocab_size(30000, 1) == 30080
    assert pad_vocab_size(30000, 2) == 30208
    assert pad_vocab_size(256, 2) == 256
    assert pad_vocab_size(257, 2) == 512
    assert pad_vocab_size(100, 1, multiple=8) == 104


@pytest.mark.parametrize("stride", [1, 3])
def test_split_merge_roundtrip(stride):
    full = torch.arange(24.0).reshape(12, 2)
    parts = [split_partition(full, 0, stride, r, 2) for r in range(2)]
    if stride == 3:  # rank 0 gets the first half of each of q, k, v
        assert parts[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]
    assert torch.equal(merge_partitions(parts, 0, stride), full)


def test_column_parallel_equals_linear(state):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(8, 6, state, init_method=lambda w: nn.init.normal_(w, std=0.5))
    with torch.no_grad():
        layer.bias.normal_()
    ref = nn.Linear(8, 6)
    ref.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x = torch.randn(3, 5, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = layer(x), ref(x_ref)
    torch.testing.assert_close(out, out_ref)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
    # skip_bias_add hands the bias back instead of adding it
    layer.skip_bias_add = True
    y, b = layer(x)
    torch.testing.assert_close(y + b, out)


def test_column_parallel_default_init_is_normal_002_and_zero_bias(state):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(256, 256, state)
    assert abs(layer.weight.std().item() - 0.02) < 0.001
    assert torch.count_nonzero(layer.bias) == 0


def test_row_parallel_equals_linear(state):
    torch.manual_seed(1)
    layer = RowParallelLinear(8, 4, state)
    with torch.no_grad():
        layer.bias.normal_()
    ref = nn.Linear(8, 4)
    ref.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), ref(x))
    assert layer.weight.partition_dim == 1
    assert layer.bias.tensor_model_parallel is False
    assert param_is_not_tensor_parallel_duplicate(layer.bias, state)


def test_vocab_embedding_equals_embedding_and_padding_is_zero(state):
    torch.manual_seed(2)
    emb = VocabParallelEmbedding(100, 16, state)
    assert (emb.vocab_size, emb.padded_vocab_size) == (100, 128)
    assert (emb.vocab_start_index, emb.vocab_end_index) == (0, 128)
    assert emb.weight.shape == (128, 16)
    assert torch.count_nonzero(emb.weight[100:]) == 0
    assert torch.count_nonzero(emb.weight[:100]) == 100 * 16
    ref = nn.Embedding(100, 16)
    ref.weight.data.copy_(emb.weight.data[:100])
    ids = torch.randint(0, 100, (3, 7))
    torch.testing.assert_close(emb(ids), ref(ids))


def test_same_seed_gives_same_layers(state):
    torch.manual_seed(5)
    a = ColumnParallelLinear(4, 4, state)
    torch.manual_seed(5)
    b = ColumnParallelLinear(4, 4, state)
    assert torch.equal(a.weight, b.weight)


def test_cross_entropy_single_rank_matches_torch():
    torch.manual_seed(3)
    vocab, padded = 10, 16
    logits = torch.randn(4, 5, padded, requires_grad=True)
    target = torch.randint(0, vocab, (4, 5))
    target[0, :2] = -100
    loss = vocab_parallel_cross_entropy(logits, target, None, vocab_size=vocab)
    ref_logits = logits.detach()[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, ref.reshape(4, 5))
    assert loss[0, 0] == 0
    (loss * torch.arange(20.0).reshape(4, 5)).sum().backward()
    (ref * torch.arange(20.0)).sum().backward()
    torch.testing.assert_close(logits.grad[..., :vocab], ref_logits.grad)
    assert torch.count_nonzero(logits.grad[..., vocab:]) == 0
    assert torch.count_nonzero(logits.grad[0, :2]) == 0


def test_cross_entropy_bf16_input_gives_bf16_grad():
    logits = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([1, 2, 3]), None)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_argmax_and_accuracy_exclude_padding():
    logits = torch.tensor([[0.0, 1.0, 0.5, 9.0], [2.0, 2.0, 0.0, 0.0]])
    assert vocab_parallel_argmax(logits, None, vocab_size=3).tolist() == [1, 0]
    correct, total = vocab_parallel_accuracy(logits, torch.tensor([1, -100]), None, vocab_size=3)
    assert (correct.item(), total.item()) == (1, 1)


def test_tracker_fork_isolation_and_states():
    tracker = RNGTracker("cpu")
    tracker.add("a", 123)
    with pytest.raises(ValueError):
        tracker.add("b", 123)
    with pytest.raises(ValueError):
        tracker.add("a", 7)
    with pytest.raises(KeyError, match="never added"), tracker.fork("missing"):
        pass

    torch.manual_seed(0)
    expected_default = torch.rand(4)
    torch.manual_seed(0)
    with tracker.fork("a"):
        in_fork = torch.rand(4)
    # The default stream is untouched by what happened inside the fork.
    torch.testing.assert_close(torch.rand(4), expected_default)
    torch.manual_seed(123)
    torch.testing.assert_close(in_fork, torch.rand(4))  # fork used the named seed

    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(4)
    with tracker.fork("a"):
        second = torch.rand(4)
    assert not torch.equal(first, second)  # state advanced and was saved back
    tracker.set_states(saved)
    with tracker.fork("a"):
        torch.testing.assert_close(torch.rand(4), first)


# CUDA's generator state: Philox seed and offset, 8 bytes each.
CUDA_FORMAT_STATE = torch.arange(16, dtype=torch.uint8)


def test_checkpointed_tracker_of_another_device_type_keeps_its_seeded_stream(caplog):
    """A checkpoint saved on a GPU resumed on CPU (and back): the tracker's saved generator
    state is of the other kind (16 vs 5056 bytes) and would make fork() raise; it is detected,
    the stream keeps its seeded state, and the log says so. Same-kind states still restore."""
    from megatron_taco.checkpoint.rng import get_rng_states, set_rng_states

    tracker = RNGTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 5)
    seeded = tracker.get_states()
    with tracker.fork():
        advanced_draw = torch.rand(3)
    saved = get_rng_states(tracker)
    with tracker.fork():
        after_save = torch.rand(3)
    set_rng_states(saved, tracker)  # same device type: restored exactly
    with tracker.fork():
        assert torch.equal(torch.rand(3), after_save)
    assert not torch.equal(after_save, advanced_draw)

    saved["tracker"] = {MODEL_PARALLEL_RNG: CUDA_FORMAT_STATE}
    tracker.set_states(seeded)
    with caplog.at_level("WARNING"):
        set_rng_states(saved, tracker)
    assert "model-parallel-rng were saved by a generator of another device type" in caplog.text
    with tracker.fork():
        assert torch.equal(torch.rand(3), advanced_draw)  # the seeded stream, from its start

    # The other way: a CPU generator's state offered to a CUDA tracker (no CUDA call needed).
    on_gpu = RNGTracker(torch.device("cuda", 0))
    on_gpu.states = {MODEL_PARALLEL_RNG: CUDA_FORMAT_STATE.clone()}
    assert on_gpu.load_states({MODEL_PARALLEL_RNG: torch.get_rng_state()}) == [MODEL_PARALLEL_RNG]
    assert torch.equal(on_gpu.states[MODEL_PARALLEL_RNG], CUDA_FORMAT_STATE)


def test_model_parallel_seed(state):
    tracker = model_parallel_seed(42, state, device="cpu")
    torch.testing.assert_close(torch.rand(3), _rand(42))
    with tracker.fork(MODEL_PARALLEL_RNG):
        torch.testing.assert_close(torch.rand(3), _rand(42 + 2718))
    # Re-seeding resets the tracker instead of failing on the existing stream.
    assert model_parallel_seed(42, state, tracker, device="cpu") is tracker


def _rand(seed):
    return torch.rand(3, generator=torch.Generator().manual_seed(seed))


class _DropoutBlock(nn.Module):
    def __init__(self, tracker):
        super().__init__()
        self.lin1 = nn.Linear(6, 6)
        self.lin2 = nn.Linear(6, 6)
        self.tracker = tracker

    def forward(self, x, scale):
        h = F.dropout(torch.tanh(self.lin1(x)), 0.5, training=True)  # default stream
        with self.tracker.fork():
            h = F.dropout(h, 0.5, training=True)  # tracker stream
        return self.lin2(h) * scale


def _grads(use_checkpoint):
    tracker = model_parallel_seed(7, single_process_state(), device="cpu")
    torch.manual_seed(11)
    block = _DropoutBlock(tracker)
    x = torch.randn(5, 6, requires_grad=True)
    torch.manual_seed(99)  # same dropout draws in both runs
    if use_checkpoint:
        out = checkpoint(block, x, 2.0, tracker=tracker)
    else:
        out = block(x, 2.0)
    # Consume randomness between forward and backward: the recompute must not see it.
    torch.rand(100)
    with tracker.fork():
        torch.rand(100)
    after_fwd = (torch.get_rng_state(), tracker.get_states())
    out.sum().backward()
    after_bwd = (torch.get_rng_state(), tracker.get_states())
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return out.detach(), grads, after_fwd, after_bwd


def test_checkpoint_with_dropout_matches_no_checkpoint():
    out, grads, _, _ = _grads(False)
    out_c, grads_c, fwd_c, bwd_c = _grads(True)
    torch.testing.assert_close(out_c, out)
    assert torch.count_nonzero(grads[0]) < grads[0].numel()  # dropout really dropped something
    for g, gc in zip(grads, grads_c):
        torch.testing.assert_close(gc, g)
    # Backward's recompute leaves the RNG streams where backward found them.
    assert torch.equal(fwd_c[0], bwd_c[0])
    assert torch.equal(fwd_c[1][MODEL_PARALLEL_RNG], bwd_c[1][MODEL_PARALLEL_RNG])


def test_checkpoint_requires_tracker_keyword():
    with pytest.raises(TypeError):
        checkpoint(lambda x: x, torch.ones(1, requires_grad=True))


def test_tracker_device_is_explicit():
    # Never chosen by torch.cuda.is_available(): the model's device is passed in.
    with pytest.raises(TypeError):
        RNGTracker()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        model_parallel_seed(1, single_process_state())  # type: ignore[call-arg]
    assert RNGTracker("cpu").device == torch.device("cpu")
    with pytest.raises(ValueError, match="no generator state for device meta"):
        RNGTracker("meta")


@pytest.mark.parametrize(
    "local_rank,count,local_world,device",
    [
        (3, 8, 8, 3),  # every GPU of the node visible to every rank
        (3, 8, None, 3),
        (5, 1, 8, 0),  # srun --gpus-per-task=1: each rank sees its own GPU as device 0
        (0, 1, None, 0),
        (2, 8, 4, 2),  # fewer ranks than GPUs: some GPUs stay idle, none is shared
    ],
)
def test_cuda_device_from_local_rank(local_rank, count, local_world, device):
    assert cuda_device_index(local_rank, count, local_world) == device


@pytest.mark.parametrize(
    "local_rank,count,local_world,match",
    [
        (0, 0, 1, r"^CUDA is the accelerator but this process sees 0 GPU\(s\) "
                  r"\(CUDA_VISIBLE_DEVICES="),
        (9, 8, None, r"^LOCAL_RANK 9 on this node but this process sees 8 GPU\(s\)"),
        # Rank 1 of 16 alone would fit; its node would still put two ranks per GPU.
        (1, 8, 16, r"^16 ranks on this node but this process sees 8 GPU\(s\).*one rank per GPU"),
    ],
)  # fmt: skip
def test_cuda_device_counts_that_make_no_sense(local_rank, count, local_world, match):
    with pytest.raises(ConfigError, match=match):
        cuda_device_index(local_rank, count, local_world)

"""megatron_taco.parallel across real gloo process groups (world size 2, and 4 for tp=2 x dp=2).

Each worker checks against the definition or against the tp=1 module built in the same
process from the same seed (tp=1 layers need no group), so a failure names the rank."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_taco.parallel.cross_entropy import (
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from megatron_taco.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full_weight,
    param_is_not_tensor_parallel_duplicate,
)
from megatron_taco.parallel.mappings import (
    all_gather_to_tp_region,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_tp_region,
    scatter_to_tp_region,
)
from megatron_taco.parallel.random import MODEL_PARALLEL_RNG, model_parallel_seed
from megatron_taco.parallel.state import init_parallel, single_process_state
from megatron_taco.training.engine import disable_deepspeed_shm_comm
from tests.helpers import run_distributed, vocab_parallel_accuracy

ATOL = 1e-6


def _rand(seed, *shape):
    # Deterministic per (seed): any rank can rebuild any other rank's tensor locally.
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=1e-5, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- mappings (world 2, tp 2)


def _mappings_worker(rank, world):
    state = init_parallel(tp_size=world)
    g = state.tp_group
    ranks = range(world)
    shape = (2, 4, 6)

    def x_of(r):
        return _rand(10 + r, *shape)

    def g_of(r, shp=shape):
        return _rand(50 + r, *shp)

    # copy: fwd identity, bwd sum of the ranks' grads
    x = x_of(rank).requires_grad_()
    y = copy_to_tp_region(x, g)
    _close(y, x_of(rank), "copy fwd")
    y.backward(g_of(rank))
    _close(x.grad, sum(g_of(r) for r in ranks), "copy bwd")

    # reduce: fwd sum, bwd identity
    x = x_of(rank).requires_grad_()
    y = reduce_from_tp_region(x, g)
    _close(y, sum(x_of(r) for r in ranks), "reduce fwd")
    assert not torch.equal(x, x_of(rank) * 0)  # input not clobbered by the in-place all-reduce
    _close(x.detach(), x_of(rank), "reduce leaves input")
    y.backward(g_of(rank))
    _close(x.grad, g_of(rank), "reduce bwd")

    for dim in (0, 1, -1):
        # scatter: fwd own chunk of the (replicated) input, bwd all-gather of the grads
        full = x_of(0).requires_grad_()
        y = scatter_to_tp_region(full, g, dim)
        _close(y, x_of(0).chunk(world, dim)[rank], f"scatter fwd dim {dim}")
        assert y.is_contiguous()
        y.backward(g_of(rank, y.shape))
        _close(full.grad, torch.cat([g_of(r, y.shape) for r in ranks], dim), f"scatter bwd {dim}")

        # gather: fwd cat of the ranks' chunks, bwd own chunk of the grad
        x = x_of(rank).requires_grad_()
        y = gather_from_tp_region(x, g, dim)
        _close(y, torch.cat([x_of(r) for r in ranks], dim), f"gather fwd dim {dim}")
        y.backward(g_of(0, y.shape))
        _close(x.grad, g_of(0, y.shape).chunk(world, dim)[rank], f"gather bwd dim {dim}")

        # reduce-scatter: fwd own chunk of the sum, bwd all-gather
        x = x_of(rank).requires_grad_()
        with warnings.catch_warnings():  # torch 2.13 deprecates reduce_scatter_tensor:
            warnings.simplefilter("error")  # a warning on every rank of every tp run
            y = reduce_scatter_to_tp_region(x, g, dim)
        _close(y, sum(x_of(r) for r in ranks).chunk(world, dim)[rank], f"reduce-scatter fwd {dim}")
        y.backward(g_of(rank, y.shape))
        _close(
            x.grad, torch.cat([g_of(r, y.shape) for r in ranks], dim), f"reduce-scatter bwd {dim}"
        )

        # all-gather: fwd cat, bwd reduce-scatter (each rank's full grad differs)
        x = x_of(rank).requires_grad_()
        y = all_gather_to_tp_region(x, g, dim)
        _close(y, torch.cat([x_of(r) for r in ranks], dim), f"all-gather fwd {dim}")
        y.backward(g_of(rank, y.shape))
        expected = sum(g_of(r, y.shape) for r in ranks).chunk(world, dim)[rank]
        _close(x.grad, expected, f"all-gather bwd {dim}")

    # Non-contiguous input along the gathered dim still gathers the right values.
    xt = x_of(rank).transpose(0, 2)  # [6, 4, 2], non-contiguous
    _close(
        gather_from_tp_region(xt, g, 0),
        torch.cat([x_of(r).transpose(0, 2) for r in ranks], 0),
        "nc",
    )
    with pytest.raises(ValueError, match="not divisible"):
        scatter_to_tp_region(torch.ones(3, 3), g, 0)
    state.destroy()
    return True


def test_mappings_forward_backward():
    assert run_distributed(_mappings_worker, 2) == [True, True]


# ---------------------------------------------------- layers vs tp=1 (world 2, tp 2)


def _set_random_bias(layer, seed, full_size, rank, world, split):
    full = _rand(seed, full_size)
    with torch.no_grad():
        layer.bias.copy_(full.chunk(world)[rank] if split else full)


def _mlp_check(state, rank, world, gather_output):
    single = single_process_state()
    h, f = 8, 16
    torch.manual_seed(1234)
    col1, row1 = ColumnParallelLinear(h, f, single), RowParallelLinear(f, h, single)
    torch.manual_seed(1234)
    col2 = ColumnParallelLinear(h, f, state, gather_output=gather_output)
    row2 = RowParallelLinear(f, h, state, input_is_parallel=not gather_output)
    assert col2.weight.shape == (f // world, h) and row2.weight.shape == (h, f // world)
    for layer, split in ((col1, False), (row1, False)):
        _set_random_bias(layer, 7 if layer is col1 else 8, layer.bias.numel(), 0, 1, split)
    _set_random_bias(col2, 7, f, rank, world, True)
    _set_random_bias(row2, 8, h, rank, world, False)

    x1 = _rand(3, 2, 5, h).requires_grad_()
    x2 = _rand(3, 2, 5, h).requires_grad_()
    out1 = row1(F.gelu(col1(x1)))
    out2 = row2(F.gelu(col2(x2)))
    _close(out2, out1, f"mlp fwd (gather_output={gather_output})")
    grad = _rand(4, *out1.shape)
    out1.backward(grad)
    out2.backward(grad)
    _close(x2.grad, x1.grad, "mlp input grad")
    for p1, p2, name in (
        (col1.weight, col2.weight, "col.weight"),
        (col1.bias, col2.bias, "col.bias"),
        (row1.weight, row2.weight, "row.weight"),
        (row1.bias, row2.bias, "row.bias"),
    ):
        _close(gather_full_weight(p2, state.tp_group), p1.detach(), name)
        _close(gather_full_weight(p2, state.tp_group, p2.grad), p1.grad, name + ".grad")
    assert param_is_not_tensor_parallel_duplicate(col2.weight, state)
    assert param_is_not_tensor_parallel_duplicate(row2.bias, state) == (rank == 0)


def _qkv_check(state, rank, world):
    single = single_process_state()
    h = 8
    torch.manual_seed(99)
    qkv1 = ColumnParallelLinear(h, 3 * h, single, stride=3)
    torch.manual_seed(99)
    qkv2 = ColumnParallelLinear(h, 3 * h, state, stride=3)
    _close(gather_full_weight(qkv2.weight, state.tp_group), qkv1.weight.detach(), "qkv weight")
    x = _rand(5, 3, h)
    q1, k1, v1 = qkv1(x).chunk(3, dim=-1)
    q2, k2, v2 = qkv2(x).chunk(3, dim=-1)  # this rank's heads of each of q, k, v
    for a1, a2, name in ((q1, q2, "q"), (k1, k2, "k"), (v1, v2, "v")):
        _close(a2, a1.chunk(world, dim=-1)[rank], f"qkv {name} slice")
    qkv2.gather_output = True
    _close(qkv2(x), qkv1(x), "qkv gathered in [q; k; v] order")


def _embedding_check(state, rank, world, vocab):
    single = single_process_state()
    d = 6
    torch.manual_seed(5)
    emb1 = VocabParallelEmbedding(vocab, d, single)
    torch.manual_seed(5)
    emb2 = VocabParallelEmbedding(vocab, d, state)
    per = emb2.padded_vocab_size // world
    assert emb2.vocab_size == vocab
    assert (emb2.vocab_start_index, emb2.vocab_end_index) == (rank * per, (rank + 1) * per)
    full2 = gather_full_weight(emb2.weight, state.tp_group)
    assert full2.shape[0] == emb2.padded_vocab_size
    _close(full2[:vocab], emb1.weight.detach()[:vocab], "embedding real rows")
    assert torch.count_nonzero(full2[vocab:]) == 0
    ids = torch.tensor([[0, vocab - 1, vocab // 2, 1], [vocab - 2, 3, 0, vocab - 1]])
    out1, out2 = emb1(ids), emb2(ids)
    _close(out2, out1, "embedding fwd")
    grad = _rand(6, *out1.shape)
    out1.backward(grad)
    out2.backward(grad)
    g2 = gather_full_weight(emb2.weight, state.tp_group, emb2.weight.grad)
    _close(g2[:vocab], emb1.weight.grad[:vocab], "embedding grad")
    assert torch.count_nonzero(g2[vocab:]) == 0


def _layers_worker(rank, world):
    state = init_parallel(tp_size=world)
    _mlp_check(state, rank, world, gather_output=False)
    _mlp_check(state, rank, world, gather_output=True)
    _qkv_check(state, rank, world)
    # 300: padded 384 at tp=1, 512 at tp=2, ids on both ranks; 100: rank 1 holds only padding.
    for vocab in (300, 100):
        _embedding_check(state, rank, world, vocab)
    state.destroy()
    return True


def test_layers_match_tp1():
    assert run_distributed(_layers_worker, 2) == [True, True]


# ------------------------------------------------------- cross entropy (world 2, tp 2)


def _cross_entropy_worker(rank, world):
    state = init_parallel(tp_size=world)
    for vocab, padded in ((300, 512), (100, 256)):
        full = _rand(1, 3, 4, padded) * 3
        # Large logits in the padding would dominate if padding were not excluded.
        full[..., vocab:] = 50.0
        target = torch.randint(0, vocab, (3, 4), generator=torch.Generator().manual_seed(2))
        target[0, 0], target[1, 1], target[2, 2] = vocab - 1, 0, -100
        target[2, 3] = -100
        local = full.chunk(world, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, state.tp_group, vocab_size=vocab)
        ref_logits = full[..., :vocab].clone().requires_grad_()
        ref = F.cross_entropy(
            ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none", ignore_index=-100
        ).reshape(3, 4)
        _close(loss, ref, f"ce loss vocab {vocab}")
        weights = _rand(3, 3, 4)
        (loss * weights).sum().backward()
        (ref * weights).sum().backward()
        grad = gather_from_tp_region(local.grad, state.tp_group, -1)
        _close(grad[..., :vocab], ref_logits.grad, f"ce grad vocab {vocab}")
        assert torch.count_nonzero(grad[..., vocab:]) == 0
        assert torch.count_nonzero(grad[2, 2]) == 0  # ignored token

        # argmax: plant ties and a max on rank 1's side to exercise cross-rank resolution.
        full_am = full.clone()
        full_am[0, 1, 2] = full_am[0, 1, vocab - 1] = 100.0
        local_am = full_am.chunk(world, -1)[rank]
        expected = full_am[..., :vocab].argmax(-1)
        assert torch.equal(vocab_parallel_argmax(local_am, state.tp_group, vocab), expected)
        correct, total = vocab_parallel_accuracy(local_am, target, state.tp_group, vocab)
        valid = target != -100
        assert total.item() == valid.sum().item()
        assert correct.item() == ((expected == target) & valid).sum().item()
    state.destroy()
    return True


def test_vocab_parallel_cross_entropy_matches_torch():
    assert run_distributed(_cross_entropy_worker, 2) == [True, True]


# --------------------------------------------- dropout streams and layout (world 4: tp 2 x dp 2)


def _gather_all(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _layout_and_rng_worker(rank, world, tp):
    state = init_parallel(tp_size=tp)
    assert dist.get_process_group_ranks(state.tp_group) == state.tp_ranks
    assert dist.get_process_group_ranks(state.dp_group) == state.dp_ranks
    assert state.get_tensor_model_parallel_src_rank() == state.tp_ranks[0]
    # Collectives over the groups really reach exactly those ranks.
    me = torch.tensor([float(rank)])
    tp_members = [int(t.item()) for t in _gather_all(me, state.tp_group)]
    dp_members = [int(t.item()) for t in _gather_all(me, state.dp_group)]

    tracker = model_parallel_seed(1234, state, device="cpu")
    ones = torch.ones(64)
    default_mask = F.dropout(ones, 0.5, training=True) != 0
    with tracker.fork(MODEL_PARALLEL_RNG):
        tp_mask = F.dropout(ones, 0.5, training=True) != 0
    after = torch.rand(4)  # default stream continues as if the fork never happened
    tp_default = _gather_all(default_mask.float(), state.tp_group)
    tp_forked = _gather_all(tp_mask.float(), state.tp_group)
    dp_forked = _gather_all(tp_mask.float(), state.dp_group)
    same_default = all(torch.equal(m, tp_default[0]) for m in tp_default)
    tp_fork_differs = not torch.equal(tp_forked[0], tp_forked[1])
    dp_fork_same = all(torch.equal(m, dp_forked[0]) for m in dp_forked)

    torch.manual_seed(1234)
    F.dropout(ones, 0.5, training=True)
    fork_isolated = torch.equal(after, torch.rand(4))
    result = {
        "tp": state.tp_ranks,
        "dp": state.dp_ranks,
        "tp_rank": state.tp_rank,
        "dp_rank": state.dp_rank,
        "tp_members": tp_members,
        "dp_members": dp_members,
        "mpu": (
            state.get_model_parallel_world_size(),
            state.get_data_parallel_world_size(),
            state.get_data_parallel_rank(),
            state.get_sequence_data_parallel_world_size(),
        ),
        "same_default": same_default,
        "tp_fork_differs": tp_fork_differs,
        "dp_fork_same": dp_fork_same,
        "fork_isolated": fork_isolated,
    }
    state.destroy()
    assert state.tp_group is None
    return result


def test_group_layout_and_dropout_streams_tp2_dp2():
    results = run_distributed(_layout_and_rng_worker, 4, 2)
    expected_tp = [[0, 1], [0, 1], [2, 3], [2, 3]]
    expected_dp = [[0, 2], [1, 3], [0, 2], [1, 3]]
    for rank, res in enumerate(results):
        assert res["tp"] == res["tp_members"] == expected_tp[rank]
        assert res["dp"] == res["dp_members"] == expected_dp[rank]
        assert (res["tp_rank"], res["dp_rank"]) == (rank % 2, rank // 2)
        assert res["mpu"] == (2, 2, rank // 2, 2)
        assert res["same_default"], "default-stream dropout must match across TP ranks"
        assert res["tp_fork_differs"], "tracker-stream dropout must differ across TP ranks"
        assert res["dp_fork_same"], "DP peers (same tp_rank) share the tracker seed"
        assert res["fork_isolated"]


# ------------------------------------------------- ParallelState as DeepSpeed's mpu (world 2)


def _deepspeed_mpu_worker(rank, world):
    import os

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.abspath("build/torch_extensions"))
    import deepspeed

    if world == 1:
        # Built before torch.distributed existed (groups None), as in a single-process run
        # where deepspeed.initialize sets up the process group itself.
        state = single_process_state()
        assert state.tp_group is None and state.get_data_parallel_group() is dist.group.WORLD
    else:
        state = init_parallel(tp_size=world)  # tp=2, dp=1

    def build(parallel):
        torch.manual_seed(0)
        return torch.nn.Sequential(
            ColumnParallelLinear(8, 16, parallel), RowParallelLinear(16, 8, parallel)
        )

    x = _rand(1, 4, 8)
    reference = build(single_process_state())
    reference(x).square().mean().backward()
    expected_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])

    model = build(state)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
    }
    disable_deepspeed_shm_comm()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, mpu=state
    )
    engine.backward(engine(x).square().mean())
    engine.step()
    return {
        "dp_world_size": engine.dp_world_size,
        "mp_world_size": engine.mp_world_size,
        "partition_count": list(engine.optimizer.partition_count),
        "norm": float(engine.get_global_grad_norm()),
        "expected_norm": float(expected_norm),
    }


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_parallel_state_is_a_deepspeed_mpu(world):
    for res in run_distributed(_deepspeed_mpu_worker, world):
        # ZeRO shards over the data-parallel group only (size 1 here), not the world.
        assert res["dp_world_size"] == 1 and res["partition_count"] == [1]
        assert res["mp_world_size"] == world
        # Split params are summed over TP ranks, the replicated row bias counted once.
        assert res["norm"] == pytest.approx(res["expected_norm"], rel=1e-5)

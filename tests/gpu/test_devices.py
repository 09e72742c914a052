"""Which GPU a rank uses and whose random stream it keeps: the device from LOCAL_RANK (one
visible GPU per task or all of the node's), checkpoints holding this rank's own generator
and restoring it to the current device only, and the RNG tracker forking the generator of
the device it was given, not of whichever GPU is visible."""

from __future__ import annotations

import os
import re

import torch

from tests.helpers import require_gpus, run_in_process


def test_local_rank_picks_a_visible_gpu():
    require_gpus(1)
    from megatron_taco.parallel.state import cuda_device_index

    count = torch.cuda.device_count()
    assert [cuda_device_index(r, count, count) for r in range(count)] == list(range(count))
    assert cuda_device_index(count - 1, 1, count) == 0  # a task that sees one GPU


def _rng_round_trip():
    from megatron_taco.checkpoint.rng import get_rng_states, set_rng_states

    device = torch.cuda.device_count() - 1  # the last GPU: not device 0 where there are 2
    torch.cuda.set_device(device)
    torch.cuda.manual_seed_all(1)
    others = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    states = get_rng_states(None)
    want = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(2)  # every device moves on
    moved_other = torch.cuda.get_rng_state(0)
    set_rng_states(states, None)
    got = torch.rand(4, device="cuda")
    return (torch.is_tensor(states["cuda"]), torch.equal(got.cpu(), want.cpu()),
            device == 0 or torch.equal(torch.cuda.get_rng_state(0), moved_other),
            torch.equal(states["cuda"], others[device]))  # fmt: skip


def test_checkpoint_rng_state_is_this_ranks_own_gpu():
    require_gpus(1)
    one_tensor, restored, others_untouched, own = run_in_process(_rng_round_trip)
    assert one_tensor and restored and others_untouched and own


def _tracker_devices():
    from megatron_taco.parallel.random import MODEL_PARALLEL_RNG, model_parallel_seed
    from megatron_taco.parallel.state import single_process_state

    results = {}
    tracker = model_parallel_seed(3, single_process_state(), device="cuda")
    before = torch.cuda.get_rng_state()
    with tracker.fork(MODEL_PARALLEL_RNG):
        inside = torch.rand(4, device="cuda")
    results["cuda_default_untouched"] = torch.equal(torch.cuda.get_rng_state(), before)
    results["fork_draws_its_own"] = not torch.equal(
        inside.cpu(), torch.rand(4, device="cuda").cpu()
    )
    results["device"] = str(tracker.device)
    # A model on CPU in a process that sees a GPU: the CPU generator is the one forked.
    cpu_tracker = model_parallel_seed(3, single_process_state(), device="cpu")
    cuda_before, cpu_before = torch.cuda.get_rng_state(), torch.get_rng_state()
    with cpu_tracker.fork(MODEL_PARALLEL_RNG):
        torch.rand(4)
    results["cpu_fork_leaves_cuda"] = torch.equal(torch.cuda.get_rng_state(), cuda_before)
    results["cpu_fork_restores_cpu"] = torch.equal(torch.get_rng_state(), cpu_before)
    return results


def test_the_tracker_forks_the_device_it_was_given():
    require_gpus(1)
    results = run_in_process(_tracker_devices)
    assert results.pop("device") == f"cuda:{torch.cuda.current_device()}"
    assert all(results.values()), results


def test_a_count_that_makes_no_sense_is_one_line_naming_the_visible_devices():
    require_gpus(1)
    import pytest

    from megatron_taco.errors import ConfigError
    from megatron_taco.parallel.state import cuda_device_index

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=rf"CUDA_VISIBLE_DEVICES={re.escape(visible)}\)"):
        cuda_device_index(0, count, 2 * count) if count > 1 else cuda_device_index(0, 0, 1)

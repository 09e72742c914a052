"""RNG streams for tensor parallelism and activation recompute (Megatron's random.py).

Two streams matter:
* the default generator: the same seed on every TP rank, so dropout on replicated
  activations (residual stream, embeddings) draws the same mask on all TP ranks, as it must
  for the ranks to stay in sync;
* the "model-parallel-rng" stream held by an ``RNGTracker``: seeded differently per TP rank
  and forked around dropout on *split* activations (attention probabilities of this rank's
  heads), so different heads get independent masks, as they would at tp=1.

Data-parallel ranks use the same seeds (Megatron's semantics); they see different data.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_taco.parallel.state import ParallelState

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offsets of Megatron's _set_random_seed / model_parallel_cuda_manual_seed.
PIPELINE_SEED_STRIDE = 100
TENSOR_PARALLEL_SEED_OFFSET = 2718


def _device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # "cuda" alone would follow whatever device is current when the state is swapped.
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"RNGTracker: no generator state for device {device}")
    return device


# A CPU generator's state (Mersenne Twister, 5056 bytes) and a CUDA one's (Philox seed and
# offset, 16 bytes) cannot stand in for each other: the size tells which one a state is.
_CPU_STATE_BYTES = torch.get_rng_state().numel()


def state_device_type(state: torch.Tensor) -> str:
    """'cpu' or 'cuda': the kind of generator a saved state belongs to."""
    return "cpu" if state.numel() == _CPU_STATE_BYTES else "cuda"


def get_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named generator states of one device: the one the model runs on (its activations'
    dropout draws from that device's default generator), given explicitly, so a process
    that sees a GPU but runs on CPU, or runs on cuda:3, forks the right stream.
    ``fork(name)`` swaps the named state into that device's default generator for the
    duration of the block and stores the advanced state back on exit."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = _device(device)
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    @property
    def device_type(self) -> str:
        return self.device.type

    def reset(self) -> None:
        self.states = {}
        self.seeds = set()

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already used by another RNG stream")
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.seeds.add(seed)
        original = get_rng_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index].manual_seed(seed)
        else:
            torch.random.default_generator.manual_seed(seed)
        self.states[name] = get_rng_state(self.device)
        set_rng_state(original, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the named states (e.g. from a checkpoint). Seeds bookkeeping is kept."""
        self.states = {name: state.clone() for name, state in states.items()}

    def load_states(self, states: dict[str, torch.Tensor]) -> list[str]:
        """Restore saved states where they belong to this device type's generator; the names
        of those that do not (a CPU checkpoint resumed on a GPU, or back), which keep their
        seeded state: another generator's state cannot continue its stream here."""
        foreign = [n for n, s in states.items() if state_device_type(s) != self.device_type]
        self.set_states(
            {n: s for n, s in states.items() if n not in foreign}
            | {n: self.states[n] for n in foreign if n in self.states}
        )
        return foreign

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was never added (known: {sorted(self.states)})")
        original = get_rng_state(self.device)
        set_rng_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = get_rng_state(self.device)
            set_rng_state(original, self.device)


def model_parallel_seed(
    seed: int,
    parallel: ParallelState,
    tracker: RNGTracker | None = None,
    *,
    device: torch.device | str,
) -> RNGTracker:
    """Seed torch's default generators (CPU and all CUDA devices) with ``seed + 100*pp_rank``
    on every rank, and (re)create ``tracker``'s model-parallel stream with
    ``seed + 2718 + tp_rank``. Returns the tracker (a new one for ``device``, the device the
    model runs on, if None is given). Python's and numpy's global RNGs are left alone: the
    data pipeline uses explicit generators seeded from (seed, sample index)."""
    pp_rank = 0  # no pipeline parallelism
    torch.manual_seed(seed + PIPELINE_SEED_STRIDE * pp_rank)
    tracker = tracker if tracker is not None else RNGTracker(device)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + TENSOR_PARALLEL_SEED_OFFSET + parallel.tp_rank)
    return tracker


class _CheckpointFunction(torch.autograd.Function):
    """Megatron's CheckpointFunction: run forward without keeping activations; in backward
    restore the RNG states of the forward, recompute with grad, backprop, then put the RNG
    states back to what they were when backward started."""

    @staticmethod
    def forward(ctx, run_function, tracker, *args):
        ctx.run_function = run_function
        ctx.tracker = tracker
        ctx.cpu_state = torch.get_rng_state()
        ctx.cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        ctx.tracker_states = tracker.get_states() if tracker is not None else None
        with torch.no_grad():
            outputs = run_function(*args)
        tensor_idx = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.tensor_idx = tensor_idx
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in tensor_idx])
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "checkpoint() is incompatible with .grad(); use .backward() (reentrant recompute)"
            )
        args = list(ctx.non_tensor_args)
        saved = ctx.saved_tensors
        for i, t in zip(ctx.tensor_idx, saved):
            args[i] = t.detach().requires_grad_(t.requires_grad)

        tracker = ctx.tracker
        bwd_cpu_state = torch.get_rng_state()
        bwd_cuda_state = torch.cuda.get_rng_state() if ctx.cuda_state is not None else None
        bwd_tracker_states = tracker.get_states() if tracker is not None else None
        torch.set_rng_state(ctx.cpu_state)
        if ctx.cuda_state is not None:
            torch.cuda.set_rng_state(ctx.cuda_state)
        if tracker is not None:
            tracker.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*args)
        finally:
            torch.set_rng_state(bwd_cpu_state)
            if bwd_cuda_state is not None:
                torch.cuda.set_rng_state(bwd_cuda_state)
            if tracker is not None:
                tracker.set_states(bwd_tracker_states)

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grad_outputs)
            if torch.is_tensor(o) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None, *grads)


def checkpoint(function, *args, tracker: RNGTracker | None):
    """Activation recompute: ``function(*args)`` is run without storing its activations and
    rerun in backward with the same dropout masks.

    ``tracker`` is keyword-only and required (pass ``tracker=None`` explicitly if the
    function never forks a tracker stream): forgetting it would silently recompute
    tensor-parallel dropout with a different mask. At least one tensor argument must
    require grad, or no gradient reaches the function's parameters (as in torch's reentrant
    checkpoint). ``function`` returns a tensor or a tuple whose elements are tensors.
    """
    return _CheckpointFunction.apply(function, tracker, *args)

"""Pieces shared by the TACO and SAS models: LayerNorm, GELU, initialisation helpers."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taco.parallel.layers import set_tensor_model_parallel_attributes, split_partition

try:  # apex's fused kernel on GPU; it falls back to F.layer_norm itself for CPU tensors.
    # The CUDA extension itself: apex built without it (a common broken install) imports
    # fine and fails only when FusedLayerNorm() loads it, at model construction.
    import fused_layer_norm_cuda  # noqa: F401
    from apex.normalization import FusedLayerNorm as _ApexLayerNorm

    HAVE_APEX = True
except Exception:  # apex can fail at import for many reasons (ABI, CUDA mismatch)
    _ApexLayerNorm = None
    HAVE_APEX = False

InitMethod = Callable[[torch.Tensor], object]

logger = logging.getLogger(__name__)


def LayerNorm(hidden_size: int, eps: float) -> nn.Module:  # a factory named like the class
    if HAVE_APEX:
        return _ApexLayerNorm(hidden_size, eps=eps)
    return nn.LayerNorm(hidden_size, eps=eps)


class DropoutMask(nn.Module):
    """The keep mask of inverted dropout, for ops that apply it themselves (and keep it as
    bool, 1 byte per element, where nn.Dropout on CPU keeps a float scale tensor):
    forward(like) -> bool tensor of like's shape, True with probability 1 - p; None when
    dropout is off (eval, or p == 0). Drawn from the current default generator, so a caller
    can fork an RNG tracker around it."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, like: torch.Tensor) -> torch.Tensor | None:
        if not self.training or self.p == 0:
            return None
        return torch.empty(like.shape, dtype=torch.bool, device=like.device).bernoulli_(1 - self.p)


class _CompileState:
    def __init__(self, what: str) -> None:
        self.what, self.failed = what, False

    def fail(self, error: Exception) -> None:
        self.failed = True
        # Dynamo wraps the compiler's error (BackendCompilerFailed): name the original.
        while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
            error = inner
        first = (str(error).strip().splitlines() or [""])[0][:200]
        logger.warning(
            "--compile: torch.compile of the %s failed (%s: %s); running them eagerly",
            self.what,
            type(error).__name__,
            first,
        )


def compile_layers(layers: nn.ModuleList, what: str) -> None:
    """torch.compile every layer's forward in place: parameter names, state dicts and
    hooks are unchanged. Compiling happens at a layer's first call, backward graph included;
    if it fails (no C++ compiler for the CPU backend, a Triton kernel that does not build, an
    unsupported op), that call and every later call of all ``layers`` run eagerly, after one
    warning line naming ``what``."""
    import torch._functorch.config as functorch_config

    state = _CompileState(what)
    for layer in layers:
        eager = layer.forward
        compiled = torch.compile(eager)

        def forward(*args, _eager=eager, _compiled=compiled, **kwargs):
            if not state.failed:
                try:
                    # Backward graphs compile lazily, at the first backward: a failure there
                    # (a Triton kernel that does not build) would escape from backward(),
                    # past this fallback. Compile them with the forward instead.
                    with functorch_config.patch(force_non_lazy_backward_lowering=True):
                        return _compiled(*args, **kwargs)
                except Exception as error:  # dynamo and inductor raise many types
                    # A genuine error of the layer itself is raised again by the eager call.
                    state.fail(error)
            return _eager(*args, **kwargs)

        layer.forward = forward


def gelu(x: torch.Tensor) -> torch.Tensor:
    # BERT's exact (erf) GELU, not the tanh approximation.
    return F.gelu(x)


def uniform_fan_in_init(fan_in: int) -> InitMethod:
    """PyTorch's default Conv2d/Linear init, U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)

    def init_(tensor: torch.Tensor):
        return nn.init.uniform_(tensor, -bound, bound)

    return init_


@torch.no_grad()
def init_from_master_(param: torch.Tensor, init_method: InitMethod) -> None:
    """Initialise a replicated parameter from a CPU float32 master, like the parallel layers
    do: the default CPU generator is then consumed identically on every rank, every tp size
    and every device, so the model is the same whatever tp is."""
    master = torch.empty(param.shape, dtype=torch.float32)
    init_method(master)
    param.copy_(master)


@torch.no_grad()
def init_partitioned_(
    param: torch.Tensor,
    full: torch.Tensor,
    dim: int,
    rank: int,
    world: int,
) -> None:
    """Copy rank ``rank``'s contiguous slice of the full tensor ``full`` into ``param`` and
    mark it split along ``dim`` (merge_partitions rebuilds ``full`` from the ranks' slices)."""
    param.copy_(split_partition(full, dim, 1, rank, world))
    set_tensor_model_parallel_attributes(param, True, dim, 1)

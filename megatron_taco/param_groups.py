"""Which parameters AdamW decays, one definition for the optimizer (training/optim.py) and
for reading its flat ZeRO partitions back (checkpoint/reshard.py): every parameter with
fewer than 2 dimensions and every parameter of a normalisation module is excluded (biases,
LayerNorm gains, TACO's PReLU slopes and attention-convolution biases; the slopes on
purpose: decay would pull them towards a plain ReLU). Imports nothing of ours.
"""

from __future__ import annotations

from torch import nn

_NORM_TYPES: tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
if hasattr(nn, "RMSNorm"):
    _NORM_TYPES += (nn.RMSNorm,)


def _is_norm(module: nn.Module) -> bool:
    # apex's FusedLayerNorm/MixedFusedLayerNorm are not nn.LayerNorm subclasses.
    return isinstance(module, _NORM_TYPES) or "Norm" in type(module).__name__


def split_weight_decay(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names with weight decay, names without), trainable parameters only, in model order."""
    norm_params = {
        id(p) for m in model.modules() if _is_norm(m) for p in m.parameters(recurse=False)
    }
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or id(p) in norm_params:
            no_decay.append(name)
        else:
            decay.append(name)
    return decay, no_decay

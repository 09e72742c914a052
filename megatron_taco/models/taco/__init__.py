"""TACO: word-content and position streams with attention convolution (docs/taco_model.md)."""

from megatron_taco.models.taco.config import PRESETS, TacoConfig
from megatron_taco.models.taco.model import TacoForPretraining, TacoModel

__all__ = ["PRESETS", "TacoConfig", "TacoForPretraining", "TacoModel"]

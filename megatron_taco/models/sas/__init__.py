"""SAS: one encoder with MLM and RTD heads; SAS^DA adds DeBERTa's disentangled attention."""

from megatron_taco.models.sas.config import PRESETS, SasConfig
from megatron_taco.models.sas.model import SasForPretraining, SasModel

__all__ = ["PRESETS", "SasConfig", "SasForPretraining", "SasModel"]

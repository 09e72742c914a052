"""Model definitions (TACO, SAS). Imports only ``megatron_taco.parallel`` and torch."""

from megatron_taco.models.config import TacoConfig
from megatron_taco.models.flops import taco_train_flops
from megatron_taco.models.taco import TacoForPretraining, TacoModel

__all__ = ["TacoConfig", "TacoForPretraining", "TacoModel", "taco_train_flops"]

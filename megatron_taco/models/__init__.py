"""Model definitions (TACO, SAS) on the tensor-parallel layers. Imports only
``megatron_taco.parallel`` and torch."""

"""Megatron-style distributed pretraining of TACO and SAS encoders."""

__version__ = "0.1.0"

"""Tensor x data parallelism: process groups, TP layers, vocab-parallel loss, RNG streams."""

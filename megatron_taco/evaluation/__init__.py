"""Evaluations of frozen pretrained encoders, shared by examples/demo_evaluate.py,
tools/word_order_probe.py and benchmarks/: encoders.py (one adapter for our checkpoints and
transformers' models), word_order.py (the held-out word-order task, zero-shot scores),
probe.py (logistic regression on mean-pooled features), random_twins.py (a checkpoint
beside random initialisations of it), figure1.py (the TACO paper's distance/angle probe).
Loads checkpoints through recipes/registry.py; only cli/ imports it."""

"""Recipes: what each model is to the generic driver (training/driver.py).

A recipe is a ``ModelSpec`` (config classes, build -> model, collator, datasets, callbacks)
plus the callbacks only that model needs (SAS's lambda schedule and self-augmentation
store). Recipes sit above every other layer: they import data/, models/ and training/,
and nothing but cli/ imports them. ``registry.py`` maps the model kind a checkpoint's
metadata names ("TACO", "SAS") to its config and model classes, for the tools that read
checkpoints (convert, export, fine-tune).
"""

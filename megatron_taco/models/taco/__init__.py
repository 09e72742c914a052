"""TACO: word-content and position streams with attention convolution (docs/taco_model.md)."""

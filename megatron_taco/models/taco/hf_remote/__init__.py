"""TACO's transformers code, copied as it is into every exported model directory.

configuration_taco.py and modeling_taco.py import only the standard library, torch and
transformers (>= 5): users load an export with ``trust_remote_code=True`` without
megatron_taco installed. Nothing in megatron_taco imports modeling_taco.py; the exporter
imports configuration_taco.py only to write config.json.
"""

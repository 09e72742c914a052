"""Offline preprocessing: reading raw corpora, text cleaning and sentence splitting, the
parallel tokenize-and-index pipeline, and dataset merging. It may import megatron_taco.data
(tokenizer, indexed dataset); training-time code never imports it."""

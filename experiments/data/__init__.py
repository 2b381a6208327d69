"""Corpora, generated data, image-text folders and shards, tokenizers: each a dataset whose batches are a
pure function of their coordinates (draws.py)."""

"""Datasets (TFDS + grain), the embedded Shakespeare corpus and tokenizers."""

"""Batched generation with a KV cache."""

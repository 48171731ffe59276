"""Building blocks below every residual: sharding rules, shared ops, the layer stack's scan, the KV cache."""

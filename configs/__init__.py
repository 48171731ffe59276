"""Run configs (ml_collections), importable as `configs.default`."""

"""Pallas TPU kernels (AttnRes Phase 1, HC/mHC stream ops, Sinkhorn), their VJPs and mesh splits."""

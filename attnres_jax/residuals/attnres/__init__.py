"""Attention Residuals: Full and Block AttnRes through the paper's block schedule."""

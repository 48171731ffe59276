"""The train step, the training loop, the optimizer."""

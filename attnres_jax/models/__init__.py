"""The Transformer language model, built on the layer stack and a residual."""

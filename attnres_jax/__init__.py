"""attnres_jax: Attention Residuals (Kimi Team, arXiv 2603.15031) in JAX / Flax NNX."""

from attnres_jax.config import ModelConfig, model_config
from attnres_jax.depth import attn_res_read
from attnres_jax.model import Transformer, convert_standard_to_attnres

__all__ = [
  'ModelConfig',
  'Transformer',
  'attn_res_read',
  'convert_standard_to_attnres',
  'model_config',
]

"""attnres_jax: Attention Residuals (Kimi Team, arXiv 2603.15031) in JAX / Flax NNX."""

from attnres_jax.compile_report import tpu_topology
from attnres_jax.config import ModelConfig, model_config
from attnres_jax.residuals.attnres.depth import attn_res_read
from attnres_jax.models.depth_stack import DepthStack, StackConfig
from attnres_jax.models.transformer import Transformer
from attnres_jax.models.transformer import convert_standard_to_attnres

tpu_topology.quiet_backend_probe()  # before anything asks JAX for its devices

__all__ = [
  'DepthStack',
  'ModelConfig',
  'StackConfig',
  'Transformer',
  'attn_res_read',
  'convert_standard_to_attnres',
  'model_config',
]

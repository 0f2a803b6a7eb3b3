"""twell-jax: TwELL (Tile-wise ELLPACK) sparse feed-forward layers for JAX and Pallas."""

from twell_jax.config import TwELLConfig
from twell_jax.backends import IMPLEMENTATIONS
from twell_jax.layout import FFNWeights, prepare_weights
from twell_jax.ffn import FFNStats, PartialSums, feed_forward, gated_mlp, mlp
from twell_jax import nn

__all__ = ["TwELLConfig", "FFNWeights", "prepare_weights", "feed_forward", "gated_mlp", "mlp",
           "FFNStats", "PartialSums", "IMPLEMENTATIONS", "nn"]

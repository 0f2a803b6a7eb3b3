"""twell-jax: TwELL (Tile-wise ELLPACK) sparse feed-forward layers for JAX and Pallas."""

from twell_jax import xla_flags

# Before any computation starts JAX's backends: the sparse FFN's switches as device-side
# conditionals (``twell_jax.xla_flags``; TWELL_LEAVE_XLA_FLAGS=1 leaves XLA_FLAGS alone).
xla_flags.use_on_import()

from twell_jax.config import TwELLConfig  # noqa: E402
from twell_jax.backends import IMPLEMENTATIONS  # noqa: E402
from twell_jax.ffn import FFNStats, PartialSums, gated_mlp, mlp  # noqa: E402
from twell_jax import nn  # noqa: E402

__all__ = ["TwELLConfig", "gated_mlp", "mlp", "FFNStats", "PartialSums", "IMPLEMENTATIONS", "nn"]

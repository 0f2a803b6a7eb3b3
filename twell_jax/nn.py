"""Flax NNX layers over the TwELL sparse FFN ops: ``SparseGatedMLP`` and ``SparseMLP``.

Sizes: D = ``d_model``, F = ``d_ff``; x has shape [..., D].

Dtypes: parameters are stored in ``param_dtype`` (float32 by default: the optimizer's master
copy). The compute dtype is ``dtype``; ``None`` (the default) means *x's dtype*, so a model that
runs its activations in bf16 gets bf16 FFNs (the precision contract: bf16 inputs and weights,
fp32 accumulation, bf16 outputs) and a float32 model gets float32 FFNs, without a knob per
layer. Set ``dtype`` to force one: x and the parameters are cast to it and y comes back in it.

Statistics: every call sows its ``twell_jax.FFNStats`` as ``nnx.Intermediate`` under the name
``"ffn_stats"`` (one tuple entry per call). Sowing is a no-op outside ``nnx.capture``, so a
plain ``layer(x)`` records nothing and, under ``jit``, the unused statistics are removed. To
read them, or to train the L1 penalty (``stats.l1`` is differentiable)::

    y, intermediates = nnx.capture(model, nnx.Intermediate)(x)
    loss = task_loss(y) + coeff * nn.l1_penalty(intermediates)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from twell_jax.config import TwELLConfig
from twell_jax.ffn import IMPLEMENTATIONS, FFNStats, Implementation, gated_mlp, mlp

def sow_if_captured(module: nnx.Module, variable_type, name: str, value) -> None:
    """``module.sow(...)`` inside ``nnx.capture`` and a no-op outside it, on every flax 0.12.x.

    flax 0.12.12 says this with ``sow(..., capture_noop=True)``; 0.12.10 (the GPU machines'
    version) has no such argument and, outside a capture, would store the value as a new
    attribute of the module on every call. Both versions mark a capture with ``__captures__``.
    """
    if hasattr(module, "__captures__"):
        module.sow(variable_type, name, value)


STATS_NAME = "ffn_stats"
"""The name the layers sow their ``FFNStats`` under (collection ``nnx.Intermediate``)."""

CHECKPOINT_NAME = "ffn_out"
"""The ``checkpoint_name`` of each layer's output, for remat policies."""

default_kernel_init = nnx.initializers.lecun_normal()
"""Truncated normal with variance 1 / fan_in (fan_in = D for w_gate, w_up; F for w_down)."""


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_dtype(name: str, dtype: Any, allow_none: bool):
    if dtype is None:
        if allow_none:
            return None
        raise ValueError(f"{name} must be a floating-point dtype, got None")
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"{name} must be a floating-point dtype, got {dtype!r}") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{name} must be a floating-point dtype, got {dtype!r}")
    return dt


class _FFNBase(nnx.Module):
    """Shared constructor checks and the call path of the two layers."""

    def __init__(self, d_model: int, d_ff: int, *, implementation: Implementation,
                 config: TwELLConfig | None, dtype, param_dtype):
        self.d_model = _check_size("d_model", d_model)
        self.d_ff = _check_size("d_ff", d_ff)
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        if config is not None and not isinstance(config, TwELLConfig):
            raise TypeError(f"config must be a TwELLConfig or None, got {type(config).__name__}")
        self.implementation = implementation
        self.config = config
        self.dtype = _check_dtype("dtype", dtype, allow_none=True)
        self.param_dtype = _check_dtype("param_dtype", param_dtype, allow_none=False)

    def _param(self, init, rngs: nnx.Rngs, shape: tuple[int, int]) -> nnx.Param:
        return nnx.Param(init(rngs.params(), shape, self.param_dtype))

    def _bias(self, enabled: bool, d_ff: int) -> nnx.Param | None:
        if not isinstance(enabled, bool):
            raise TypeError(f"gate_bias must be a bool, got {enabled!r}")
        return nnx.Param(jnp.zeros((d_ff,), self.param_dtype)) if enabled else None

    def _run(self, op, x: jax.Array, weights: tuple[nnx.Param, ...], **bias) -> jax.Array:
        x = jnp.asarray(x)
        dtype = x.dtype if self.dtype is None else self.dtype
        x = x.astype(dtype)
        ws = tuple(w[...].astype(dtype) for w in weights)
        bias = {k: None if b is None else b[...] for k, b in bias.items()}
        y, stats = op(x, *ws, implementation=self.implementation, config=self.config,
                      return_stats=True, **bias)
        sow_if_captured(self, nnx.Intermediate, STATS_NAME, stats)
        return checkpoint_name(y, CHECKPOINT_NAME)


class SparseGatedMLP(_FFNBase):
    """ReLU-gated FFN ``y = (relu(x @ w_gate) * (x @ w_up)) @ w_down`` on TwELL sparsity.

    Parameters (``nnx.Param``, ``param_dtype``): ``w_gate`` [D, F], ``w_up`` [D, F],
    ``w_down`` [F, D]; with ``gate_bias`` also ``b_gate`` [F] (zeros), else ``b_gate`` is None.

    Args:
      d_model: D, the input and output width.
      d_ff: F, the hidden width.
      implementation: ``"pallas"`` (Pallas kernels), ``"reference"`` (the TwELL algorithm in
        plain jnp) or ``"xla"`` (dense); passed to ``twell_jax.gated_mlp`` unchanged.
      config: the TwELL format's knobs (``TwELLConfig()`` when None).
      rngs: ``nnx.Rngs`` with a ``params`` stream.
      dtype: compute dtype; ``None`` (default) means x's dtype.
      param_dtype: storage dtype of the parameters (default float32).
      kernel_init: initializer ``(key, shape, dtype) -> array`` for all three weights; default
        truncated normal with variance 1 / fan_in.
      gate_bias: add a learnable per-unit bias to the gate pre-activation (a negative bias is
        a threshold: it lowers the unit's firing rate). Default False.
    """

    def __init__(self, d_model: int, d_ff: int, *, implementation: Implementation = "pallas",
                 config: TwELLConfig | None = None, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32, kernel_init=default_kernel_init,
                 gate_bias: bool = False):
        super().__init__(d_model, d_ff, implementation=implementation, config=config,
                         dtype=dtype, param_dtype=param_dtype)
        self.w_gate = self._param(kernel_init, rngs, (d_model, d_ff))
        self.w_up = self._param(kernel_init, rngs, (d_model, d_ff))
        self.w_down = self._param(kernel_init, rngs, (d_ff, d_model))
        self.b_gate = self._bias(gate_bias, d_ff)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> y [..., D] in the compute dtype; sows ``FFNStats`` as ``"ffn_stats"``."""
        return self._run(gated_mlp, x, (self.w_gate, self.w_up, self.w_down),
                         b_gate=self.b_gate)


class SparseMLP(_FFNBase):
    """Non-gated ReLU FFN ``y = relu(x @ w_up) @ w_down`` on TwELL sparsity.

    Parameters (``nnx.Param``, ``param_dtype``): ``w_up`` [D, F], ``w_down`` [F, D]; with
    ``gate_bias`` also ``b_up`` [F] (the bias inside the ReLU), else ``b_up`` is None.
    Arguments as ``SparseGatedMLP``; calls ``twell_jax.mlp``.
    """

    def __init__(self, d_model: int, d_ff: int, *, implementation: Implementation = "pallas",
                 config: TwELLConfig | None = None, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32, kernel_init=default_kernel_init,
                 gate_bias: bool = False):
        super().__init__(d_model, d_ff, implementation=implementation, config=config,
                         dtype=dtype, param_dtype=param_dtype)
        self.w_up = self._param(kernel_init, rngs, (d_model, d_ff))
        self.w_down = self._param(kernel_init, rngs, (d_ff, d_model))
        self.b_up = self._bias(gate_bias, d_ff)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> y [..., D] in the compute dtype; sows ``FFNStats`` as ``"ffn_stats"``."""
        return self._run(mlp, x, (self.w_up, self.w_down), b_up=self.b_up)


def sown_stats(intermediates: nnx.State) -> list[FFNStats]:
    """Every ``FFNStats`` in ``intermediates`` (from ``nnx.capture(..., nnx.Intermediate)``),
    one per layer call, in the state's (sorted path) order."""
    leaves = jax.tree.leaves(intermediates, is_leaf=lambda v: isinstance(v, FFNStats))
    return [leaf for leaf in leaves if isinstance(leaf, FFNStats)]


def l1_penalty(intermediates: nnx.State) -> jax.Array:
    """Mean over sown FFN calls of ``stats.l1`` (each: mean over tokens of sum_j |h_j|).

    Differentiable; ``loss + coeff * l1_penalty(intermediates)`` is the paper's L1 term.
    Raises ValueError if nothing was sown (the model was not run under ``nnx.capture``).
    """
    stats = sown_stats(intermediates)
    if not stats:
        raise ValueError(
            "no FFNStats in intermediates: run the model under "
            "nnx.capture(model, nnx.Intermediate) to record them")
    return sum(s.l1 for s in stats) / len(stats)

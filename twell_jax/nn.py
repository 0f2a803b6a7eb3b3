"""Flax NNX layers over the TwELL sparse FFN ops: ``SparseGatedMLP`` and ``SparseMLP``.

Sizes: D = ``d_model``, F = ``d_ff``; x has shape [..., D].

Dtypes: parameters are stored in ``param_dtype`` (float32 by default: the optimizer's master
copy). The compute dtype is ``dtype``; ``None`` (the default) means *x's dtype*, so a model that
runs its activations in bf16 gets bf16 FFNs (the precision contract: bf16 inputs and weights,
fp32 accumulation, bf16 outputs) and a float32 model gets float32 FFNs, without a knob per
layer. Set ``dtype`` to force one: x and the parameters are cast to it and y comes back in it.

Sharding: inside ``jax.set_mesh(mesh)`` with a mesh that has ``twell_jax.sharding.BATCH_AXES``,
each call runs under ``shard_map``: x is split over those axes along its leading (batch)
dimension, the weights enter replicated (XLA gathers FSDP shards before the call), every device
packs and multiplies its own rows (the dense backup and the dense switch decide per device), and
XLA sums the weight gradients like any other. ``pallas_call`` cannot be partitioned by XLA, so
this is what makes the Pallas FFN run sharded; the other implementations take the same path, so
their statistics agree. The statistics are reduced across devices to the single-device values
(``reduce_stats``), except ``nnz_p99``: the maximum of the per-device 99th percentiles, an upper
bound of the global one (the exact value needs every token's count). The parameters carry logical
axis names for ``twell_jax.sharding``'s rules: ``("mlp", "embed")`` on the weights, ``("mlp",)``
on the biases.

Layout: every weight is stored [F, D], one row per hidden unit, the layout the sparse kernels
read (``twell_jax.layout``): ``w_gate`` and ``w_up`` are the transposes of an ``nnx.Linear(D,
F)`` kernel. No call transposes a weight.

Statistics: every call sows its ``twell_jax.FFNStats`` as ``nnx.Intermediate`` under the name
``"ffn_stats"`` (one tuple entry per call). Sowing is a no-op outside ``nnx.capture``, so a
plain ``layer(x)`` records nothing and, under ``jit``, the unused statistics are removed. To
read them, or to train the L1 penalty (``stats.l1`` is differentiable)::

    y, intermediates = nnx.capture(model, nnx.Intermediate)(x)
    loss = task_loss(y) + coeff * nn.l1_penalty(intermediates)
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from twell_jax import backends, sharding
from twell_jax.config import TwELLConfig
from twell_jax.backends import DEFAULT_IMPLEMENTATION, Implementation
from twell_jax.ffn import FFNStats, PartialSums, feed_forward
from twell_jax.layout import FFNWeights

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
"""Truncated normal with variance 1 / fan_in (fan_in = D for w_gate, w_up; F for w_down).
The layers call an initializer with a weight's Flax shape ([D, F] for w_gate and w_up, [F, D]
for w_down) and store w_gate and w_up transposed, so it sees the fan-in on axis 0 as usual."""


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
        backends.check(implementation)
        if config is not None and not isinstance(config, TwELLConfig):
            raise TypeError(f"config must be a TwELLConfig or None, got {type(config).__name__}")
        self.implementation = implementation
        self.config = config
        self.dtype = _check_dtype("dtype", dtype, allow_none=True)
        self.param_dtype = _check_dtype("param_dtype", param_dtype, allow_none=False)

    def _param(self, init, rngs: nnx.Rngs, fan_in_first: bool) -> nnx.Param:
        """A weight [F, D]: ``init`` draws it in the Flax layout, [D, F] (fan-in first) for
        w_gate and w_up (``fan_in_first``, stored transposed) or [F, D] for w_down."""
        if fan_in_first:
            w = init(rngs.params(), (self.d_model, self.d_ff), self.param_dtype).T
        else:
            w = init(rngs.params(), (self.d_ff, self.d_model), self.param_dtype)
        return nnx.Param(w, **sharding.logical("mlp", "embed"))

    def _bias(self, enabled: bool, d_ff: int) -> nnx.Param | None:
        if not isinstance(enabled, bool):
            raise TypeError(f"gate_bias must be a bool, got {enabled!r}")
        return (nnx.Param(jnp.zeros((d_ff,), self.param_dtype), **sharding.logical("mlp"))
                if enabled else None)

    def _run(self, x: jax.Array, weights: FFNWeights, bias: nnx.Param | None, *,
             partial_sums: bool = False) -> jax.Array | PartialSums:
        x = jnp.asarray(x)
        dtype = x.dtype if self.dtype is None else self.dtype
        x = x.astype(dtype)
        # The weights go in their own dtype: the op casts them to x.dtype, and the sparse op
        # returns float32 master weights' gradients straight from its kernels (no round trip).
        ws = FFNWeights(*(None if w is None else w[...] for w in weights))
        bias = None if bias is None else bias[...]
        run = functools.partial(feed_forward, implementation=self.implementation,
                                config=self.config, return_stats=True,
                                partial_sums=partial_sums)
        y, stats = _per_device(run, x, ws, bias)
        sow_if_captured(self, nnx.Intermediate, STATS_NAME, stats)
        return checkpoint_name(y, CHECKPOINT_NAME)


def reduce_stats(stats: FFNStats, axes: tuple[str, ...]) -> FFNStats:
    """One device's ``FFNStats`` -> those of all the devices' rows, inside ``shard_map`` over
    ``axes`` (every device holds the same number of rows, so a mean of means is the mean).
    ``nnz_p99`` becomes the maximum of the per-device percentiles: an upper bound (on every
    device at least 99% of the counts are at or below it). ``backup_overflow`` and
    ``dense_fallback`` are true if they were on some device: both are decided per device, and
    a fixed ``TwELLConfig.backup_rows`` is a capacity per device. ``hot_units``: the most on
    one device (each chooses its own)."""
    l1 = stats.l1
    # Only l1 is differentiable; pmax has no derivative rule, even for counts.
    stats = jax.lax.stop_gradient(stats)
    any_ = lambda flag: jax.lax.pmax(flag.astype(jnp.int32), axes) > 0
    return FFNStats(
        nnz_mean=jax.lax.pmean(stats.nnz_mean, axes),
        nnz_p99=jax.lax.pmax(stats.nnz_p99, axes),
        nnz_max=jax.lax.pmax(stats.nnz_max, axes),
        l1=jax.lax.pmean(l1, axes),
        heavy_rows=jax.lax.psum(stats.heavy_rows, axes),
        backup_overflow=any_(stats.backup_overflow),
        dense_fallback=any_(stats.dense_fallback),
        hot_units=jax.lax.pmax(stats.hot_units, axes),
    )


def _per_device(run: Callable, x: jax.Array, ws: FFNWeights, bias: jax.Array | None):
    """``run(x, ws, bias=bias) -> (y, stats)``, under ``shard_map`` over the context mesh's
    batch axes when there are any (see the module docstring), else directly.

    x [B, ..., D] is split along B; ws and bias enter replicated; y comes back split like x and
    the statistics reduced (``reduce_stats``). Raises ValueError when B is not a multiple of
    the batch axes' device count.
    """
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else sharding.batch_axes_of(mesh)
    n = math.prod(mesh.shape[axis] for axis in axes)
    if n == 1 or x.ndim < 2:  # one device (or no batch dimension): nothing to split
        return run(x, ws, bias=bias)
    if x.shape[0] % n:
        raise ValueError(f"FFN input of shape {x.shape}: the batch dimension must be a "
                         f"multiple of {n}, the devices of mesh axes {axes}")
    # Partial sums [S, M, D] are not split like x: each device returns its y finished.
    run = functools.partial(run, partial_sums=False)
    # Cast before the split: the weight gradients are summed over the devices in x.dtype.
    ws = jax.tree.map(lambda w: w.astype(x.dtype), ws)

    def body(x, ws, bias):
        y, stats = run(x, ws, bias=bias)
        return y, reduce_stats(stats, axes)

    # check_vma=False: neither pallas_call outputs nor the ops' custom_vjp rules carry
    # varying-across-devices types. Unchecked, shard_map's transpose sums the cotangents of the
    # replicated inputs (the weight gradients) over the batch axes, and the reduced statistics
    # are the same on every device, as out_specs P() assumes.
    return jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(), P()),
                         out_specs=(P(axes), P()), check_vma=False)(x, ws, bias)


class SparseGatedMLP(_FFNBase):
    """ReLU-gated FFN ``y = (relu(x @ w_gate) * (x @ w_up)) @ w_down`` on TwELL sparsity.

    Parameters (``nnx.Param``, ``param_dtype``): ``w_gate``, ``w_up`` and ``w_down``, each
    [F, D] (one row per unit: y = ``(relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down``); with
    ``gate_bias`` also ``b_gate`` [F] (zeros), else ``b_gate`` is None.

    Args:
      d_model: D, the input and output width.
      d_ff: F, the hidden width.
      implementation: ``"pallas"`` (Pallas kernels), ``"reference"`` (the TwELL algorithm in
        plain jnp) or ``"xla"`` (dense); passed to ``twell_jax.feed_forward`` unchanged.
      config: the TwELL format's knobs (``TwELLConfig()`` when None).
      rngs: ``nnx.Rngs`` with a ``params`` stream.
      dtype: compute dtype; ``None`` (default) means x's dtype.
      param_dtype: storage dtype of the parameters (default float32).
      kernel_init: initializer ``(key, shape, dtype) -> array`` for all three weights, called
        with each one's Flax shape (fan-in first: [D, F] for w_gate and w_up, stored
        transposed); default truncated normal with variance 1 / fan_in.
      gate_bias: add a learnable per-unit bias to the gate pre-activation (a negative bias is
        a threshold: it lowers the unit's firing rate). Default False.
    """

    def __init__(self, d_model: int, d_ff: int, *,
                 implementation: Implementation = DEFAULT_IMPLEMENTATION,
                 config: TwELLConfig | None = None, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32, kernel_init=default_kernel_init,
                 gate_bias: bool = False):
        super().__init__(d_model, d_ff, implementation=implementation, config=config,
                         dtype=dtype, param_dtype=param_dtype)
        self.w_gate = self._param(kernel_init, rngs, fan_in_first=True)
        self.w_up = self._param(kernel_init, rngs, fan_in_first=True)
        self.w_down = self._param(kernel_init, rngs, fan_in_first=False)
        self.b_gate = self._bias(gate_bias, d_ff)

    def __call__(self, x: jax.Array, *, partial_sums: bool = False) -> jax.Array | PartialSums:
        """x [..., D] -> y [..., D] in the compute dtype; sows ``FFNStats`` as ``"ffn_stats"``.
        ``partial_sums``: as in ``feed_forward`` (decode steps on one device, inference only)."""
        return self._run(x, FFNWeights(self.w_gate, self.w_up, self.w_down), self.b_gate,
                         partial_sums=partial_sums)


class SparseMLP(_FFNBase):
    """Non-gated ReLU FFN ``y = relu(x @ w_up) @ w_down`` on TwELL sparsity.

    Parameters (``nnx.Param``, ``param_dtype``): ``w_up`` and ``w_down``, each [F, D] (y =
    ``relu(x @ w_up.T) @ w_down``); with ``gate_bias`` also ``b_up`` [F] (the bias inside the
    ReLU), else ``b_up`` is None. Arguments as ``SparseGatedMLP``; calls
    ``twell_jax.feed_forward``.
    """

    def __init__(self, d_model: int, d_ff: int, *,
                 implementation: Implementation = DEFAULT_IMPLEMENTATION,
                 config: TwELLConfig | None = None, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32, kernel_init=default_kernel_init,
                 gate_bias: bool = False):
        super().__init__(d_model, d_ff, implementation=implementation, config=config,
                         dtype=dtype, param_dtype=param_dtype)
        self.w_up = self._param(kernel_init, rngs, fan_in_first=True)
        self.w_down = self._param(kernel_init, rngs, fan_in_first=False)
        self.b_up = self._bias(gate_bias, d_ff)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> y [..., D] in the compute dtype; sows ``FFNStats`` as ``"ffn_stats"``."""
        return self._run(x, FFNWeights(None, self.w_up, self.w_down), self.b_up)


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

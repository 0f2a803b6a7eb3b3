"""The FFN weights' layout: one row per hidden unit.

The sparse FFN touches the weights of its active units only, and each unit's weights are read
as whole rows: ``w_up[j]`` and ``w_down[j]`` in the up/down projections, ``w_gate[j]`` and
``w_up[j]`` in the backward's input gradient, and each weight gradient is written a unit's row
at a time. So every FFN matrix is stored [F, D], one contiguous row of D values per unit
(``w_gate`` and ``w_up`` are the transposes of a Flax ``nnx.Linear`` kernel; ``w_down`` is one).
The dense GEMMs read that layout as they read any other (a ``dot_general`` contracting the
last axes), so no call transposes a weight. A layout the kernels did not want cost a transpose
per call and a weight-sized copy: ~14 us at D = 2048, F = 5632 (bf16) on the H100, about as
long as a whole decode-sized sparse FFN.

``FFNWeights`` holds the three matrices so; ``prepare_weights`` makes it once from the Flax
layout. The layers (``twell_jax.nn``) keep their parameters in it, and Hugging Face folders
(whose gate and up projections are stored [F, D] already) convert once when loaded.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class FFNWeights(NamedTuple):
    """An FFN's weight matrices, each [F, D] (row j: unit j's weights).

    gate: the gate projection of the gated FFN; None for the non-gated one.
    up: the up projection (the non-gated FFN's ReLU input).
    down: the down projection.
    """

    gate: jax.Array | None
    up: jax.Array
    down: jax.Array

    @property
    def gated(self) -> bool:
        return self.gate is not None

    @property
    def matrices(self) -> tuple[jax.Array, ...]:
        """(gate, up, down), or (up, down) when not gated: the order the ops compute in."""
        return (self.gate, self.up, self.down) if self.gated else (self.up, self.down)


def prepare_weights(w_gate: jax.Array | None, w_up: jax.Array, w_down: jax.Array) -> FFNWeights:
    """``FFNWeights`` from the Flax layout: w_gate and w_up [D, F] (``nnx.Linear(D, F)``
    kernels; w_gate None for the non-gated FFN), w_down [F, D]. Transposes w_gate and w_up:
    make it once and pass it to every call (``twell_jax.feed_forward``), not per call."""
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if w is not None and getattr(w, "ndim", None) != 2:
            raise ValueError(f"{name} must be a 2-D array, got "
                             f"{getattr(w, 'shape', type(w).__name__)}")
    return FFNWeights(None if w_gate is None else jnp.transpose(w_gate), jnp.transpose(w_up),
                      w_down)

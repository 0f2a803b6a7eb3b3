"""The key / value cache that prefill fills and each decode step extends."""

from __future__ import annotations

from typing import NamedTuple

import jax


class KVCache(NamedTuple):
    """Per-layer keys and values of the positions decoded so far (a pytree).

    k, v: one [B, S, Nkv, H] array per layer (keys rotated), S the cache length.
    lengths: [B] int32, filled positions per sequence = where the next token is written.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

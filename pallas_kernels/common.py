"""Helpers shared by the kernel files."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Importing the fuser registers the jit-cache config "pallas_fuser_disable_nested_fuse". JAX
# imports it lazily at the first Pallas call, which changes the cache key and silently
# recompiles (~1.6 s) every function traced before that call; importing it here, with the
# kernels, keeps timings and caches stable.
from jax.experimental.pallas import fuser as _fuser  # noqa: F401


@functools.cache
def default_interpret() -> bool:
    """Run Pallas kernels in interpret mode when no GPU is present (CPU machines, CI)."""
    return jax.default_backend() != "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means: interpret exactly when there is no GPU."""
    return default_interpret() if interpret is None else bool(interpret)


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


def largest_pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= ``cap`` that divides ``n`` (1 at worst)."""
    b = cap
    while b > 1 and n % b:
        b //= 2
    return b


def check_config(config, power_of_two_fields: tuple[str, ...]) -> None:
    """Shared ``__post_init__`` checks: the named fields are powers of two and ``num_stages``
    (if the config has it) is an int >= 1. Raises ValueError naming the field and value."""
    for name in power_of_two_fields:
        value = getattr(config, name)
        if not is_power_of_two(value):
            raise ValueError(f"{name} must be a power of two, got {value!r}")
    stages = getattr(config, "num_stages", 1)
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {stages!r}")


def check_dense_tiles(h, tile_width: int, slots_per_tile: int) -> tuple[int, int]:
    """Checks a dense [M, F] input of the packing passes; returns (M, F)."""
    if h.ndim != 2:
        raise ValueError(f"h must be 2-D [M, F], got shape {h.shape}")
    m, f = h.shape
    if not is_power_of_two(tile_width) or f % tile_width:
        raise ValueError(f"tile_width={tile_width} must be a power of two dividing F={f}")
    if not isinstance(slots_per_tile, int) or not 1 <= slots_per_tile <= tile_width:
        raise ValueError(f"slots_per_tile must be in [1, {tile_width}], got {slots_per_tile!r}")
    return m, f


def block_range(start, size: int) -> jax.Array:
    """Indices [start, start + size) as an int32 vector, to index a block that may run past an
    array's end (its loads and stores masked there) where ``pl.ds(start, size)`` with a static
    start would be rejected: jax >= 0.12 checks static slices against the array's shape at
    trace time (0.11.2 skipped the check for start 0). Index vectors are not checked, as in
    JAX's own Triton kernels (``jax.experimental.pallas.ops.gpu.layer_norm``); the Triton
    lowering computes the same offsets from them."""
    return start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def check_up_inputs(x, w_up_t, m: int, f: int, d: int, gated: bool,
                    wide_x: bool = False) -> None:
    """The gated form's x [M, D] (with ``wide_x``, [M, D'] for any D' >= D) and w_up_t [F, D]
    (both given), or the non-gated form's (both None): raises ValueError naming what is
    wrong."""
    if gated:
        if x is None or w_up_t is None:
            raise ValueError("the gated form needs x and w_up_t")
        if x.ndim != 2 or x.shape[0] != m or (x.shape[1] < d if wide_x else x.shape[1] != d):
            wanted = f"({m}, D' >= {d})" if wide_x else f"({m}, {d})"
            raise ValueError(f"x has shape {x.shape}, expected {wanted}")
        if w_up_t.shape != (f, d):
            raise ValueError(f"w_up_t has shape {w_up_t.shape}, expected ({f}, {d})")
    elif x is not None or w_up_t is not None:
        raise ValueError("the non-gated form takes no x or w_up_t")


def add_in_order(part, count: int):
    """``part(0) + part(1) + ... + part(count - 1)``, added in that order: the one order every
    consumer of partial sums uses (inside kernels, ``part(s)`` loads split s), so a fused sum
    equals ``finish_partial_sums``' bit for bit."""
    total = part(0)
    for s in range(1, count):
        total = total + part(s)
    return total


def finish_partial_sums(partial_sums: jax.Array, bias: jax.Array | None, dtype) -> jax.Array:
    """[S, M, F] float32 partial sums -> ``(sum_s partial_sums[s] + bias).astype(dtype)``
    [M, F], the splits added in order 0, 1, ..., S - 1 (``add_in_order``, as the kernels that
    read partial sums themselves add them), then the float32 bias, rounded once."""
    pre = add_in_order(lambda s: partial_sums[s], partial_sums.shape[0])
    if bias is not None:
        pre = pre + bias.astype(jnp.float32)
    return pre.astype(dtype)

"""``y + h @ w`` written over y, or nothing at all, as a flag on the device says.

The hot units' output (``twell_jax.hot_units``) is a small product, h [M, K] times w [K, D],
added to the FFN's output y [M, D] for some batches and not others. A conditional around
``y + h @ w`` passed y through its other branch, and XLA copied it there (64 MB at M =
16384, D = 2048: ~45 us on the H100); a while loop of zero or one trip waited for the host
(+0.3 ms a call). Here y is an input aliased to the output: each program adds its [BM, BD]
block's product in float32 and rounds once, or, when ``run`` is false, returns without
touching memory, so a batch without hot units pays one launch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_config, largest_pow2_divisor, resolve_interpret


@dataclasses.dataclass(frozen=True, kw_only=True)
class AddProductConfig:
    """Knobs of :func:`add_product`: block rows (a power of two dividing M), the most block
    columns (the largest power of two up to it dividing D is used), Triton warps. Large
    blocks: a batch without hot units pays one launch of few programs."""

    block_m: int = 128
    block_d: int = 256
    num_warps: int = 4

    def __post_init__(self):
        check_config(self, ("block_m", "block_d", "num_warps"))


def _kernel(run_ref, h_ref, w_ref, y_ref, out_ref, *, precision):
    @pl.when(run_ref[0] != 0)
    def _():
        product = jnp.dot(h_ref[...], w_ref[...], precision=precision,
                          preferred_element_type=jnp.float32)
        out_ref[...] = (y_ref[...].astype(jnp.float32) + product).astype(out_ref.dtype)


def _block_d(d: int, config: AddProductConfig) -> int:
    return largest_pow2_divisor(d, config.block_d)


def fits(m: int, d: int, k: int, config: AddProductConfig | None = None) -> bool:
    """Whether :func:`add_product` takes these shapes: a row block divides M, a power of two
    of at least 16 divides D, K is a multiple of 16 (the tensor cores' step)."""
    config = AddProductConfig() if config is None else config
    return (m >= 16 and m % min(config.block_m, m) == 0 and _block_d(d, config) >= 16
            and k % 16 == 0)


def add_product(y: jax.Array, h: jax.Array, w: jax.Array, run: jax.Array, *,
                config: AddProductConfig | None = None, interpret: bool | None = None):
    """``y + h @ w`` (float32 accumulation, rounded once to y.dtype) where ``run``, else y,
    in y's buffer.

    Args:
      y: [M, D]; h: [M, K] and w: [K, D], one dtype (the compute dtype); run: [] bool.
      config: block sizes (``AddProductConfig()`` when None); shapes must pass ``fits``.
    Returns:
      [M, D] y.dtype. Pass y as a dead value (the FFN's fresh output): XLA then writes
      in place, else it copies y first.
    """
    config = AddProductConfig() if config is None else config
    (m, d), k = y.shape, h.shape[1]
    if h.shape != (m, k) or w.shape != (k, d):
        raise ValueError(f"add_product: y {y.shape}, h {h.shape}, w {w.shape} do not chain")
    if not fits(m, d, k, config):
        raise ValueError(f"add_product: blocks of {config.block_m} rows and a power of two >= "
                         f"16 columns must divide y {y.shape}, and K={k} be a multiple of 16")
    block_m, block_d = min(config.block_m, m), _block_d(d, config)
    # float32 operands multiply in float32 (the tensor cores' default would be TF32).
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(h.dtype) == jnp.float32 else None
    return pl.pallas_call(
        functools.partial(_kernel, precision=precision),
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(m // block_m, d // block_d),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, block_d), lambda i, j: (0, j)),
            pl.BlockSpec((block_m, block_d), lambda i, j: (i, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_d), lambda i, j: (i, j)),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps),
        interpret=resolve_interpret(interpret),
        name="twell_add_product",
    )(jnp.reshape(jnp.asarray(run, jnp.int32), (1,)), h, w, y)


def add_product_reference(y, h, w, run):
    """Plain-jnp :func:`add_product`."""
    product = jnp.dot(h, w, preferred_element_type=jnp.float32)
    return jnp.where(run, (y.astype(jnp.float32) + product).astype(y.dtype), y)

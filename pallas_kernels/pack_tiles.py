"""Per-tile TwELL packing of a dense [M, F] array (the packing pass without the GEMM).

``pack_tiles(h)`` stores ``relu(h)``'s positive entries per (row, column tile) exactly as
``gate_pack`` does (same epilogue, ``gate_pack.pack_block``): values [M, F//T, S], global
columns [M, F//T, S] int32, true counts [M, F//T] int32. Used as the second stage of the
"two-stage" gate: XLA's GEMM writes the dense gate, this pass packs it. That costs one extra
write and read of the dense gate (M * F * 2 bytes each way) but keeps XLA's GEMM rate, which
the fused epilogue does not reach yet (BENCHMARKS.md). It also packs any dense array on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (check_config, check_dense_tiles, largest_pow2_divisor, resolve_interpret)
from pallas_kernels.gate_pack import PrefixSum, pack_block, pack_reference


def _pack_tiles_kernel(h_ref, values_ref, columns_ref, counts_ref, *, block_m: int,
                       tile_width: int, tiles_per_program: int, slots_per_tile: int,
                       prefix_sum: PrefixSum):
    """One program: rows [i * block_m, +block_m) x tiles [c * n, +n)."""
    i = pl.program_id(0)
    c = pl.program_id(1)
    block_n = tiles_per_program * tile_width
    row0 = pl.multiple_of(i * block_m, block_m)
    col0 = pl.multiple_of(c * block_n, block_n)
    block = h_ref[pl.ds(row0, block_m), pl.ds(col0, block_n)].astype(jnp.float32)
    pack_block(block, values_ref, columns_ref, counts_ref, row0=row0,
               tile0=c * tiles_per_program, tile_width=tile_width,
               slots_per_tile=slots_per_tile, prefix_sum=prefix_sum)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackTilesConfig:
    """Block sizes and Triton knobs of :func:`pack_tiles`.

    Attributes:
      block_m: rows per program (power of two).
      tiles_per_program: column tiles per program (power of two).
      num_warps: Triton warps per program.
      prefix_sum: "cumsum" or "matmul" (see ``gate_pack``).
    """

    block_m: int = 32
    tiles_per_program: int = 1
    num_warps: int = 4
    prefix_sum: PrefixSum = "cumsum"

    def __post_init__(self):
        check_config(self, ("block_m", "tiles_per_program", "num_warps"))
        if self.prefix_sum not in ("cumsum", "matmul"):
            raise ValueError(f"prefix_sum must be 'cumsum' or 'matmul', got {self.prefix_sum!r}")


def default_pack_tiles_config(m: int, f: int, tile_width: int) -> PackTilesConfig:
    """32 rows x one tile per program: a memory-bound pass, so many small programs keep
    enough loads in flight. Untuned on the device."""
    del f, tile_width
    return PackTilesConfig(block_m=largest_pow2_divisor(m, 32))


def pack_tiles(h: jax.Array, *, tile_width: int, slots_per_tile: int,
               config: PackTilesConfig | None = None,
               interpret: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Packs ``relu(h)`` per column tile.

    Args:
      h: [M, F] (bf16 or f32); F % tile_width == 0 and M % block_m == 0 (the caller pads).
      tile_width: T (power of two). slots_per_tile: S in [1, T].
    Returns:
      values [M, F//T, S] h.dtype, columns [M, F//T, S] int32, counts [M, F//T] int32.
    """
    m, f = check_dense_tiles(h, tile_width, slots_per_tile)
    config = default_pack_tiles_config(m, f, tile_width) if config is None else config
    num_tiles = f // tile_width
    if m % config.block_m:
        raise ValueError(f"M={m} is not a multiple of block_m={config.block_m}")
    if num_tiles % config.tiles_per_program:
        raise ValueError(f"{num_tiles} tiles is not a multiple of "
                         f"tiles_per_program={config.tiles_per_program}")
    kernel = functools.partial(
        _pack_tiles_kernel, block_m=config.block_m, tile_width=tile_width,
        tiles_per_program=config.tiles_per_program, slots_per_tile=slots_per_tile,
        prefix_sum=config.prefix_sum)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((m, num_tiles, slots_per_tile), h.dtype),
            jax.ShapeDtypeStruct((m, num_tiles, slots_per_tile), jnp.int32),
            jax.ShapeDtypeStruct((m, num_tiles), jnp.int32),
        ),
        grid=(m // config.block_m, num_tiles // config.tiles_per_program),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=resolve_interpret(interpret),
        name="twell_pack_tiles",
    )(h)


def pack_tiles_reference(h: jax.Array, *, tile_width: int, slots_per_tile: int):
    """Plain-jnp :func:`pack_tiles` (same outputs)."""
    values, columns, counts = pack_reference(h.astype(jnp.float32), tile_width, slots_per_tile)
    return values.astype(h.dtype), columns, counts

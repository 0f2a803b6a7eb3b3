"""Gate GEMM + ReLU + per-tile TwELL packing in the epilogue.

For ``x`` [M, D] and ``w`` [D, F], each program computes one [block_m, T] tile of
``relu(x @ w + bias)`` in fp32 registers (K loop over D) and packs it before anything reaches
memory: the dense tile is never stored. Per (row, column tile) the outputs are

* ``values``  [M, F // T, S] in x.dtype: the positive entries in ascending column order,
* ``columns`` [M, F // T, S] int32: their GLOBAL column indices,
* ``counts``  [M, F // T] int32: the true number of positive entries in the tile (may exceed S;
  entries past the S-th are not stored, the caller recomputes such *heavy* rows densely).

Unused slots hold value 0 and column 0. "Positive" means the fp32 pre-activation is not <= 0, i.e.
``> 0`` or NaN: relu(NaN) is NaN, a non-zero, so NaN is stored like any other non-zero and
propagates downstream as in the dense layer.

Packing. With ``p`` the 0/1 mask of positives, the slot of a positive lane is its exclusive prefix
count along the row (``incl - p``). Every lane of the tile takes part in ONE masked scatter store:
positive lanes write (value, column) to their slot, and non-positive lanes write (0, 0) to the
unused slots ``count, count + 1, ..., S - 1`` (the q-th non-positive lane, q = c - excl, takes slot
``count + q``; there are always enough of them since T >= S). Lanes whose slot would be >= S are
masked off. So every slot of the output is written exactly once by exactly one lane: no zero
initialisation, hence no write-after-write ordering between threads of a program, and no
duplicate addresses among enabled lanes. Masked-off lanes get slot index S, out of range of the
slot axis: on the GPU masked lanes never touch memory, and in interpret mode (where a masked
scatter is a read-modify-write scatter of the whole index set) the out-of-range updates are
dropped, so they cannot clobber a real write.

The inclusive prefix count is either ``jnp.cumsum`` (a Triton scan) or a [block_m, T] x [T, T]
matmul of the bf16 0/1 mask with an upper-triangular ones matrix on the tensor cores (fp32
accumulation, exact for any count < 2**24). Both give identical results (``prefix_sum`` knob).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import is_power_of_two, largest_pow2_divisor, resolve_interpret

PrefixSum = Literal["cumsum", "matmul"]
_PREFIX_SUMS = ("cumsum", "matmul")


def _grid_position(pid, num_row_blocks: int, num_col_blocks: int, group_m: int):
    """Program id -> (row block, column block) in groups of ``group_m`` row blocks.

    Within a group the row block varies fastest, so the programs running at the same time share
    a few [block_m, D] slabs of x and sweep all of w: x is read from DRAM about once and w stays
    in L2. (A plain 2-D grid with rows fastest re-streams all of x once per column block.)
    """
    per_group = group_m * num_col_blocks
    group = pid // per_group
    first = group * group_m
    size = jnp.minimum(num_row_blocks - first, group_m)
    within = pid % per_group
    return first + within % size, within // size


def _gate_pack_kernel(
    x_ref,
    w_ref,
    *refs,
    has_bias: bool,
    block_m: int,
    block_k: int,
    tile_width: int,
    tiles_per_program: int,
    slots_per_tile: int,
    num_k_blocks: int,
    num_row_blocks: int,
    num_col_blocks: int,
    group_m: int,
    prefix_sum: PrefixSum,
    precision: jax.lax.Precision | None,
):
    """One program: rows [i * block_m, +block_m) x tiles [c * n, +n) (n = tiles_per_program).

    Refs (whole arrays): x [M, D], w [D, F], optional bias [F]; outputs values [M, F//T, S],
    columns [M, F//T, S], counts [M, F//T].
    """
    if has_bias:
        b_ref, values_ref, columns_ref, counts_ref = refs
    else:
        b_ref = None
        values_ref, columns_ref, counts_ref = refs
    i, c = _grid_position(pl.program_id(0), num_row_blocks, num_col_blocks, group_m)
    n_sub = tiles_per_program
    block_n = n_sub * tile_width
    row0 = pl.multiple_of(i * block_m, block_m)
    col0 = pl.multiple_of(c * block_n, block_n)

    def k_step(kb, acc):
        k0 = pl.multiple_of(kb * block_k, block_k)
        xb = x_ref[pl.ds(row0, block_m), pl.ds(k0, block_k)]
        wb = w_ref[pl.ds(k0, block_k), pl.ds(col0, block_n)]
        return acc + jnp.dot(xb, wb, preferred_element_type=jnp.float32, precision=precision)

    acc = jax.lax.fori_loop(
        0, num_k_blocks, k_step, jnp.zeros((block_m, block_n), jnp.float32)
    )
    if b_ref is not None:
        acc = acc + b_ref[pl.ds(col0, block_n)].astype(jnp.float32)[None, :]

    pack_block(acc, values_ref, columns_ref, counts_ref, row0=row0, tile0=c * n_sub,
               tile_width=tile_width, slots_per_tile=slots_per_tile, prefix_sum=prefix_sum)


def pack_block(acc, values_ref, columns_ref, counts_ref, *, row0, tile0, tile_width: int,
               slots_per_tile: int, prefix_sum: PrefixSum):
    """The packing epilogue: stores the [block_m, n * T] fp32 block ``acc`` (rows from ``row0``,
    tiles from ``tile0``) as per-tile slots and counts. Shared with ``pack_tiles``."""
    block_m, block_n = acc.shape
    n_sub = block_n // tile_width
    shape = (block_m, n_sub, tile_width)
    acc = acc.reshape(shape)
    positive = jnp.logical_not(acc <= 0.0)  # > 0 or NaN: the non-zeros of relu(acc)
    p_int = positive.astype(jnp.int32)
    lane = jax.lax.broadcasted_iota(jnp.int32, shape, 2)
    if prefix_sum == "cumsum":
        incl = jnp.cumsum(p_int, axis=2)
    else:
        r = jax.lax.broadcasted_iota(jnp.int32, (tile_width, tile_width), 0)
        cc = jax.lax.broadcasted_iota(jnp.int32, (tile_width, tile_width), 1)
        upper = (r <= cc).astype(jnp.bfloat16)  # upper[a, b] = 1 iff a <= b
        incl = jnp.dot(
            positive.astype(jnp.bfloat16).reshape(block_m * n_sub, tile_width), upper,
            preferred_element_type=jnp.float32,
        ).astype(jnp.int32).reshape(shape)
    excl = incl - p_int
    count = jnp.sum(p_int, axis=2)  # [block_m, n]
    # Positive lanes -> their rank; the q-th non-positive lane (q = lane - excl) -> count + q.
    slot = jnp.where(positive, excl, count[:, :, None] + (lane - excl))
    enabled = slot < slots_per_tile
    slot = jnp.where(enabled, slot, slots_per_tile)  # out of range of the slot axis when masked
    sub = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    vals = jnp.where(positive, acc, 0.0).astype(values_ref.dtype)
    cols = jnp.where(positive, (tile0 + sub) * tile_width + lane, 0)
    plgpu.store(values_ref.at[rows, tile0 + sub, slot], vals, mask=enabled)
    plgpu.store(columns_ref.at[rows, tile0 + sub, slot], cols, mask=enabled)
    count_rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, n_sub), 0)
    count_tiles = tile0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, n_sub), 1)
    plgpu.store(counts_ref.at[count_rows, count_tiles], count)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatePackConfig:
    """Block sizes and Triton knobs of :func:`gate_pack` (the tile width T is a format knob).

    Attributes:
      block_m: rows per program (power of two, >= 16: the tensor-core dot minimum).
      block_k: contraction step of the K loop over D (power of two, >= 16).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the K loop.
      prefix_sum: "cumsum" (Triton scan) or "matmul" (mask @ triangular ones on tensor cores);
        identical results, see ``default_gate_pack_config`` for their speed.
      tiles_per_program: column tiles per program (power of two): the GEMM block is
        [block_m, tiles_per_program * T], packed tile by tile in the epilogue.
      group_m: row blocks per launch group (``_grid_position``): programs of one group share x.
    """

    block_m: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    prefix_sum: PrefixSum = "cumsum"
    tiles_per_program: int = 1
    group_m: int = 32

    def __post_init__(self):
        for name in ("block_m", "block_k"):
            v = getattr(self, name)
            if not is_power_of_two(v) or v < 16:
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        if not is_power_of_two(self.tiles_per_program):
            raise ValueError(
                f"tiles_per_program must be a power of two, got {self.tiles_per_program!r}")
        if not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"group_m must be an int >= 1, got {self.group_m!r}")
        if not is_power_of_two(self.num_warps):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")
        if self.prefix_sum not in _PREFIX_SUMS:
            raise ValueError(f"prefix_sum must be one of {_PREFIX_SUMS}, got {self.prefix_sum!r}")



def default_gate_pack_config(m: int, d: int, f: int, tile_width: int, dtype) -> GatePackConfig:
    """Default blocks for x [m, d] @ w [d, f] with tile width T = ``tile_width``.

    Measured on H100 (bf16, M=16384, D=2048, F=5632, T=128, S=8, bias; XLA's dense GEMM alone
    0.72 ms): block_m 64, block_k 64, 4 warps, 4 stages 1.63 ms (3 stages 1.88; block_m 128
    2.77; block_m 32 2.17; block_k 128 1.97; 8 warps 2.13). prefix_sum "cumsum" 1.63 ms vs
    "matmul" 1.66 at T=128, and at T=256 (S=16) 1.87 vs 2.78 (block_m 32) and 2.52 vs 4.38
    (block_m 64): the scan is never slower, so it is the default. At T=256 block_m 32 is best
    (1.87 ms); block_m 64 x block_k 128 x T 256 exceeds shared memory. Blocks shrink to the
    largest power of two that divides the problem (never below 16: the wrapper then raises and
    the caller must pad). float32 inputs use half the K step (twice the bytes per element).

    Launch order (``group_m``, later runs, XLA GEMM 0.57-0.60 ms): rows fastest over all of
    M (the first version) 1.40-1.46 ms; groups of 8 row blocks 1.17-1.27; groups of 32
    1.12-1.21 ms (default). A plain Pallas GEMM with the same 64 x 128 tiles and no packing
    took 1.02-1.07 ms, 128 x 128 0.73 ms and 128 x 256 0.66 ms: the small tile, not the
    epilogue, costs most; larger tiles with this epilogue ran out of shared memory or spilled
    (128 x 128 at 8 warps: 1.30 ms). ``twell_jax`` therefore uses the two-stage gate (XLA GEMM,
    then ``pack_rows``) by default.
    """
    del f
    block_m = max(16, largest_pow2_divisor(m, 32 if tile_width >= 256 else 64))
    cap_k = 32 if jnp.dtype(dtype) == jnp.float32 else 64
    block_k = max(16, largest_pow2_divisor(d, cap_k))
    return GatePackConfig(block_m=block_m, block_k=block_k)


def _check_pack_args(x, w, bias, tile_width, slots_per_tile):
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x and w must be 2-D, got x.shape={x.shape}, w.shape={w.shape}")
    m, d = x.shape
    if w.shape[0] != d:
        raise ValueError(f"w has shape {w.shape}, expected ({d}, F) for x of shape {x.shape}")
    f = w.shape[1]
    if x.dtype not in (jnp.bfloat16, jnp.float32) or w.dtype != x.dtype:
        raise ValueError(
            f"x and w must share dtype bfloat16 or float32, got x {x.dtype}, w {w.dtype}"
        )
    if bias is not None and (bias.shape != (f,) or bias.dtype not in (x.dtype, jnp.float32)):
        raise ValueError(
            f"bias has shape {bias.shape} dtype {bias.dtype}, expected ({f},) of {x.dtype} or float32"
        )
    if not is_power_of_two(tile_width) or tile_width < 16:
        raise ValueError(f"tile_width must be a power of two >= 16, got {tile_width!r}")
    if f % tile_width:
        raise ValueError(f"F={f} is not a multiple of tile_width={tile_width}")
    if not isinstance(slots_per_tile, int) or not 1 <= slots_per_tile <= tile_width:
        raise ValueError(
            f"slots_per_tile must be an int in [1, tile_width={tile_width}], got {slots_per_tile!r}"
        )
    return m, d, f


def gate_pack(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None = None,
    *,
    tile_width: int,
    slots_per_tile: int,
    config: GatePackConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Packed ``relu(x @ w + bias)``.

    Args:
      x: [M, D] bfloat16 or float32.
      w: [D, F], same dtype as x.
      bias: [F] (x.dtype or float32) or None.
      tile_width: T, a power of two >= 16 dividing F.
      slots_per_tile: S in [1, T].
      config: block sizes; ``default_gate_pack_config`` when None. Requires M % block_m == 0
        and D % block_k == 0 (the caller pads).
      interpret: run the Pallas interpreter (None: iff no GPU).

    Returns:
      values [M, F//T, S] x.dtype, columns [M, F//T, S] int32 (global), counts [M, F//T] int32.
    """
    m, d, f = _check_pack_args(x, w, bias, tile_width, slots_per_tile)
    if config is None:
        config = default_gate_pack_config(m, d, f, tile_width, x.dtype)
    if m % config.block_m:
        raise ValueError(f"M={m} is not a multiple of block_m={config.block_m}")
    if d % config.block_k:
        raise ValueError(f"D={d} is not a multiple of block_k={config.block_k}")
    num_tiles = f // tile_width
    if num_tiles % config.tiles_per_program:
        raise ValueError(f"F // tile_width = {num_tiles} tiles is not a multiple of "
                         f"tiles_per_program={config.tiles_per_program}")
    num_row_blocks = m // config.block_m
    num_col_blocks = num_tiles // config.tiles_per_program
    kernel = functools.partial(
        _gate_pack_kernel,
        has_bias=bias is not None,
        block_m=config.block_m,
        block_k=config.block_k,
        tile_width=tile_width,
        tiles_per_program=config.tiles_per_program,
        slots_per_tile=slots_per_tile,
        num_k_blocks=d // config.block_k,
        num_row_blocks=num_row_blocks,
        num_col_blocks=num_col_blocks,
        group_m=config.group_m,
        prefix_sum=config.prefix_sum,
        # fp32 inputs: true fp32 products (Triton's default for fp32 dots is TF32).
        precision=jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None,
    )
    out_shape = (
        jax.ShapeDtypeStruct((m, num_tiles, slots_per_tile), x.dtype),
        jax.ShapeDtypeStruct((m, num_tiles, slots_per_tile), jnp.int32),
        jax.ShapeDtypeStruct((m, num_tiles), jnp.int32),
    )
    operands = (x, w) if bias is None else (x, w, bias)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_row_blocks * num_col_blocks,),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=resolve_interpret(interpret),
        name="twell_gate_pack",
    )(*operands)


def gate_pack_reference(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None = None,
    *,
    tile_width: int,
    slots_per_tile: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain-jnp :func:`gate_pack`: fp32 GEMM at HIGHEST precision, then ``pack_reference``."""
    _check_pack_args(x, w, bias, tile_width, slots_per_tile)
    pre = jnp.dot(
        x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    if bias is not None:
        pre = pre + bias.astype(jnp.float32)[None, :]
    values, columns, counts = pack_reference(pre, tile_width, slots_per_tile)
    return values.astype(x.dtype), columns, counts


def pack_reference(pre: jax.Array, tile_width: int, slots_per_tile: int):
    """Packs relu(pre) [M, F] per tile in plain jnp (F % tile_width == 0): a stable sort on
    "not positive" puts each tile's positive lanes first, in ascending column order.
    Returns values [M, F//T, S] pre.dtype, columns [M, F//T, S] int32, counts [M, F//T] int32."""
    m, f = pre.shape
    num_tiles = f // tile_width
    pre = pre.reshape(m, num_tiles, tile_width)
    positive = jnp.logical_not(pre <= 0.0)  # > 0 or NaN
    counts = jnp.sum(positive, axis=-1, dtype=jnp.int32)
    order = jnp.argsort(jnp.logical_not(positive).astype(jnp.int32), axis=-1, stable=True)
    order = order[..., :slots_per_tile].astype(jnp.int32)
    used = jnp.arange(slots_per_tile, dtype=jnp.int32) < counts[..., None]
    values = jnp.where(used, jnp.take_along_axis(pre, order, axis=-1), 0.0).astype(pre.dtype)
    tile0 = (np.arange(num_tiles, dtype=np.int32) * tile_width)[None, :, None]
    columns = jnp.where(used, order + tile0, 0)
    return values, columns, counts

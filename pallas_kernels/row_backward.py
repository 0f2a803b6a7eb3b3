"""The FFN backward's per-row products on row lists, one program per token row.

For each row m and valid entry k < row_nnz[m] (j = columns[m, k], g = gate_values[m, k]), with
dy the output cotangent and ``l1`` the cotangent of the L1 statistic's per-entry |h| term:

    dh = dy[m] . w_down[j] + l1 * sign(h)            h = g * u[m, k] (gated) or g
    gated:      du = dh * g,  dg = dh * u[m, k],     dx[m] += du * w_up_t[j] + dg * w_gate_t[j]
    non-gated:                                       dx[m] += dh * w_up_t[j]

Outputs dx [M, D] and the per-entry gradients (du, dg) [M, K] float32 (gated) or dh (non-gated),
which the transposed products (dW) and the bias gradient consume. All weights are feature-major
[F, D], so each entry reads three (gated) or two contiguous D-rows.

Two kernels, one program per row each: the first computes the per-entry gradients from the dy
row and the ``w_down`` rows, the second sums the ``w_up_t`` (and ``w_gate_t``) rows scaled by
them into dx. One kernel doing both read from all three weight matrices at once: at D = 2048,
F = 5632 that is 69 MB, more than the H100's 50 MB L2, against 23 and 46 MB for the two
kernels apart: 1.20 ms against 0.33 + 0.52 ms at M = 16384. The
entries' gradients travel between them as [M, K] float32 arrays, which the function returns
anyway. The arithmetic and its order are the one kernel's: the results are the same bits.
``row_entry_grads`` and ``row_dx`` are the two kernels on their own (the FFN backward runs dx
inside its route switch's branches: ``twell_jax.ffn``); ``row_backward`` runs both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, resolve_interpret
from pallas_kernels.row_up_down import RowUpDownConfig, default_row_up_down_config


def _entry_grads_kernel(*refs, block_d: int, num_chunks: int, num_slots: int, width: int,
                        gated: bool):
    """One program: row ``program_id(0)``, the per-entry gradients. Refs: dy [M, D],
    w_down [F, D], gate_values [M, K], [up [M, K]], columns [M, K], row_nnz [M], l1 [1]
    float32; outputs d1 [M, width] (du, or dh non-gated), [d2 [M, width]] (dg, gated only)."""
    if gated:
        dy_ref, w_down_ref, g_ref, u_ref, columns_ref, nnz_ref, l1_ref, d1_ref, d2_ref = refs
    else:
        dy_ref, w_down_ref, g_ref, columns_ref, nnz_ref, l1_ref, d1_ref = refs
    row = pl.program_id(0)
    nnz = jnp.clip(nnz_ref[row], 0, num_slots)
    chunks = [pl.ds(c * block_d, block_d) for c in range(num_chunks)]
    slot = jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
    dy_chunks = [dy_ref[row, ch].astype(jnp.float32) for ch in chunks]
    l1 = l1_ref[0]

    def fetch(k):
        """Entry k's unit, gate and up values (k clamped into the lists: past row_nnz
        unused)."""
        k = jnp.minimum(k, num_slots - 1)
        unit = (columns_ref[row, k], g_ref[row, k].astype(jnp.float32))
        return (*unit, u_ref[row, k]) if gated else unit

    def step(k, carry):
        d1, d2, (j, g, *u) = carry
        # The next entry's unit is loaded before this entry's w_down row, which depends on it.
        upcoming = fetch(k + 1)
        prod = dy_chunks[0] * w_down_ref[j, chunks[0]].astype(jnp.float32)
        for c in range(1, num_chunks):
            prod = prod + dy_chunks[c] * w_down_ref[j, chunks[c]].astype(jnp.float32)
        dh = jnp.sum(prod)
        if gated:
            (u,) = u
            dh = dh + l1 * jnp.sign(g * u)
            return (jnp.where(slot == k, dh * g, d1), jnp.where(slot == k, dh * u, d2),
                    upcoming)
        return jnp.where(slot == k, dh + l1 * jnp.sign(g), d1), d2, upcoming

    zero_slots = jnp.zeros((width,), jnp.float32)
    d1, d2, _ = jax.lax.fori_loop(0, nnz, step, (zero_slots, zero_slots, fetch(0)))
    d1_ref[row, :] = d1  # 0 past row_nnz
    if gated:
        d2_ref[row, :] = d2


def _dx_kernel(*refs, block_d: int, num_chunks: int, num_slots: int, gated: bool):
    """One program: row ``program_id(0)``, dx from the entries' gradients. Refs: w_up_t
    [F, D], [w_gate_t [F, D]], d1 [M, width], [d2 [M, width]], columns [M, K], row_nnz [M];
    output dx [M, D]."""
    if gated:
        w_up_ref, w_gate_ref, d1_ref, d2_ref, columns_ref, nnz_ref, dx_ref = refs
    else:
        w_up_ref, d1_ref, columns_ref, nnz_ref, dx_ref = refs
    row = pl.program_id(0)
    nnz = jnp.clip(nnz_ref[row], 0, num_slots)
    chunks = [pl.ds(c * block_d, block_d) for c in range(num_chunks)]

    def fetch(k):
        """Entry k's unit and gradients (k clamped into the lists: past row_nnz unused)."""
        k = jnp.minimum(k, num_slots - 1)
        unit = (columns_ref[row, k], d1_ref[row, k])
        return (*unit, d2_ref[row, k]) if gated else unit

    def step(k, carry):
        accs, (j, d1, *d2) = carry
        # The next entry's unit is loaded before this entry's weight rows, which depend on it.
        upcoming = fetch(k + 1)
        if gated:
            (d2,) = d2
            return tuple(acc + d1 * w_up_ref[j, ch].astype(jnp.float32)
                         + d2 * w_gate_ref[j, ch].astype(jnp.float32)
                         for acc, ch in zip(accs, chunks)), upcoming
        return tuple(acc + d1 * w_up_ref[j, ch].astype(jnp.float32)
                     for acc, ch in zip(accs, chunks)), upcoming

    zeros = tuple(jnp.zeros((block_d,), jnp.float32) for _ in chunks)
    accs, _ = jax.lax.fori_loop(0, nnz, step, (zeros, fetch(0)))
    for acc, ch in zip(accs, chunks):
        dx_ref[row, ch] = acc.astype(dx_ref.dtype)


def _check_weights(f: int, d: int, **weights) -> None:
    for name, w in weights.items():
        if w is not None and w.shape != (f, d):
            raise ValueError(f"{name} has shape {w.shape}, expected ({f}, {d})")


def _check_lists(m: int, columns, row_nnz, **per_entry) -> int:
    """Checks columns [M, K] int32, row_nnz [M] int32 and the [M, K] arrays ``per_entry``
    (None: absent); returns K."""
    if columns.ndim != 2 or columns.shape[0] != m:
        raise ValueError(f"columns has shape {columns.shape}, expected ({m}, K)")
    for name, a in per_entry.items():
        if a is not None and a.shape != columns.shape:
            raise ValueError(f"{name} has shape {a.shape}, expected {columns.shape} (columns')")
    if row_nnz.shape != (m,):
        raise ValueError(f"row_nnz has shape {row_nnz.shape}, expected ({m},)")
    if columns.dtype != jnp.int32 or row_nnz.dtype != jnp.int32:
        raise ValueError(f"columns and row_nnz must be int32, got {columns.dtype} and "
                         f"{row_nnz.dtype}")
    return columns.shape[1]


def _kernel_params(m: int, d: int, k: int, gated: bool, config: RowUpDownConfig | None,
                   interpret: bool | None) -> tuple[dict, dict]:
    """(static sizes, pallas_call keywords) shared by the two kernels."""
    config = default_row_up_down_config(d) if config is None else config
    if d % config.block_d:
        raise ValueError(f"D={d} is not a multiple of block_d={config.block_d}")
    sizes = dict(block_d=config.block_d, num_chunks=d // config.block_d, num_slots=k,
                 gated=gated)
    params = dict(grid=(m,), interpret=resolve_interpret(interpret),
                  compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                                       num_stages=config.num_stages))
    return sizes, params


def row_entry_grads(
    dy: jax.Array,
    w_down: jax.Array,
    gate_values: jax.Array,
    up_values: jax.Array | None,
    columns: jax.Array,
    row_nnz: jax.Array,
    l1: jax.Array,
    *,
    config: RowUpDownConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The per-entry gradients, the first of :func:`row_backward`'s two kernels.

    Args as :func:`row_backward` (``up_values`` given: the gated form). Returns ``(du or dh
    [M, K] float32, dg [M, K] float32 or None)``, 0 past each row's count.
    """
    gated = up_values is not None
    m, d = dy.shape
    _check_weights(w_down.shape[0], d, w_down=w_down)
    k = _check_lists(m, columns, row_nnz, gate_values=gate_values, up_values=up_values)
    sizes, params = _kernel_params(m, d, k, gated, config, interpret)
    width = next_pow2(max(k, 1))
    slots = jax.ShapeDtypeStruct((m, width), jnp.float32)
    l1 = jnp.reshape(jnp.asarray(l1, jnp.float32), (1,))
    grads = pl.pallas_call(
        functools.partial(_entry_grads_kernel, width=width, **sizes),
        out_shape=(slots, slots) if gated else (slots,),
        name="twell_row_backward", **params,
    )(*((dy, w_down, gate_values, up_values) if gated else (dy, w_down, gate_values)),
      columns, row_nnz, l1)
    return grads[0][:, :k], (grads[1][:, :k] if gated else None)


def row_dx(
    w_up_t: jax.Array,
    w_gate_t: jax.Array | None,
    d1: jax.Array,
    d2: jax.Array | None,
    columns: jax.Array,
    row_nnz: jax.Array,
    *,
    dx_dtype=jnp.float32,
    config: RowUpDownConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """dx [M, D] dx_dtype from the per-entry gradients, the second of :func:`row_backward`'s
    kernels: ``dx[m] = sum_k d1[m, k] * w_up_t[j] (+ d2[m, k] * w_gate_t[j])``, j =
    columns[m, k], over each row's first row_nnz entries, in float32, rounded once.

    Args: w_up_t, w_gate_t (gated) [F, D]; d1 (du, or dh non-gated) and d2 (dg, gated) [M, K]
    float32 as :func:`row_entry_grads` returns them; columns, row_nnz as there.
    """
    gated = w_gate_t is not None
    if (d2 is None) == gated:
        raise ValueError("the gated form takes both w_gate_t and d2, the non-gated form neither")
    f, d = w_up_t.shape
    _check_weights(f, d, w_gate_t=w_gate_t)
    m = d1.shape[0]
    k = _check_lists(m, columns, row_nnz, d1=d1, d2=d2)
    sizes, params = _kernel_params(m, d, k, gated, config, interpret)
    return pl.pallas_call(
        functools.partial(_dx_kernel, **sizes),
        out_shape=jax.ShapeDtypeStruct((m, d), dx_dtype),
        name="twell_row_backward_dx", **params,
    )(*((w_up_t, w_gate_t) if gated else (w_up_t,)), d1, *((d2,) if gated else ()), columns,
      row_nnz)


def row_backward(
    dy: jax.Array,
    w_down: jax.Array,
    w_up_t: jax.Array,
    w_gate_t: jax.Array | None,
    gate_values: jax.Array,
    up_values: jax.Array | None,
    columns: jax.Array,
    row_nnz: jax.Array,
    l1: jax.Array,
    *,
    dx_dtype=jnp.float32,
    config: RowUpDownConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Per-row backward of the gated (w_gate_t, up_values given) or non-gated FFN: the two
    kernels, :func:`row_entry_grads` then :func:`row_dx`.

    Args:
      dy: [M, D] output cotangent. w_down, w_up_t, w_gate_t: [F, D] (feature-major).
      gate_values: [M, K] g (gated) or h (non-gated); up_values: [M, K] float32 u, or None.
      columns: [M, K] int32; row_nnz: [M] int32 (entries past it never used; the slot after a
        row's last entry may be loaded, within K).
      l1: [] float32, the L1 term's coefficient on sign(h) per entry.
      dx_dtype: dx's dtype: its float32 row sums are rounded to it once, in the kernel (x's
        dtype saves the FFN backward a float32 [M, D] write and a cast pass over it).
      config: ``RowUpDownConfig`` (its knobs mean the same here; block_d must divide D).
    Returns:
      ``(dx [M, D] dx_dtype, du or dh [M, K] float32, dg [M, K] float32 or None)``, 0 past
      each row's count.
    """
    if (w_gate_t is None) != (up_values is None):
        raise ValueError("the gated form takes both w_gate_t and up_values, the non-gated "
                         "form neither")
    _check_weights(w_down.shape[0], dy.shape[1], w_down=w_down, w_up_t=w_up_t,
                   w_gate_t=w_gate_t)
    d1, d2 = row_entry_grads(dy, w_down, gate_values, up_values, columns, row_nnz, l1,
                             config=config, interpret=interpret)
    dx = row_dx(w_up_t, w_gate_t, d1, d2, columns, row_nnz, dx_dtype=dx_dtype, config=config,
                interpret=interpret)
    return dx, d1, d2


def row_backward_reference(dy, w_down, w_up_t, w_gate_t, gate_values, up_values, columns,
                           row_nnz, l1, *, dx_dtype=jnp.float32):
    """Plain-jnp :func:`row_backward` (same arguments and outputs), one slot at a time."""
    gated = w_gate_t is not None
    m, d = dy.shape
    _check_weights(w_down.shape[0], d, w_down=w_down, w_up_t=w_up_t, w_gate_t=w_gate_t)
    k = _check_lists(m, columns, row_nnz, gate_values=gate_values, up_values=up_values)
    nnz = jnp.clip(row_nnz, 0, k)
    f32 = lambda a: a.astype(jnp.float32)
    l1 = jnp.asarray(l1, jnp.float32)

    def step(kk, carry):
        dx, d1, d2 = carry
        valid = kk < nnz
        j = jnp.where(valid, columns[:, kk], 0)
        g = jnp.where(valid, f32(gate_values[:, kk]), 0.0)
        dh = jnp.sum(f32(dy) * f32(w_down[j]), axis=1)
        if gated:
            u = jnp.where(valid, up_values[:, kk], 0.0)
            dh = jnp.where(valid, dh + l1 * jnp.sign(g * u), 0.0)
            du, dg = dh * g, dh * u
            dx = dx + du[:, None] * f32(w_up_t[j]) + dg[:, None] * f32(w_gate_t[j])
            return dx, d1.at[:, kk].set(du), d2.at[:, kk].set(dg)
        dh = jnp.where(valid, dh + l1 * jnp.sign(g), 0.0)
        return dx + dh[:, None] * f32(w_up_t[j]), d1.at[:, kk].set(dh), d2

    zeros = jnp.zeros((m, k), jnp.float32)
    init = (jnp.zeros((m, d), jnp.float32), zeros, zeros)
    dx, d1, d2 = jax.lax.fori_loop(0, jnp.max(nnz, initial=0), step, init)
    return dx.astype(dx_dtype), d1, (d2 if gated else None)

"""The TwELL + dense-backup (hybrid) format, in plain jnp.

Layout, for a hidden activation ``h`` of shape [M, F] with ``T = tile_width``,
``S = slots_per_tile`` and ``n_tiles = ceil(F / T)`` (F padded with inactive columns):

- ``values``  [M, n_tiles, S]: the non-zeros of each (row, tile), in ascending column order.
- ``columns`` [M, n_tiles, S] int32: their global column in [0, F).
- ``counts``  [M, n_tiles] int32: the *true* number of non-zeros of the (row, tile); it may
  exceed S, and then only the first S are stored. Slots ``s >= min(count, S)`` hold value 0
  and column 0; consumers mask them by the count, never by the value.
- A row is *heavy* if any of its counts exceeds S, or if it has more than
  ``config.max_row_nnz(F)`` non-zeros in all (such rows are cheaper dense). Heavy rows are kept whole in the dense
  backup: ``backup_index`` [B] int32 (heavy rows in ascending order, padded with M) and
  ``backup_values`` [B, F]. ``num_heavy`` is the true number of heavy rows; if it exceeds the
  capacity B the backup has *overflowed* (the FFN ops then take the exact dense path).

Slot order is fixed by the column order, so packing is deterministic.

For the up/down products the per-tile slots are *row-compacted* (``row_compact``): each row's
stored entries, in column order, moved to the front of a [M, K] list (K = n_tiles * S) with
``row_nnz`` [M] valid entries, so a kernel loops over a row's real entries only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from twell_jax.config import DEFAULT_CONFIG, TwELLConfig


def pack_tiles(h: jax.Array, tile_width: int, slots_per_tile: int):
    """Packs each (row, tile) of ``h`` [M, F] into slots (plain jnp, any F).

    Returns ``(values [M, n_tiles, S] h.dtype, columns [M, n_tiles, S] int32,
    counts [M, n_tiles] int32)`` as described in the module docstring.
    """
    m, f = h.shape
    n_tiles = -(-f // tile_width)
    padded = jnp.pad(h, ((0, 0), (0, n_tiles * tile_width - f)))
    tiles = padded.reshape(m, n_tiles, tile_width)
    active = tiles != 0  # NaN counts as active: it is a non-zero value
    counts = active.sum(axis=-1, dtype=jnp.int32)
    # A stable sort of "inactive" puts the active positions first, in ascending column order.
    order = jnp.argsort(~active, axis=-1, stable=True)[..., :slots_per_tile]
    slot = jnp.arange(slots_per_tile, dtype=jnp.int32)
    valid = slot < counts[..., None]
    values = jnp.where(valid, jnp.take_along_axis(tiles, order, axis=-1), 0).astype(h.dtype)
    tile_start = (jnp.arange(n_tiles, dtype=jnp.int32) * tile_width)[None, :, None]
    columns = jnp.where(valid, tile_start + order.astype(jnp.int32), 0)
    return values, columns, counts


def row_compact(values: jax.Array, columns: jax.Array, counts: jax.Array, slots_per_tile: int):
    """Per-tile slots -> one list per row (the form the up/down kernels consume), in plain jnp.

    Args:
      values, columns: [M, n_tiles, S]; counts: [M, n_tiles] (true counts, may exceed S).
    Returns:
      ``(values [M, K], columns [M, K] int32, row_nnz [M] int32)`` with K = n_tiles * S; each
      row's stored entries in column order at the front, zeros after.
    """
    m, num_tiles, s = values.shape
    k = num_tiles * s
    kept = jnp.minimum(counts, slots_per_tile)
    start = jnp.cumsum(kept, axis=1) - kept  # exclusive prefix over tiles
    slot = jnp.arange(s, dtype=jnp.int32)
    dest = jnp.where(slot < kept[..., None], start[..., None] + slot, k)  # k = dropped
    row = jnp.broadcast_to(jnp.arange(m)[:, None, None], dest.shape)
    out_values = jnp.zeros((m, k), values.dtype).at[row, dest].set(values, mode="drop")
    out_columns = jnp.zeros((m, k), jnp.int32).at[row, dest].set(columns, mode="drop")
    return out_values, out_columns, kept.sum(axis=1, dtype=jnp.int32)


def heavy_rows(counts: jax.Array, config: TwELLConfig, d_ff: int) -> jax.Array:
    """[M] bool: rows with more than S non-zeros in some tile, or too many in all."""
    over_tile = jnp.any(counts > config.slots_per_tile, axis=-1)
    return over_tile | (counts.sum(axis=-1) > config.max_row_nnz(d_ff))


SAMPLE_ROWS = 256
"""Rows of a batch's pre-activation read to decide, before packing, that it goes dense."""


def sampled_active(pre: jax.Array, sample_rows: int = SAMPLE_ROWS) -> jax.Array:
    """[R, F'] bool: the active units (> 0 or NaN) of every (M / sample_rows)-th row of
    ``pre`` [M, F'] (padded columns never positive)."""
    stride = max(1, pre.shape[0] // sample_rows)
    return jnp.logical_not(pre[::stride] <= 0)


def sampled_row_counts(pre: jax.Array, sample_rows: int = SAMPLE_ROWS,
                       exclude: jax.Array | None = None) -> jax.Array:
    """[R] int32: active units in every (M / sample_rows)-th row of ``pre`` [M, F'], not
    counting the ``exclude`` [F'] bool columns (the hot units, which leave the lists)."""
    active = sampled_active(pre, sample_rows)
    if exclude is not None:
        active = active & ~exclude[None, :]
    return jnp.sum(active, axis=1, dtype=jnp.int32)


def mostly_heavy(pre: jax.Array, config: TwELLConfig, d_ff: int, sample_rows: int = SAMPLE_ROWS,
                 share: float = 0.75, exclude: jax.Array | None = None) -> jax.Array:
    """[] bool: more than ``share`` of a sample of rows of the pre-activation ``pre`` [M, F']
    (F' >= d_ff, padded columns never positive) hold more active units than a light row may
    (``config.max_row_nnz``): the batch will go dense (past half its rows heavy), so there is
    no point in listing it. Every (M / sample_rows)-th row is read; the tile limit is not
    checked, so the heavy share is never overestimated. ``exclude``: as
    ``sampled_row_counts``'."""
    active = sampled_row_counts(pre, sample_rows, exclude)
    return jnp.mean((active > config.max_row_nnz(d_ff)).astype(jnp.float32)) > share


def sampled_cost_says_dense(pre: jax.Array, config: TwELLConfig, d_ff: int, d_model: int,
                            itemsize: int, margin: float = 1.25,
                            sample_rows: int = SAMPLE_ROWS,
                            exclude: jax.Array | None = None) -> jax.Array:
    """[] bool: the cost model (``config.cost_model``), given the light rows' entries and the
    heavy rows (by the row cap) of a sample of rows scaled to the batch, puts the sparse
    up/down above ``margin`` x the dense GEMMs'. Such a batch goes dense without being listed
    (its exact counts would only confirm it): the pack's pass over ``pre`` is saved. The margin
    leaves the close calls to the exact counts. ``exclude``: as ``sampled_row_counts``'."""
    m = pre.shape[0]
    active = sampled_row_counts(pre, sample_rows, exclude)
    heavy = active > config.max_row_nnz(d_ff)
    scale = m / active.shape[0]
    light_nnz = scale * jnp.sum(jnp.where(heavy, 0, active).astype(jnp.float32))
    num_heavy = scale * jnp.sum(heavy.astype(jnp.float32))
    return config.cost_model.sparse_costs_more(m, d_model, d_ff, light_nnz, num_heavy, itemsize,
                                               margin)


def heavy_row_index(heavy: jax.Array, capacity: int) -> jax.Array:
    """[capacity] int32: the first ``capacity`` heavy rows in ascending order, padded with M."""
    m = heavy.shape[0]
    (index,) = jnp.nonzero(heavy, size=capacity, fill_value=m)
    return index.astype(jnp.int32)


def _as_words(a: jax.Array) -> jax.Array:
    """[M, D] of a 1- or 2-byte dtype -> the same bytes as [M, W] uint32 (W = D * itemsize /
    4) where a row's bytes split into 32-bit words, else ``a`` itself. XLA's GPU gather moves
    one element per thread: on 16-bit rows the backup's gathers ran at 0.4-1.1 TB/s on the
    H100."""
    m, d = a.shape
    itemsize = jnp.dtype(a.dtype).itemsize
    if itemsize >= 4 or (d * itemsize) % 4:  # already words, or rows that do not split
        return a
    per_word = 4 // itemsize
    return jax.lax.bitcast_convert_type(a.reshape(m, d // per_word, per_word), jnp.uint32)


def _from_words(words: jax.Array, like: jax.Array) -> jax.Array:
    """Inverse of ``_as_words`` for rows of ``like``'s dtype and width: [R, W] -> [R, D]."""
    if words.dtype == like.dtype:
        return words
    rows = jax.lax.bitcast_convert_type(words, like.dtype)
    return rows.reshape(words.shape[0], like.shape[1])


def take_rows(a: jax.Array, index: jax.Array) -> jax.Array:
    """``a[index]`` for ``a`` [M, D] and ``index`` [R] int32 ascending (``heavy_row_index``):
    [R, D], zero rows where ``index >= M`` (the padding). Same bits as ``jnp.take``; the rows
    move as 32-bit words (``_as_words``)."""
    words = jnp.take(_as_words(a), index, axis=0, mode="fill", fill_value=0,
                     indices_are_sorted=True)
    return _from_words(words, a)


def set_rows(a: jax.Array, index: jax.Array, rows: jax.Array) -> jax.Array:
    """``a`` [M, D] with rows ``index`` [R] (ascending, unique below M, padded with values
    >= M: ``heavy_row_index``) replaced by ``rows`` [R, D] (cast to a.dtype); padding rows are
    dropped. The indices are made unique (the padding spread over distinct out-of-range
    values) and declared so, which lets XLA write the rows with plain stores (a scatter whose
    indices may repeat updates each element atomically).

    Unlike ``take_rows`` the rows are written in a.dtype, not as 32-bit words: the scatter
    updates ``a`` in place, and a word view of ``a`` was a conversion pass over all of it each
    way on the CPU compiler (and, while dx passed through the backward's switch, a copy of it:
    ``test_ffn``'s copy test)."""
    m, r = a.shape[0], index.shape[0]
    unique = jnp.where(index < m, index, m + jnp.arange(r, dtype=index.dtype))
    return a.at[unique].set(rows.astype(a.dtype), mode="drop", unique_indices=True,
                            indices_are_sorted=True)


def tiles_to_dense(values: jax.Array, columns: jax.Array, counts: jax.Array, d_ff: int) -> jax.Array:
    """Scatters the stored slots back to a dense [M, d_ff] array (heavy rows incomplete)."""
    m, n_tiles, s = values.shape
    valid = jnp.arange(s) < jnp.minimum(counts, s)[..., None]
    dest = jnp.where(valid, columns, d_ff)  # d_ff = dropped
    rows = jnp.broadcast_to(jnp.arange(m)[:, None, None], dest.shape)
    return jnp.zeros((m, d_ff), values.dtype).at[rows, dest].set(values, mode="drop")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class TwELL:
    """A hidden activation [M, F] in TwELL + dense-backup form (see the module docstring)."""

    values: jax.Array  # [M, n_tiles, S]
    columns: jax.Array  # [M, n_tiles, S] int32
    counts: jax.Array  # [M, n_tiles] int32
    backup_index: jax.Array  # [B] int32, padded with M
    backup_values: jax.Array  # [B, F]
    num_heavy: jax.Array  # [] int32
    d_ff: int
    config: TwELLConfig

    def tree_flatten(self):
        children = (self.values, self.columns, self.counts, self.backup_index,
                    self.backup_values, self.num_heavy)
        return children, (self.d_ff, self.config)

    @classmethod
    def tree_unflatten(cls, aux: Any, children):
        return cls(*children, *aux)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.d_ff)

    @property
    def overflowed(self) -> jax.Array:
        """[] bool: more rows are heavy than the backup holds (``to_dense`` is then inexact)."""
        return self.num_heavy > self.backup_index.shape[0]

    def heavy(self) -> jax.Array:
        """[M] bool: which rows are heavy."""
        return heavy_rows(self.counts, self.config, self.d_ff)

    def to_dense(self) -> jax.Array:
        """[M, F]: h exactly, whenever the backup did not overflow."""
        dense = tiles_to_dense(self.values, self.columns, self.counts, self.d_ff)
        return dense.at[self.backup_index].set(self.backup_values, mode="drop")


def pack(h: jax.Array, config: TwELLConfig | None = None) -> TwELL:
    """Packs a dense hidden activation ``h`` [M, F] into TwELL + dense backup.

    The backup holds ``config.backup_rows`` rows (all M rows when ``None``, so the round trip
    ``pack(h).to_dense() == h`` is exact for every h). Works under ``jit``.
    """
    config = DEFAULT_CONFIG if config is None else config
    if h.ndim != 2:
        raise ValueError(f"pack expects h of shape [M, F], got shape {h.shape}")
    m, f = h.shape
    values, columns, counts = pack_tiles(h, config.tile_width, config.slots_per_tile)
    heavy = heavy_rows(counts, config, f)
    capacity = m if config.backup_rows is None else min(config.backup_rows, m)
    index = heavy_row_index(heavy, capacity)
    backup_values = jnp.take(h, index, axis=0, mode="fill", fill_value=0)
    num_heavy = heavy.sum(dtype=jnp.int32)
    return TwELL(values, columns, counts, index, backup_values, num_heavy, f, config)


def valid_entries(row_nnz: jax.Array, k: int) -> jax.Array:
    """[M, k] bool: entry j of row m's list is one of its first ``row_nnz[m]`` (``row_nnz`` [M])."""
    return jnp.arange(k, dtype=jnp.int32)[None, :] < row_nnz[:, None]


def mask_lists(values: jax.Array, columns: jax.Array, row_nnz: jax.Array):
    """Row lists with the entries past each row's count zeroed (value 0, column 0).

    values, columns: [M, K]; row_nnz: [M] (at most K). Returns ``(values, columns)``."""
    valid = valid_entries(row_nnz, values.shape[1])
    return jnp.where(valid, values, 0), jnp.where(valid, columns, 0)


def column_sums(values: jax.Array, columns: jax.Array, row_nnz: jax.Array, d_ff: int) -> jax.Array:
    """[d_ff] float32: each column's sum of the list entries ``values`` [M, K] (first
    ``row_nnz[m]`` of row m) that sit in it."""
    valid = valid_entries(row_nnz, columns.shape[1])
    dest = jnp.where(valid, columns, d_ff)  # d_ff = dropped
    return jnp.zeros((d_ff,), jnp.float32).at[dest].add(jnp.where(valid, values, 0.0),
                                                         mode="drop")

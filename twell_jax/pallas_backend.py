"""The ``"pallas"`` backend: the TwELL building blocks on Pallas kernels.

The kernels want block-divisible shapes; this module pads (rows with zeros, which are never
active; D with zero features, which change no dot product; F with zero gate columns, which are
never active) and slices the results back, so callers can pass any M, D, F. Without a GPU the
kernels run in interpret mode (``pallas_kernels.common.resolve_interpret``).

How each stage runs is chosen by ``PallasOptions`` (defaults from the H100 measurements in
BENCHMARKS.md; ``use_options`` switches them for benchmarks). The backward's sampled product
(dh) and dx products run on the ``sampled_dot`` / ``sparse_down`` kernels, the transposed
products (dW = h^T @ dy, (dg, du)^T @ x) on ``sparse_outer`` over a column-sorted view of the
pattern ("sorted"), or as one dense GEMM on the packed values scattered into an [M, F] matrix
inside the backward ("densified"). Nothing dense is saved for the backward either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels.gate_pack import gate_pack
from pallas_kernels.gated_up_down import gated_up_down
from pallas_kernels.pack_rows import pack_rows
from pallas_kernels.sampled_dot import sampled_dot
from pallas_kernels.sparse_down import sparse_down
from pallas_kernels.sparse_outer import sparse_outer, sparse_outer_atomic
from twell_jax.backends import Backend
from twell_jax.config import TwELLConfig
from twell_jax.format import row_compact

_ROW_MULTIPLE_SMALL = 16  # the tensor-core dot's minimum block
_ROW_MULTIPLE = 64  # the gate GEMM's default block_m
_D_BLOCK_MAX = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasOptions:
    """Which kernels the "pallas" backend runs.

    Attributes:
      pack: "two_stage" (XLA's GEMM writes the dense gate, ``pack_rows`` packs it straight into
        row lists; the dense fallback reuses the gate) or "fused" (``gate_pack``: GEMM + packing
        epilogue, the dense gate never stored, then an XLA row compaction). Two-stage is the
        default: on the H100 it took 0.82-0.90 ms against 1.12-1.27 ms (+0.16 ms compaction)
        for the fused kernel at M = 16384, D = 2048, F = 5632 (XLA's GEMM alone: 0.57-0.63 ms).
      up_down: "split" (``sampled_dot`` for u, then ``sparse_down`` of h = g * u: 0.68 + 0.37
        ms at 28 active units per token) or "fused" (the single ``gated_up_down`` kernel:
        1.30-1.40 ms). Full FFN, run 5: split 2.19 ms, fused 2.40 ms.
      outer: the backward's transposed products (dW): "sorted" (``sparse_outer``: entries
        sorted by column on the device, then a gather of b rows per unit; reads b once per
        entry), "atomic" (``sparse_outer_atomic``: fp32 atomic adds, no sort, summation order
        not fixed) or "densified" (the packed values scattered into a dense [M, F] matrix, one
        dense GEMM per product). FFN forward + backward at M = 16384, 28 active per token
        (BENCHMARKS.md run 7): sorted 4.80 ms, densified 5.31 ms.
    """

    pack: Literal["fused", "two_stage"] = "two_stage"
    up_down: Literal["split", "fused"] = "split"
    outer: Literal["sorted", "atomic", "densified"] = "sorted"

    def __post_init__(self):
        if self.pack not in ("fused", "two_stage"):
            raise ValueError(f"pack must be 'fused' or 'two_stage', got {self.pack!r}")
        if self.up_down not in ("split", "fused"):
            raise ValueError(f"up_down must be 'split' or 'fused', got {self.up_down!r}")
        if self.outer not in ("sorted", "atomic", "densified"):
            raise ValueError(f"outer must be 'sorted', 'atomic' or 'densified', got "
                             f"{self.outer!r}")


OPTIONS = PallasOptions()


@contextlib.contextmanager
def use_options(options: PallasOptions):
    """Runs the "pallas" backend with ``options`` inside the block (functions traced there
    keep them). For benchmarks and tests; not thread-safe."""
    global OPTIONS
    saved, OPTIONS = OPTIONS, options
    try:
        yield
    finally:
        OPTIONS = saved


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _padded_rows(m: int) -> int:
    return _round_up(m, _ROW_MULTIPLE if m >= _ROW_MULTIPLE else _ROW_MULTIPLE_SMALL)


def _padded_features(d: int) -> int:
    """D padded so a power-of-two chunk (<= 512, >= 16) divides it."""
    chunk = min(_D_BLOCK_MAX, max(16, 1 << (d - 1).bit_length()))
    return _round_up(d, chunk)


def _pad(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if a.shape == shape:
        return a
    return jnp.pad(a, [(0, n - s) for s, n in zip(a.shape, shape)])


def _pack(x: jax.Array, w: jax.Array, bias: jax.Array | None, config: TwELLConfig):
    m, d = x.shape
    f = w.shape[1]
    m_pad, d_pad = _padded_rows(m), _padded_features(d)
    f_pad = config.num_tiles(f) * config.tile_width
    tiles = dict(tile_width=config.tile_width, slots_per_tile=config.slots_per_tile)
    if OPTIONS.pack == "two_stage":
        pre = jnp.dot(_pad(x, (m_pad, d)), _pad(w, (d, f_pad)), preferred_element_type=jnp.float32)
        if bias is not None:  # padded columns get bias 0: never active
            pre = pre + _pad(bias.astype(jnp.float32), (f_pad,))
        gate = jax.nn.relu(pre).astype(x.dtype)
        values, columns, counts, row_nnz = pack_rows(gate, **tiles)
        return values[:m], columns[:m], counts[:m], row_nnz[:m], gate[:m, :f]
    bias = None if bias is None else _pad(bias.astype(jnp.float32), (f_pad,))
    values, columns, counts = gate_pack(_pad(x, (m_pad, d_pad)), _pad(w, (d_pad, f_pad)), bias,
                                        **tiles)
    values, columns, row_nnz = row_compact(values[:m], columns[:m], counts[:m],
                                           config.slots_per_tile)
    return values, columns, counts[:m], row_nnz, None


def _pad_lists(m_pad, *arrays):
    return [_pad(a, (m_pad,) + a.shape[1:]) for a in arrays]


def _gated_up_down(x, w_up_t, w_down, gate_values, columns, row_nnz):
    m, d = x.shape
    f = w_up_t.shape[0]
    if OPTIONS.up_down == "split":
        up_values = _sampled_dot(x, w_up_t, columns, row_nnz)
        hidden = gate_values.astype(jnp.float32) * up_values
        return _sparse_dot(hidden, columns, row_nnz, w_down), up_values
    m_pad, d_pad = _padded_rows(m), _padded_features(d)
    gate_values, columns, row_nnz = _pad_lists(m_pad, gate_values, columns, row_nnz)
    y, up_values = gated_up_down(
        _pad(x, (m_pad, d_pad)), _pad(w_up_t, (f, d_pad)), _pad(w_down, (f, d_pad)),
        gate_values, columns, row_nnz, return_up=True,  # u feeds the L1 statistic and backward
    )
    return y[:m, :d], up_values[:m]


def _sampled_dot(a, w, columns, row_nnz):
    m, d = a.shape
    f = w.shape[0]
    m_pad, d_pad = _padded_rows(m), _padded_features(d)
    columns, row_nnz = _pad_lists(m_pad, columns, row_nnz)
    out = sampled_dot(_pad(a, (m_pad, d_pad)), _pad(w, (f, d_pad)), columns, row_nnz)
    return out[:m]


def _sparse_dot(values, columns, row_nnz, w):
    m = values.shape[0]
    f, d = w.shape
    m_pad, d_pad = _padded_rows(m), _padded_features(d)
    values, columns, row_nnz = _pad_lists(m_pad, values, columns, row_nnz)
    y = sparse_down(values, columns, row_nnz, _pad(w, (f, d_pad)), out_dtype=jnp.float32)
    return y[:m, :d]


def _densified_outer(values, columns, row_nnz, b, d_ff):
    m, k = columns.shape
    valid = jnp.arange(k, dtype=jnp.int32)[None, :] < row_nnz[:, None]
    dest = jnp.where(valid, columns, d_ff)  # d_ff = dropped
    rows = jnp.broadcast_to(jnp.arange(m)[:, None], dest.shape)

    def one(v):
        # The scattered matrix takes b's dtype (bf16 in training): the GEMM runs on tensor cores.
        dense = jnp.zeros((m, d_ff), b.dtype).at[rows, dest].set(v.astype(b.dtype), mode="drop")
        return jnp.dot(dense.T, b, preferred_element_type=jnp.float32)

    return tuple(one(v) for v in values)


def _sparse_outer(values, columns, row_nnz, b, d_ff):
    if OPTIONS.outer == "densified":
        return _densified_outer(values, columns, row_nnz, b, d_ff)
    m, d = b.shape
    d_pad = _padded_features(d)
    if OPTIONS.outer == "atomic":
        m_pad = _padded_rows(m)
        columns, row_nnz, *values = _pad_lists(m_pad, columns, row_nnz, *values)
        out = sparse_outer_atomic(tuple(values), columns, row_nnz, _pad(b, (m_pad, d_pad)), d_ff,
                                  block_d=min(256, d_pad))
    else:
        out = sparse_outer(tuple(values), columns, row_nnz, _pad(b, (m, d_pad)), d_ff)
    return tuple(o[:, :d] for o in out)


BACKEND = Backend(
    pack=_pack,
    gated_up_down=_gated_up_down,
    sparse_dot=_sparse_dot,
    sampled_dot=_sampled_dot,
    sparse_outer=_sparse_outer,
)

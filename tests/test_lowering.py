"""Every kernel lowers to Triton IR for the GPU, on this CPU-only machine.

``jax.export(..., platforms=["cuda"])`` runs the Pallas Triton lowering (jaxpr -> Triton MLIR),
which catches primitives and indexing forms the Triton backend does not support. Two things
are needed without a GPU:

* a target: the lowering asks the device for its compute capability; an abstract mesh naming an
  H100 (``jax.sharding.AbstractDevice``) answers instead (otherwise: "No supported GPU devices
  found, please specify an abstract GPU device using AbstractDevice");
* the Triton custom call has no export compatibility guarantee, so its safety check is disabled
  for that one target.

Not covered here: the Triton compiler itself (Triton IR -> PTX runs inside XLA at compile time on
the GPU), so shared-memory or register limits only show on the device.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.add_product import add_product
from pallas_kernels.add_rms_norm import add_rms_norm
from pallas_kernels.decode_attention import DecodeAttentionConfig, decode_attention
from pallas_kernels.gemv import (GemvConfig, gemv, gemv_many, gemv_many_partial_sums,
                                 gemv_partial_sums)
from pallas_kernels.qkv_rope_cache import qkv_rope_cache
from pallas_kernels.row_pack import row_pack
from pallas_kernels.row_up_down import RowUpDownConfig, row_up_down
from pallas_kernels.row_backward import row_backward
from pallas_kernels.scan_up_down import GatePartials, ScanUpDownConfig, scan_up_down
from pallas_kernels.sparse_outer import sparse_outer

M, D, F, K = 256, 256, 512, 32
BF16 = jnp.bfloat16
S = jax.ShapeDtypeStruct

_H100 = jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"
)


def export_for_cuda(fn, *args) -> str:
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=_H100
    )
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)
            ],
        )(*args)
    return exported.mlir_module()


@pytest.mark.parametrize("dtype", [BF16, jnp.float32], ids=["bf16", "f32"])
def test_row_pack_lowers(dtype):
    # With the device-side skip flag (a batch routed dense before listing).
    module = export_for_cuda(
        lambda pre, skip: row_pack(pre, tile_width=128, num_slots=88, interpret=False,
                                   skip=skip),
        S((M, F), dtype), S((), jnp.bool_))
    assert "twell_row_pack" in module
    assert plgpu.CUSTOM_CALL_TARGET_NAME in module


def test_row_pack_with_excluded_columns_lowers():
    module = export_for_cuda(
        lambda pre, exclude: row_pack(pre, tile_width=128, num_slots=88, interpret=False,
                                      exclude=exclude),
        S((M, F), BF16), S((F,), jnp.bool_))
    assert "twell_row_pack" in module


@pytest.mark.parametrize("k, dtype", [(64, BF16), (128, BF16), (64, jnp.float32)])
def test_add_product_lowers(k, dtype):
    module = export_for_cuda(
        lambda y, h, w, run: add_product(y, h, w, run, interpret=False),
        S((M, D), dtype), S((M, k), dtype), S((k, D), dtype), S((), jnp.bool_))
    assert "twell_add_product" in module


@pytest.mark.parametrize("config", [None, RowUpDownConfig(block_d=128, num_warps=2, num_stages=2),
                                    RowUpDownConfig(block_d=64)])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_row_up_down_lowers(gated, config):
    lists = (S((F, D), BF16), S((M, K), BF16), S((M, K), jnp.int32), S((M,), jnp.int32))
    if gated:
        fn = lambda *a: row_up_down(*a, config=config, interpret=False)
        module = export_for_cuda(fn, S((M, D), BF16), S((F, D), BF16), *lists)
        # x with the folded gate bias's column (64 more columns), as the FFN hands it over.
        wide = export_for_cuda(fn, S((M, D + 64), BF16), S((F, D), BF16), *lists)
        assert "twell_row_up_down" in wide
    else:
        fn = lambda *a: row_up_down(None, None, *a, config=config, interpret=False)
        module = export_for_cuda(fn, *lists)
    assert "twell_row_up_down" in module


@pytest.mark.parametrize("config", [
    None,
    ScanUpDownConfig(block_f=512, scan_width=256, block_d=128, num_warps=8),
    # The default's shape at M = 64, D = 2048, F = 5632 (512-column slices, 4 warps).
    ScanUpDownConfig(block_f=512, scan_width=512, block_d=128, num_warps=4, group=4),
    # The default's shape for one row at D = 2048: D split over two programs per slice.
    ScanUpDownConfig(block_f=128, scan_width=128, block_d=128, num_warps=4, group=8,
                     d_splits=2),
])
@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_scan_up_down_lowers(gated, m, config):
    w = S((F, D), BF16)
    if gated:
        fn = lambda *a: scan_up_down(*a, config=config, interpret=False)
        module = export_for_cuda(fn, S((m, F), jnp.float32), S((m, D), BF16), w, w)
    else:
        fn = lambda pre, w_down: scan_up_down(pre, None, None, w_down, config=config,
                                              interpret=False)
        module = export_for_cuda(fn, S((m, F), BF16), w)
    assert "twell_scan_up_down" in module


@pytest.mark.parametrize("config", [None, DecodeAttentionConfig(block_s=64, block_k=32, num_warps=2,
                                                                num_stages=3)])
@pytest.mark.parametrize("b,s,n,n_kv,h", [(1, 2048, 32, 32, 64), (3, 100, 8, 2, 64),
                                          (2, 100, 16, 1, 128), (1, 100, 6, 2, 24)],
                         ids=["mha", "gqa", "dot", "padded"])
def test_decode_attention_lowers(b, s, n, n_kv, h, config):
    cache = S((b, s, n_kv, h), BF16)
    fn = lambda q, k, v, pos: decode_attention(q, k, v, pos, config=config, interpret=False)
    module = export_for_cuda(fn, S((b, n, h), BF16), cache, cache, S((b,), jnp.int32))
    assert "twell_decode_attention" in module and "twell_decode_attention_combine" in module


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_row_backward_lowers(gated):
    w = S((F, D), BF16)
    args = [S((M, D), BF16), w, w, w if gated else None, S((M, K), BF16),
            S((M, K), jnp.float32) if gated else None, S((M, K), jnp.int32), S((M,), jnp.int32)]
    static = [i for i, a in enumerate(args) if a is None]
    fn = lambda *a: row_backward(*[None if i in static else a[i - sum(s < i for s in static)]
                                   for i in range(len(args))], 0.5, interpret=False)
    module = export_for_cuda(fn, *[a for a in args if a is not None])
    assert "twell_row_backward" in module and "twell_row_backward_dx" in module


@pytest.mark.parametrize("n_values", [1, 2])
def test_sparse_outer_lowers(n_values):
    def fn(columns, row_nnz, b, *values):
        return sparse_outer(values, columns, row_nnz, b, F, interpret=False)

    module = export_for_cuda(fn, S((M, K), jnp.int32), S((M,), jnp.int32), S((M, D), BF16),
                             *[S((M, K), jnp.float32)] * n_values)
    assert "twell_sparse_outer" in module and "twell_sparse_outer_add_pieces" in module
    # No while loop around it (on a GPU each step of one waits on the host); cumsum's
    # "chlo.scan" composite carries a while-loop decomposition that XLA's GPU backend replaces.
    outside_scans = re.sub(r"func\.func private @chlo\.scan\.impl.*?\n  \} loc", "", module,
                           flags=re.S)
    assert "stablehlo.while" not in outside_scans


@pytest.mark.parametrize("config", [
    None,  # the default: split over D
    GemvConfig(block_f=64, block_k=32, k_splits=3, num_warps=2),
    GemvConfig(block_f=128, block_k=64, k_splits=1, num_stages=4),
])
@pytest.mark.parametrize("m", [1, 5, 8, 64])  # the default differs below 8, to 15, from 16
@pytest.mark.parametrize("ragged", [True, False], ids=["ragged_bias", "exact_nobias"])
def test_gemv_lowers(ragged, m, config):
    if ragged:  # D and F not multiples of the blocks: the masked loads and stores lower too
        fn = lambda x, w, b: gemv(x, w, b, config=config, interpret=False)
        args = S((m, D + 40), BF16), S((D + 40, F - 24), BF16), S((F - 24,), jnp.float32)
    else:
        fn = lambda x, w: gemv(x, w, None, config=config, interpret=False)
        args = S((m, D), BF16), S((D, F), BF16)
    module = export_for_cuda(fn, *args)
    assert "twell_gemv" in module


@pytest.mark.parametrize("delta", ["none", "output", "partials"])
def test_add_rms_norm_lowers(delta):
    args = [S((3, D + 40), BF16)]  # a ragged D: the masked loads and stores lower too
    if delta == "output":
        args.append(S((3, D + 40), BF16))
    elif delta == "partials":
        args.append(S((8, 3, D + 40), jnp.float32))
    args.append(S((D + 40,), BF16))
    fn = (lambda x, s: add_rms_norm(x, None, s, eps=1e-6, interpret=False)) if delta == "none" \
        else (lambda x, dl, s: add_rms_norm(x, dl, s, eps=1e-6, interpret=False))
    module = export_for_cuda(fn, *args)
    assert "twell_add_rms_norm" in module


@pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
def test_qkv_rope_cache_lowers(n_kv):
    """A decode step's q, k, v from the GEMV's partial sums (with the launch that makes them),
    rotated, k and v written into the caches (aliased)."""
    n, h, length = 4, 64, 128

    def fn(x, wq, wk, wv, cos, sin, pos, ck, cv):
        parts = gemv_many_partial_sums(x, (wq, wk, wv), interpret=False)
        return qkv_rope_cache(parts, cos, sin, pos, ck, cv, n_heads=n, dtype=BF16,
                              interpret=False)
    module = export_for_cuda(
        fn, S((2, D), BF16), S((D, n * h), BF16), S((D, n_kv * h), BF16),
        S((D, n_kv * h), BF16), S((length, h // 2), jnp.float32),
        S((length, h // 2), jnp.float32), S((2,), jnp.int32),
        S((2, length, n_kv, h), BF16), S((2, length, n_kv, h), BF16))
    assert "twell_qkv_rope_cache" in module and "twell_gemv" in module


def test_gemv_many_lowers():
    fn = lambda x, *ws: gemv_many(x, ws, interpret=False)
    module = export_for_cuda(fn, S((1, D), BF16), S((D, F), BF16), S((D, F // 4), BF16),
                             S((D, F // 4), BF16))
    assert "twell_gemv" in module


def test_scan_up_down_on_partial_sums_lowers():
    """The decode FFN: the gate's GEMV partial sums read by the scan (bias added there)."""
    def fn(x, w_in, bias, w_up, w_down):  # every weight [F, D], the FFN's layout
        gate = GatePartials(gemv_partial_sums(x, w_in, unit_rows=True, interpret=False), bias,
                            x.dtype)
        return scan_up_down(gate, x, w_up, w_down, interpret=False)

    w = S((F, D), BF16)
    module = export_for_cuda(fn, S((1, D), BF16), w, S((F,), jnp.float32), w, w)
    assert "twell_scan_up_down" in module and "twell_gemv" in module


def test_decode_dense_switch_lowers():
    """The decode FFN with its dense switch: the counting GEMV, the scan (walk and dense mode,
    3 stages) and ``slice_down``."""
    from pallas_kernels.gemv import gemv_with_counts
    from pallas_kernels.scan_up_down import DenseSwitch, scan_up_down_partial_sums

    def fn(x, w_in, bias, w_up, w_down):  # every weight [F, D], the FFN's layout
        pre, counts = gemv_with_counts(x, w_in, bias, unit_rows=True, interpret=False)
        return scan_up_down_partial_sums(pre, x, w_up, w_down, switch=DenseSwitch(counts, 100),
                                         interpret=False)

    w = S((F, D), BF16)
    for m in (1, 8, 64):
        module = export_for_cuda(fn, S((m, D), BF16), w, S((F,), jnp.float32), w, w)
        assert all(name in module for name in
                   ("twell_gemv", "twell_scan_up_down", "twell_slice_down"))

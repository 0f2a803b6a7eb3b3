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

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gate_pack import GatePackConfig, gate_pack
from pallas_kernels.gated_up_down import GatedUpDownConfig, gated_up_down
from pallas_kernels.pack_rows import pack_rows
from pallas_kernels.pack_tiles import pack_tiles
from pallas_kernels.sampled_dot import SampledDotConfig, sampled_dot
from pallas_kernels.sparse_down import sparse_down
from pallas_kernels.sparse_outer import sparse_outer, sparse_outer_atomic

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
@pytest.mark.parametrize("prefix_sum,tiles_per_program", [("cumsum", 1), ("matmul", 1),
                                                          ("cumsum", 2), ("matmul", 4)])
def test_gate_pack_lowers(prefix_sum, tiles_per_program, dtype):
    def fn(x, w, b):
        return gate_pack(
            x, w, b, tile_width=128, slots_per_tile=8, interpret=False,
            config=GatePackConfig(prefix_sum=prefix_sum, tiles_per_program=tiles_per_program),
        )

    module = export_for_cuda(fn, S((M, D), dtype), S((D, F), dtype), S((F,), jnp.float32))
    assert "twell_gate_pack" in module
    assert plgpu.CUSTOM_CALL_TARGET_NAME in module


@pytest.mark.parametrize("return_up", [False, True])
@pytest.mark.parametrize("schedule", ["fused", "two_pass"])
def test_gated_up_down_lowers(schedule, return_up):
    def fn(*args):
        return gated_up_down(
            *args, return_up=return_up, interpret=False,
            config=GatedUpDownConfig(block_m=16, block_d=128, schedule=schedule),
        )

    module = export_for_cuda(
        fn,
        S((M, D), BF16), S((F, D), BF16), S((F, D), BF16),
        S((M, K), BF16), S((M, K), jnp.int32), S((M,), jnp.int32),
    )
    assert "twell_gated_up_down" in module


def test_sparse_down_lowers():
    def fn(*args):
        return sparse_down(*args, interpret=False)

    module = export_for_cuda(
        fn, S((M, K), BF16), S((M, K), jnp.int32), S((M,), jnp.int32), S((F, D), BF16)
    )
    assert "twell_sparse_down" in module


@pytest.mark.parametrize(  # None: the default config; (4, 8): the rolled chunk loop
    "block_k,block_d", [(None, None), (8, 128), (16, 128), (16, 64), (4, 8)])
def test_sampled_dot_lowers(block_k, block_d):
    config = (None if block_k is None
              else SampledDotConfig(block_m=16, block_k=block_k, block_d=block_d))
    module = export_for_cuda(
        lambda *a: sampled_dot(*a, config=config, interpret=False),
        S((M, D), BF16), S((F, D), BF16), S((M, K), jnp.int32), S((M,), jnp.int32),
    )
    assert "twell_sampled_dot" in module


def test_pack_tiles_lowers():
    module = export_for_cuda(
        lambda h: pack_tiles(h, tile_width=128, slots_per_tile=8, interpret=False),
        S((M, F), BF16),
    )
    assert "twell_pack_tiles" in module


def test_pack_rows_lowers():
    module = export_for_cuda(
        lambda h: pack_rows(h, tile_width=128, slots_per_tile=8, interpret=False),
        S((M, F), BF16),
    )
    assert "twell_pack_rows" in module


@pytest.mark.parametrize("n_values", [1, 2])
def test_sparse_outer_lowers(n_values):
    def fn(columns, row_nnz, b, *values):
        return sparse_outer(values, columns, row_nnz, b, F, interpret=False)

    module = export_for_cuda(fn, S((M, K), jnp.int32), S((M,), jnp.int32), S((M, D), BF16),
                             *[S((M, K), jnp.float32)] * n_values)
    assert "twell_sparse_outer" in module


def test_sparse_outer_atomic_lowers():
    def fn(columns, row_nnz, b, v1, v2):
        return sparse_outer_atomic((v1, v2), columns, row_nnz, b, F, interpret=False)

    module = export_for_cuda(fn, S((M, K), jnp.int32), S((M,), jnp.int32), S((M, D), BF16),
                             S((M, K), jnp.float32), S((M, K), jnp.float32))
    assert "twell_sparse_outer_atomic" in module

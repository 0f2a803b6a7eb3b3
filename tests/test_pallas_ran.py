"""Proof that implementation="pallas" runs the Pallas kernels (their names in the program)."""

import collections
import re

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels.common as kernels_common
import twell_jax as tj
from twell_jax import ffn
from tests.test_lowering import export_for_cuda
from tests.utils import make_ffn_inputs, nested_eqns

FORWARD_KERNELS = {"twell_row_pack", "twell_row_up_down"}
# Never the dense switch, and the lists even for these small calls (no decode path).
SPARSE = tj.TwELLConfig(dense_fallback_density=1.0, decode_rows=0)


def _kernel_names(text: str) -> set[str]:
    return set(re.findall(
        r"twell_(?:row_pack|row_up_down|row_backward|sparse_outer|scan_up_down|gemv)", text))


def test_forward_and_backward_lower_the_kernels():
    x, *weights = make_ffn_inputs(0, 32, 64, 256, "uniform", jnp.float32)
    fwd = jax.jit(lambda *a: tj.gated_mlp(*a, implementation="pallas", config=SPARSE))
    assert _kernel_names(fwd.lower(x, *weights).as_text(debug_info=True)) == FORWARD_KERNELS
    grad = jax.grad(lambda *a: jnp.sum(tj.gated_mlp(*a, implementation="pallas", config=SPARSE)),
                    argnums=(0, 1, 2, 3))
    # Backward: dh, du, dg and dx (row_backward) and the dW products (sparse_outer) run on the
    # kernels.
    assert {"twell_row_backward", "twell_sparse_outer"} <= _kernel_names(
        str(jax.make_jaxpr(grad)(x, *weights)))
    reference = jax.jit(lambda *a: tj.gated_mlp(*a, implementation="reference", config=SPARSE))
    assert not _kernel_names(reference.lower(x, *weights).as_text(debug_info=True))
    # With the default config these 32 rows (and 4) are a decode-sized call: the gate product
    # on the GEMV kernel, then the scan kernel.
    decode = jax.jit(lambda *a: tj.gated_mlp(*a, implementation="pallas"))
    for rows in (x, x[:4]):
        assert _kernel_names(decode.lower(rows, *weights).as_text(debug_info=True)) == {
            "twell_gemv", "twell_scan_up_down"}


def _kernel_calls(jaxpr) -> collections.Counter:
    """Pallas calls by name, counted once per place they run: inside nested jits and switch
    branches too (what XLA compiles once each, after inlining the jits)."""
    return collections.Counter(str(eqn.params["name"])
                               for eqn in nested_eqns(jaxpr, skip=("pallas_call",))
                               if eqn.primitive.name == "pallas_call")


def test_the_backward_kernels_sit_before_the_route_switch_but_dx():
    """The lists' backward kernels sit before the route's switch, not in each branch: XLA
    compiles every Triton call on its own, and a copy per branch made a 2b training step take
    minutes to compile. dx's kernel has one copy per sparse branch, as the forward's up/down
    does (passed through the switch, dx was copied in the models: ``ffn._twell_backward``)."""
    x, *weights = make_ffn_inputs(0, 32, 64, 256, "uniform", jnp.float32)
    grad = jax.grad(lambda *a: jnp.sum(tj.gated_mlp(*a, implementation="pallas", config=SPARSE)),
                    argnums=(0, 1, 2, 3))
    calls = _kernel_calls(jax.make_jaxpr(grad)(x, *weights).jaxpr)
    sparse_branches = 1 + len(ffn._backup_sizes(32, SPARSE))
    assert calls == {"twell_row_pack": 1, "twell_row_up_down": sparse_branches,
                     "twell_row_backward": 1, "twell_row_backward_dx": sparse_branches,
                     "twell_sparse_outer": 2,
                     "twell_sparse_outer_add_pieces": 2}


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("gated", [True, False])
def test_the_whole_op_lowers_for_the_gpu(monkeypatch, gated, bias):
    """The full op, compiled for CUDA on this CPU machine, contains the Triton kernels; with
    a bias (gated), the up/down kernel reads x with the folded gate bias's column."""
    monkeypatch.setattr(kernels_common, "default_interpret", lambda: False)
    monkeypatch.setattr(ffn, "default_interpret", lambda: False)
    m, d, f = 256, 256, 512
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in
              ([(m, d), (d, f), (d, f), (f, d)] if gated else [(m, d), (d, f), (f, d)])]
    op = tj.gated_mlp if gated else tj.mlp
    bias_arg = {}
    if bias:
        shapes.append(jax.ShapeDtypeStruct((f,), jnp.float32))
        bias_arg = lambda b: {"b_gate" if gated else "b_up": b}

    def fn(*a):
        if bias:
            return op(*a[:-1], implementation="pallas", config=SPARSE, **bias_arg(a[-1]))
        return op(*a, implementation="pallas", config=SPARSE)

    module = export_for_cuda(fn, *shapes)
    if bias and gated:  # the up/down kernel's first operand: x and 64 more columns
        wide_x_first = re.compile(r"custom_call @__gpu\$xla\.gpu\.triton\(.*: \(tensor<"
                                  rf"{m}x{d + 64}xbf16>, tensor<{f}x{d}xbf16>")
        assert any(wide_x_first.search(line) for line in module.splitlines())
    expected = FORWARD_KERNELS
    assert expected <= _kernel_names(module)

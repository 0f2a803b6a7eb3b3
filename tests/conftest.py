"""Settings for every test.

pytest imports this file before any test module, so the environment set here is in place before
the first ``import jax`` (in this process and in every xdist worker, each of which imports it
first too) and is inherited by the subprocesses the tests start (they copy ``os.environ``).
"""

import os

import pytest

# A GPU machine (an NVIDIA device node), told apart before JAX starts.
ON_GPU_MACHINE = os.path.exists("/dev/nvidia0")

# The experiment scripts keep compiled programs in a cache folder by default
# (twell_jax/cli.py, --compile-cache); tests that run them in-process leave the user's
# cache alone. test_train checks the cache itself, in a subprocess.
os.environ["TWELL_COMPILE_CACHE"] = ""

# GPU machines: the xdist workers (pyproject's "-n 2") share one GPU, and by default each JAX
# process preallocates 75% of its memory, so the second worker runs out of memory
# (CUDA_ERROR_OUT_OF_MEMORY in tests/test_hf_transformers.py). Without preallocation each worker
# takes what it uses: the tests' arrays are small, and no test has to fit a fixed share. (A
# per-worker XLA_PYTHON_CLIENT_MEM_FRACTION would tie the share to the worker count and still
# reserve memory no test needs.) setdefault: a user's own setting stands. No effect on the CPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# GPU machines: XLA's float32 products run in TF32 by default there (~1e-3 relative error),
# and the float32 tests compare against float64 references at float32 tolerances. Full
# float32 precision, as on the CPU. (bf16 products are unaffected.)
if ON_GPU_MACHINE:
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

# Without a GPU most of a test's time is XLA compiling small programs for the CPU. Without
# LLVM's optimisation passes it compiles them about 30% faster (a pallas test of the FFN:
# 41 -> 28 s). The tests time nothing, and every comparison is against a reference computed in
# the same process, so the unoptimised machine code changes no verdict. A user's XLA_FLAGS
# stand; subprocess tests that set their own XLA_FLAGS run without it.
if not ON_GPU_MACHINE and "--xla_backend_optimization_level" not in \
        os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()


@pytest.fixture
def compiled_kernels(monkeypatch):
    """The program as a GPU builds it: kernels compiled, the cost model and the few-row GEMV
    in play (no GPU is needed to lower it; a CPU cannot run it)."""
    import pallas_kernels.common
    from twell_jax import dense, ffn
    for module in (pallas_kernels.common, ffn, dense):
        monkeypatch.setattr(module, "default_interpret", lambda: False)

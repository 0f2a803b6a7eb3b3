"""Compiler settings the sparse FFN wants on a GPU: its route switches as device-side
conditionals, and, for a training step on a mesh of several GPUs, a schedule built from
measured costs and, with FSDP, all-reduces pipelined across the scan over the blocks.

Each sparse FFN call routes its batch with one ``lax.switch`` per direction (dense, the lists
alone, the lists plus the dense backup: ``twell_jax.ffn``). By default XLA's GPU runtime copies
a switch's index to the host and waits for it, so the GPU drains its queue at every switch
(~110 us on the H100). With ``--xla_gpu_enable_command_buffer=
+CONDITIONAL`` XLA runs them as CUDA-graph conditional nodes on the device instead: the 0.5b
training step 95.1 -> 93.9 ms, prefill 27.1 -> 26.6 ms on the H100. The dense model has no switch.

XLA reads ``XLA_FLAGS`` once, when JAX starts its backends (at the first computation, not at
``import jax``), so the flag must be in the environment before then:

    from twell_jax import xla_flags
    xla_flags.use_device_conditionals()  # first thing in a script

**Profile-guided scheduling** (``profile_guided_scheduling``). Data parallel, every weight
gradient is all-reduced, and XLA's latency-hiding scheduler decides which computation each
all-reduce overlaps, from its own estimate of every operation's cost. The sparse FFN's Pallas
kernels are custom calls, whose cost it does not know. With JAX's automatic profile-guided
latency estimation, a jitted step's first calls run under the profiler and the step is then
compiled again with the measured costs. Two H100s, the 0.5b model, 8 x 2048 tokens per GPU,
remat on, one process: the sparse step at ``data=2`` 115.5 -> 112.5 ms (scaling over one GPU
1.84x -> 1.89x), the dense step 139.9 -> 139.4 ms. It costs one more compilation and a few
slower profiled steps (compiled without command buffers, so each kernel is timed), and
changes no numerics.

**All-reduces pipelined across the layer scan, with FSDP** (``step_compiler_options``). XLA's
collective pipeliner can move a loop's all-reduces across its iterations, so the one issued
at the end of a layer's step of the scan runs beside the next layer's. On two H100s (0.5b, 8
x 2048 tokens per GPU, remat on, two runs on one machine) it took ``fsdp=2`` scaling from
1.888x to 1.922x (sparse) and 1.894x to 1.902x (dense), and the peak memory from 11.1 to 10.4
GiB (sparse); at ``data=2`` it lost (1.884x -> 1.844x sparse, 1.880x -> 1.857x dense), so it
is set only on a mesh with an ``fsdp`` axis of more than one device.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

import jax

COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"
DEVICE_CONDITIONALS = f"{COMMAND_BUFFER_FLAG}=+CONDITIONAL"


def with_device_conditionals(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with ``DEVICE_CONDITIONALS`` appended, unless they
    already set the command buffer's contents (then the caller's setting stands)."""
    if any(f.split("=", 1)[0] == COMMAND_BUFFER_FLAG for f in flags.split()):
        return flags
    return f"{flags} {DEVICE_CONDITIONALS}".strip()


def backends_started() -> bool:
    """Whether JAX has started its backends (after which XLA_FLAGS changes nothing in this
    process). Asks a private JAX function; when it is missing, assumes not."""
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def use_device_conditionals() -> bool:
    """Adds ``DEVICE_CONDITIONALS`` to ``os.environ["XLA_FLAGS"]`` (see
    ``with_device_conditionals``); subprocesses inherit it. Returns whether this process will
    use it: False once JAX's backends have started. Harmless without a GPU (XLA knows the flag
    on every platform and the CPU ignores it)."""
    os.environ["XLA_FLAGS"] = with_device_conditionals(os.environ.get("XLA_FLAGS", ""))
    return not backends_started()


# Calls of a jitted step profiled before it is compiled with their costs (JAX's default).
PROFILED_STEPS = 3


def profiled_steps(requested: int, num_devices: int, platform: str) -> int:
    """How many steps ``profile_guided_scheduling`` should profile: ``requested`` when it
    is >= 0, else (-1, the scripts' default) ``PROFILED_STEPS`` on a GPU mesh of several
    devices, where the schedule decides how the gradient collectives overlap, and 0 (off)
    on one device or another platform."""
    if requested < -1:
        raise ValueError(f"profiled steps must be >= -1 (-1: automatic), got {requested}")
    if requested >= 0:
        return requested
    return PROFILED_STEPS if platform == "gpu" and num_devices > 1 else 0


@contextlib.contextmanager
def profile_guided_scheduling(steps: int) -> Iterator[None]:
    """Within the block, JAX's automatic profile-guided latency estimation is on (``steps``
    > 0) or off: a function jitted and called there has its first ``steps`` calls run
    profiled, then is compiled once more with the measured costs (module docstring). The
    setting before the block is restored after it. It applies to ``jax.jit`` calls, not to
    ahead-of-time ``.lower().compile()``. JAX keys its compilation caches on the setting, so
    call a function under the same setting each time, or it is compiled again."""
    saved = jax.config.jax_enable_pgle, jax.config.jax_pgle_profiling_runs
    jax.config.update("jax_enable_pgle", steps > 0)
    if steps > 0:
        jax.config.update("jax_pgle_profiling_runs", steps)
    try:
        yield
    finally:
        jax.config.update("jax_enable_pgle", saved[0])
        jax.config.update("jax_pgle_profiling_runs", saved[1])


# XLA's compile option (a ``DebugOptions`` field) that pipelines a loop's all-reduces, and
# its value; as a per-program option it leaves the process's other programs alone.
PIPELINED_ALL_REDUCE = {"xla_gpu_pipeline_all_reduce": "COLLECTIVE_PIPELINING_MODE_ON"}


def step_compiler_options(mesh_shape: Mapping[str, int]) -> dict[str, str]:
    """The XLA options a training step jitted on a mesh of ``mesh_shape`` (axis -> size, as
    ``Mesh.shape``) is compiled with: ``PIPELINED_ALL_REDUCE`` when its ``fsdp`` axis has more
    than one device (module docstring: measured faster there, slower data parallel), else
    none. Pass them as ``jax.jit(..., compiler_options=...)``; on a CPU XLA ignores them."""
    return dict(PIPELINED_ALL_REDUCE) if mesh_shape.get("fsdp", 1) > 1 else {}

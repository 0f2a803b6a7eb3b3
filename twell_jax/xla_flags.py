"""The XLA flag the sparse FFN wants on a GPU: its route switches as device-side conditionals.

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
"""

from __future__ import annotations

import os

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

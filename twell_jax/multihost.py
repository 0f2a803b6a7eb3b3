"""Starting a multi-process run: ``jax.distributed.initialize`` with the coordinator, the
process count and this process's id from flags or the environment.

jax itself reads only ``JAX_COORDINATOR_ADDRESS`` from the environment (and detects clusters
such as SLURM or Open MPI); two processes started by hand also need the count and the id.
"""

from __future__ import annotations

import os

import jax

# Environment variables read when the corresponding flag is not given.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
# Seconds without a heartbeat after which a process counts as dead (jax's default is 100):
# the survivors then stop with an error instead of waiting in a collective for ever.
ENV_HEARTBEAT_TIMEOUT = "TWELL_HEARTBEAT_TIMEOUT"


def distributed_settings(coordinator: str = "", num_processes: int = 0, process_id: int = -1,
                         heartbeat_timeout: int = 0,
                         environ: dict[str, str] | None = None) -> dict:
    """The keyword arguments for ``jax.distributed.initialize``: each flag value that is set
    (non-empty, > 0, >= 0 for the id), else its environment variable, else left out (jax then
    auto-detects it, or fails naming it). ValueError for an environment value that is not a
    number."""
    environ = os.environ if environ is None else environ
    kwargs: dict = {}
    coordinator = coordinator or environ.get(ENV_COORDINATOR, "")
    if coordinator:
        kwargs["coordinator_address"] = coordinator
    for key, value, env, minimum in (("num_processes", num_processes, ENV_NUM_PROCESSES, 1),
                                     ("process_id", process_id, ENV_PROCESS_ID, 0),
                                     ("heartbeat_timeout_seconds", heartbeat_timeout,
                                      ENV_HEARTBEAT_TIMEOUT, 1)):
        if value < minimum and environ.get(env, ""):
            try:
                value = int(environ[env])
            except ValueError:
                raise ValueError(f"{env}={environ[env]!r} is not an integer") from None
            if value < minimum:
                raise ValueError(f"{env}={value} must be >= {minimum}")
        if value >= minimum:
            kwargs[key] = value
    return kwargs


def initialize(coordinator: str = "", num_processes: int = 0, process_id: int = -1,
               heartbeat_timeout: int = 0) -> dict:
    """Calls ``jax.distributed.initialize`` with ``distributed_settings(...)`` (no arguments
    when nothing is set: cluster auto-detection); returns the arguments used."""
    kwargs = distributed_settings(coordinator, num_processes, process_id, heartbeat_timeout)
    jax.distributed.initialize(**kwargs)
    return kwargs

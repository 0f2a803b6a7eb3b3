"""Data-parallel and fully sharded (FSDP) training over a ``jax.sharding.Mesh``.

The mesh has two axes, ``data`` and ``fsdp``; the batch is split over both (every device holds
B / (data * fsdp) sequences), and each parameter, with its AdamW moments, is split over ``fsdp``
along its largest dimension that the rules allow and ``fsdp`` divides. XLA's SPMD partitioner
gathers a sharded weight where a layer uses it and reduce-scatters its gradient, as MaxText's
FSDP does. ``data=N, fsdp=1`` is plain data parallelism (parameters replicated).

Parameters carry *logical* axis names (metadata ``logical_axes``, e.g. ``("mlp", "embed")`` on
``w_gate`` [F, D]); ``LOGICAL_RULES`` maps logical names to mesh axes, here and nowhere else.
``nnx.Optimizer`` copies a parameter's metadata onto its AdamW moments, so they shard alike;
values without names (step counters) are replicated.

The Pallas FFN does not partition itself: ``twell_jax.nn`` runs every FFN under ``shard_map``
over ``BATCH_AXES`` of the context mesh (``jax.set_mesh(mesh)``), see ``batch_axes_of``.

Usage::

    mesh = sharding.make_mesh(sharding.parse_mesh("data=2,fsdp=2"))
    sharding.shard_state(model, mesh); sharding.shard_state(optimizer, mesh)
    with jax.set_mesh(mesh):
        metrics = train_step(model, optimizer, sharding.shard_batch(batch, mesh), ...)
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES: tuple[str, ...] = ("data", "fsdp")
"""The mesh's axis names, in order."""

BATCH_AXES: tuple[str, ...] = ("data", "fsdp")
"""Mesh axes the batch dimension is split over (all of them: FSDP is data parallel too)."""

LOGICAL_AXES_KEY = "logical_axes"
"""The ``nnx.Variable`` metadata key that holds a parameter's logical axis names."""

LOGICAL_RULES: Mapping[str, str] = {
    "vocab": "fsdp",  # embedding rows
    "embed": "fsdp",  # the residual width D
    "mlp": "fsdp",  # the FFN hidden width F
    "heads": "fsdp",  # attention projections' head features (n_heads * head_dim)
}
"""Logical axis name -> mesh axis it may be split over. Each parameter uses one mesh axis at
most once: the candidate with the largest dimension wins (``logical_spec``)."""


def logical(*names: str) -> dict:
    """Metadata for ``nnx.Param(value, **logical("embed", "mlp"))``: one name per dimension."""
    return {LOGICAL_AXES_KEY: tuple(names)}


# ------------------------------------------------------------------------------------------
# The mesh.


def parse_mesh(text: str, n_devices: int | None = None) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}``.

    A missing axis is 1, except that ``data`` takes the remaining devices when only ``fsdp`` is
    given; ``""`` puts all ``n_devices`` (default: every visible device) on ``data``. Raises
    ValueError for unknown axes, non-positive sizes, or sizes whose product is not the device
    count.
    """
    n = jax.device_count() if n_devices is None else n_devices
    sizes: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in MESH_AXES:
            raise ValueError(f"mesh: expected items like data=2 or fsdp=2 (axes {MESH_AXES}), "
                             f"got {item!r}")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(f"mesh: {name} size must be an int, got {value!r}") from None
        if size < 1:
            raise ValueError(f"mesh: {name} size must be >= 1, got {size}")
        if name in sizes:
            raise ValueError(f"mesh: axis {name} given twice in {text!r}")
        sizes[name] = size
    if "data" not in sizes:
        rest = n // sizes.get("fsdp", 1)
        sizes["data"] = max(rest, 1)
    sizes.setdefault("fsdp", 1)
    if math.prod(sizes.values()) != n:
        raise ValueError(f"mesh {text!r}: data={sizes['data']} x fsdp={sizes['fsdp']} = "
                         f"{sizes['data'] * sizes['fsdp']} devices, but {n} are visible")
    return {axis: sizes[axis] for axis in MESH_AXES}


def make_mesh(sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` with axes ``MESH_AXES`` of the given sizes over ``devices`` (default: all).

    Axis types are ``Auto``: inside ``jax.set_mesh(mesh)`` jit keeps propagating shardings
    itself (no explicit-sharding types on every array).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} devices, "
                         f"got {len(devices)}")
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def describe(mesh: Mesh) -> str:
    """One line: ``"data=2 x fsdp=2 over 4 gpu devices (1 process)"``."""
    axes = " x ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return (f"{axes} over {mesh.devices.size} {mesh.devices.flat[0].platform} devices "
            f"({jax.process_count()} process{'es' if jax.process_count() > 1 else ''})")


def on_one_device() -> bool:
    """No context mesh of several devices: Pallas kernels may run as they are (XLA partitions
    a plain product under such a mesh; a ``pallas_call`` is not partitioned)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1


def batch_axes_of(mesh) -> tuple[str, ...]:
    """The ``BATCH_AXES`` present in ``mesh`` (a ``Mesh`` or ``AbstractMesh``); () for an empty
    or unrelated mesh."""
    return tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)


# ------------------------------------------------------------------------------------------
# Parameters and optimizer state.


def logical_spec(names: Sequence[str | None] | None, shape: Sequence[int],
                 mesh_shape: Mapping[str, int],
                 rules: Mapping[str, str] = LOGICAL_RULES) -> P:
    """The ``PartitionSpec`` of an array of ``shape`` whose dimensions have logical ``names``.

    For each mesh axis (of size > 1), the dimensions whose logical name maps to it under
    ``rules`` and whose size it divides are candidates; the largest one is split over it (ties:
    the first). Dimensions without a candidate, and arrays without names, are replicated.
    """
    spec: list[str | None] = [None] * len(shape)
    if names is None:
        return P(*spec)
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
    for axis, size in mesh_shape.items():
        if size == 1:
            continue
        candidates = [i for i, name in enumerate(names)
                      if rules.get(name) == axis and spec[i] is None and shape[i] % size == 0]
        if candidates:
            spec[max(candidates, key=lambda i: (shape[i], -i))] = axis
    return P(*spec)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """A ``NamedSharding`` per array of ``state`` (from ``nnx.state(model or optimizer)``),
    from its variable's logical axes; the same tree structure as ``state``."""
    def one(leaf):
        value = leaf.get_value() if _is_variable(leaf) else leaf
        names = leaf.get_metadata().get(LOGICAL_AXES_KEY) if _is_variable(leaf) else None
        spec = logical_spec(names, np.shape(value), mesh.shape)
        sharding = NamedSharding(mesh, spec)
        return leaf.replace(sharding) if _is_variable(leaf) else sharding

    return jax.tree.map(one, state, is_leaf=_is_variable)


def shard_state(obj: nnx.Module | nnx.Optimizer, mesh: Mesh) -> None:
    """Moves ``obj``'s state (a model's parameters, an optimizer's moments) onto ``mesh``, in
    place: each array split as ``state_shardings`` says."""
    state = nnx.state(obj)
    nnx.update(obj, jax.device_put(state, state_shardings(state, mesh)))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over ``BATCH_AXES``, the rest replicated."""
    return NamedSharding(mesh, P(batch_axes_of(mesh)))


def shard_batch(batch: np.ndarray | jax.Array, mesh: Mesh) -> jax.Array:
    """The global batch [B, ...] (the same on every process) as one array split over the
    batch axes. Raises ValueError when B is not a multiple of their device count."""
    batch = np.asarray(batch)
    n = math.prod(mesh.shape[axis] for axis in batch_axes_of(mesh))
    if batch.ndim < 1 or batch.shape[0] % n:
        raise ValueError(f"batch of shape {batch.shape}: the batch size must be a multiple of "
                         f"{n}, the devices of mesh axes {batch_axes_of(mesh)}")
    # From a callback, not device_put: on several hosts each process fills only its devices.
    return jax.make_array_from_callback(batch.shape, batch_sharding(mesh), lambda i: batch[i])


def to_host(tree):
    """Every array of ``tree`` as a whole NumPy array on this process, also when it is split
    over several hosts' devices (``jax.device_get`` reads only arrays this process holds)."""
    return multihost_utils.process_allgather(tree, tiled=True)

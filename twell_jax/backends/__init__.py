"""The FFN implementations, looked up by name: one read-only table from name to backend.

| name | module |
|---|---|
| ``"pallas"`` | ``backends.pallas``: the TwELL building blocks on Pallas kernels |
| ``"reference"`` | ``backends.reference``: the TwELL building blocks in plain jnp |
| ``"xla"`` | ``backends.xla``: the dense function (no building blocks) |

Each name's module is ``twell_jax.backends.<name>``, imported only when asked for (the Pallas
kernels load with the first ``"pallas"`` call). ``check`` is the one place a name is validated.
"""

from __future__ import annotations

import importlib
import types
import typing
from typing import Literal

from twell_jax.backends.base import Backend, RowLists

Implementation = Literal["pallas", "reference", "xla"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(Implementation)
"""The names of ``Implementation``, in its order."""

DEFAULT_IMPLEMENTATION: Implementation = "pallas"
"""The one default of the ops, the NNX layers and ``ModelConfig``: the TwELL kernels."""

_MODULES = types.MappingProxyType(
    {name: f"twell_jax.backends.{name}" for name in IMPLEMENTATIONS})

__all__ = ["Backend", "RowLists", "Implementation", "IMPLEMENTATIONS", "DEFAULT_IMPLEMENTATION",
           "check", "get"]


def check(name: str) -> None:
    """Raises ValueError unless ``name`` is one of ``IMPLEMENTATIONS``."""
    if name not in _MODULES:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {name!r}")


def get(name: str) -> Backend:
    """The backend called ``name``; raises ValueError for any other name (``check``)."""
    check(name)
    return importlib.import_module(_MODULES[name]).BACKEND

"""The TwELL backends, looked up by name: each supplies the building blocks of
``backends.base.Backend`` to the shared algorithm in ``ffn.py``.

| name | module |
|---|---|
| ``"reference"`` | ``backends.reference``: plain jnp |
| ``"pallas"`` | ``backends.pallas``: the Pallas kernels (imported only when asked for) |

The dense ``"xla"`` implementation needs no building blocks: ``ffn.py`` runs the dense function.
"""

from __future__ import annotations

import importlib
import types

from twell_jax.backends.base import Backend

_MODULES = types.MappingProxyType({
    "reference": "twell_jax.backends.reference",
    "pallas": "twell_jax.backends.pallas",
})


def get(name: str) -> Backend:
    """The backend called ``name`` ("reference" or "pallas"); raises for any other name."""
    if name not in _MODULES:
        raise ValueError(f"no TwELL backend named {name!r}; have {tuple(_MODULES)}")
    return importlib.import_module(_MODULES[name]).BACKEND

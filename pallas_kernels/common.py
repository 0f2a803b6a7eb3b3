"""Helpers shared by the kernel files."""

from __future__ import annotations

import functools

import jax


@functools.cache
def default_interpret() -> bool:
    """Run Pallas kernels in interpret mode when no GPU is present (CPU machines, CI)."""
    return jax.default_backend() != "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means: interpret exactly when there is no GPU."""
    return default_interpret() if interpret is None else bool(interpret)


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0

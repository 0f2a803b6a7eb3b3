"""Pallas kernels for TwELL sparse FFNs, each beside a plain-jnp reference of the same signature."""

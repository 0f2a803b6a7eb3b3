"""The backend table: one name per ``Implementation`` value, validated in one place."""

from __future__ import annotations

import typing

import pytest

import twell_jax
from twell_jax import backends


def test_table_matches_the_literal():
    assert backends.IMPLEMENTATIONS == typing.get_args(backends.Implementation)
    assert twell_jax.IMPLEMENTATIONS == backends.IMPLEMENTATIONS
    for name in backends.IMPLEMENTATIONS:
        assert isinstance(backends.get(name), backends.Backend)


def test_dense_backend_has_no_building_blocks():
    xla = backends.get("xla")
    assert not xla.sparse and xla.pack is None
    assert backends.get("reference").sparse and not backends.get("reference").cost_model_routes
    assert backends.get("pallas").sparse and backends.get("pallas").cost_model_routes


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="implementation must be one of"):
        backends.check("cuda")
    with pytest.raises(ValueError, match="implementation must be one of"):
        backends.get("cuda")

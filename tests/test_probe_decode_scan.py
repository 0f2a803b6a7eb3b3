"""tools/probe_decode_scan.py on the CPU: its variants override the decode kernels' configs."""

from __future__ import annotations

import json

import pytest

import pallas_kernels.gemv as gemv_module
import pallas_kernels.scan_up_down as scan_module
import pallas_kernels.slice_down as slice_down_module
from tests.utils import load_experiment


@pytest.fixture(scope="module")
def probe():
    with load_experiment("probe_decode_scan") as module:
        yield module


def test_variant_overrides_scan_and_gemv_fields(probe):
    scan, gemv, _, _, _ = probe.parse_variant(
        "group=2,scan_width=block_f,gemv.k_splits=2,gemv.block_f=32")
    base_scan = scan_module.default_scan_up_down_config(8, 2048, 5632)
    base_gemv = gemv_module.default_gemv_config(8, 2048, 5632)
    got_scan, got_gemv = scan(8, 2048, 5632), gemv(8, 2048, 5632)
    assert got_scan.group == 2 and got_scan.scan_width == base_scan.block_f
    assert got_scan.block_f == base_scan.block_f and got_scan.num_warps == base_scan.num_warps
    assert (got_gemv.k_splits, got_gemv.block_f) == (2, 32)
    assert got_gemv.block_k == base_gemv.block_k and got_gemv.num_stages == base_gemv.num_stages
    # Scan fields alone leave the GEMV's default as it is, and the other way round.
    assert probe.parse_variant("group=2")[1](64, 2048, 5632) == gemv_module.default_gemv_config(
        64, 2048, 5632)
    assert probe.parse_variant("gemv.k_splits=1")[0](1, 2048, 5632) == (
        scan_module.default_scan_up_down_config(1, 2048, 5632))


def test_variant_overrides_the_counting_gemv_and_the_twell_config(probe):
    _, gemv, counts, twell, slice_down = probe.parse_variant(
        "gemv_counts.block_f=16,twell.dense_fallback_density=1.0,slice_down.block_n=64")
    assert counts(1, 2048, 5632).block_f == 16
    assert counts(1, 2048, 5632).k_splits == 1
    assert gemv(1, 2048, 5632) == gemv_module.default_gemv_config(1, 2048, 5632)
    assert twell.dense_fallback_density == 1.0
    assert slice_down(1, 2048, 128).block_n == 64
    assert probe.parse_variant("group=2")[3] == probe.DEFAULT_CONFIGS[3]


@pytest.mark.parametrize("text", ["group", "", "gemv.k_splits"])
def test_variant_without_values_is_rejected(probe, text):
    with pytest.raises(ValueError, match="field=value"):
        probe.parse_variant(text)


def test_bad_field_fails_when_built(probe):
    gemv = probe.parse_variant("gemv.not_a_field=3")[1]
    with pytest.raises(TypeError):
        gemv(1, 2048, 5632)


def test_use_configs_swaps_and_restores_the_defaults(probe):
    defaults = probe.DEFAULT_CONFIGS
    variant = probe.parse_variant("gemv.k_splits=1,group=2,gemv_counts.block_k=64")
    try:
        probe.use_configs(variant)
        assert gemv_module.default_gemv_config(8, 2048, 5632).k_splits == 1
        assert gemv_module.default_gemv_counts_config(8, 2048, 5632).block_k == 64
        assert scan_module.default_scan_up_down_config(8, 2048, 5632).group == 2
    finally:
        probe.use_configs(defaults)
    assert (scan_module.default_scan_up_down_config, gemv_module.default_gemv_config,
            gemv_module.default_gemv_counts_config) == defaults[:3]
    assert slice_down_module.default_slice_down_config is defaults[4]


@pytest.mark.slow  # a probe's end-to-end run; its variant parsing stays in the fast tier
def test_smoke_times_a_gemv_variant(probe, tmp_path):
    out = tmp_path / "probe.jsonl"
    rows = probe.main(["--smoke", "--variant", "gemv.k_splits=2", "--out", str(out)])
    assert [r["m"] for r in rows] == [2]
    for mode in ("loop", "unrolled"):
        assert set(rows[0][mode]) == {"default", "gemv.k_splits=2", "dense", "plain"}
        assert all(v["median_us"] > 0 for v in rows[0][mode].values())
    lines = out.read_text().splitlines()
    assert "command" in json.loads(lines[0]) and len(lines) == 2
    # The run leaves the defaults as it found them.
    assert gemv_module.default_gemv_config is probe.DEFAULT_GEMV_CONFIG
    assert scan_module.default_scan_up_down_config is probe.DEFAULT_CONFIG
    assert set(rows[0]["rel_error_float64"]) == {"default", "gemv.k_splits=2"}
    assert all(0 < e < 1e-2 for e in rows[0]["rel_error_float64"].values())


@pytest.mark.slow  # ~40 s on 2 cores: the smoke run's calls traced as well as timed
def test_profile_gives_every_variant_a_kernel_table(probe, tmp_path):
    """``--profile``: per variant and dense FFN, the GPU time per kernel of its unrolled calls
    (no GPU kernels on a CPU, so each table holds the busy time alone, zero)."""
    rows = probe.main(["--smoke", "--profile", "--out", str(tmp_path / "probe.jsonl")])
    tables = rows[0]["kernels_us"]
    assert set(tables) == {"default", "group=2", "dense", "plain"}
    for table in tables.values():
        assert "busy" in table and all(us >= 0 for us in table.values())

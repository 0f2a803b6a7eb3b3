"""The TwELL format's knobs, in one frozen (hashable) dataclass."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.common import is_power_of_two
from pallas_kernels.scan_up_down import NARROW_SLICE_MAX_ROWS


# ``row_up_down``'s rate gathering weight rows from HBM (W_up and W_down past the L2), by
# device kind: D = 4096, F = 14336, M = 16384, 28-71 active units per token. The H200's
# faster memory gathers at 4.2-4.6 TB/s, where the H100's takes ~2.6 (the H100's rate made
# the H200 run a 0.5%-active batch dense at 0.97x of the dense FFN, against 1.14x sparse).
HBM_GATHER_BYTES_PER_S = {"H100": 2.6e12, "H200": 4.4e12}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Device rates for choosing between sparse and dense up/down projections.

    Defaults measured on the H100 (bf16, M = 16384): XLA's dense GEMM at ~650 TFLOP/s;
    ``row_up_down`` reads gathered weight rows at ~5.4 TB/s while the two weight matrices fit in
    L2 (D = 2048, F = 5632: 46 MB) and ~2.6 TB/s from HBM (D = 4096, F = 14336; the H200: ~4.4,
    ``hbm_gather_rate``); device memory copies at ~3.0 TB/s; and the sparse path costs ~0.3 ms
    per call whatever the batch (0.26-0.34 ms measured at M = 1). An entry that hot units take
    off the lists saved ~0.64 ns in the forward (M = 16384, 64 units on 85% of the tokens: 1.73
    -> 1.26-1.30 ms) and ~2.7 ns in forward and backward (5.35 -> 2.92-2.95 ms); the hot path's
    small launches cost ~20 us a pass beside its GEMMs.
    """

    gemm_flops_per_s: float = 6.5e14
    gather_bytes_per_s: float = 5.0e12
    # None: the rate measured on this device's kind (``HBM_GATHER_BYTES_PER_S``).
    gather_hbm_bytes_per_s: float | None = None
    l2_bytes: float = 5.0e7  # up and down weights up to this size are gathered from L2 (H100)
    memory_bytes_per_s: float = 3.0e12
    sparse_fixed_seconds: float = 3.0e-4
    decode_gather_bytes_per_s: float = 1.6e12
    decode_dense_density: float = 1 / 16
    few_rows_decode_dense_density: float = 1 / 8
    few_decode_rows: int = NARROW_SLICE_MAX_ROWS
    decode_tail_weight: float = 0.25
    decode_dense_entries_per_unit: float = 1.0
    decode_dense_max_share: float = 0.4
    decode_switch_min_rows: int = 2
    hot_entry_bytes_per_s: float = 1.28e13
    hot_entry_train_bytes_per_s: float = 3.0e12
    hot_fixed_seconds: float = 2.0e-5

    def decode_up_down_seconds(self, d: int, entries, itemsize: int):
        """The decode path's up/down (``scan_up_down``) over ``entries`` active (row, unit)
        pairs: two gathered weight rows of d elements each. Its programs walk few units each:
        ~5 ns a unit at D = 2048 (H100, 1-64 rows), ~1.6 TB/s, a third of the list kernels'
        rate. Busier rows cost more per unit than this rate says (their programs walk many
        units each, one group after another): past ``decode_density_limit`` active units per
        row the walk costs about the dense FFN or more."""
        return entries * 2.0 * d * itemsize / self.decode_gather_bytes_per_s

    def decode_dense_above(self, m: int, f: int) -> int | None:
        """The decode path's dense switch for one call of m rows: the active (row, unit)
        entries past which its dense mode (every unit's up product for all rows, then the down
        by slices: about 1.2-1.4x the dense FFN at D = 2048, 1.05-1.1x at D = 4096) beats
        walking them: ``decode_dense_entries_per_unit`` x F entries, at most
        ``decode_dense_max_share`` of the call's M * F. The walk costs ~1.8 ns an entry at 64
        rows and ~7.6 ns at one row (D = 2048, H200: fewer rows walk with fewer programs), so
        from a few rows on the break-even is about one entry per unit of F.

        None (no switch) below ``decode_switch_min_rows`` rows: one row reads each active
        unit's weight rows once, as the dense products do, so its walk costs at most ~1.4x
        the dense FFN (half its units active, D = 2048; faster than the dense mode at
        D = 4096), while the switch's counting GEMV and extra launch cost every call ~3 us
        (14.3 -> 17.3 us at 0.5% active, H200; docs/performance.md)."""
        if m < self.decode_switch_min_rows:
            return None
        return int(min(self.decode_dense_entries_per_unit, self.decode_dense_max_share * m) * f)

    def decode_row_units(self, nnz_mean, nnz_p99=None):
        """The active units per row that a decode step's up/down costs as if every row held:
        the mean, or ``decode_tail_weight`` x the 99th percentile where that is larger. A
        call waits for its busiest rows' programs, so rows drawn from a heavy-tailed count
        distribution cost more than their mean says: on an H200, 64 rows drawn from our trained
        100m model's counts (mean 41, p99 ~243 of 5632) took 35.8 us against the dense FFN's
        29.7, where the mean alone puts the walk below the dense GEMMs. Uniform rows never
        reach this bound (their p99 stays below four times the mean). Works on traced
        arrays; ``nnz_p99`` None or NaN (not recorded): the mean alone."""
        if nnz_p99 is None:
            return nnz_mean
        return jnp.fmax(nnz_mean, self.decode_tail_weight * jnp.asarray(nnz_p99, jnp.float32))

    def decode_density_limit(self, rows: int) -> float:
        """The share of active units per row past which a decode step of ``rows`` token rows
        runs its FFN dense: ``few_rows_decode_dense_density`` up to ``few_decode_rows`` rows,
        whose decode kernel splits F into narrower slices and so stays ahead of dense to a
        higher density (``scan_up_down``), else ``decode_dense_density`` (measured in
        docs/performance.md, "Generation")."""
        return (self.few_rows_decode_dense_density if rows <= self.few_decode_rows
                else self.decode_dense_density)

    def hot_units_pay(self, m: int, d: int, k: int, moved_entries, itemsize: int,
                      differentiated: bool):
        """[] bool: the ``moved_entries`` (traced) that K hot units take off the lists cost
        the list kernels more than the hot GEMMs and their fixed cost. An entry's two weight
        rows, moved at ``hot_entry_bytes_per_s`` (forward alone) or
        ``hot_entry_train_bytes_per_s`` (forward and backward), against: x read once more,
        y (and in the backward dy, dx) read and written again, 2 (forward) or 6 GEMMs of
        [m, d] x [d, k], and ``hot_fixed_seconds`` per pass."""
        passes = 2.0 if differentiated else 1.0
        rate = self.hot_entry_train_bytes_per_s if differentiated else self.hot_entry_bytes_per_s
        lists = moved_entries * 2.0 * d * itemsize / rate
        gemms = passes * (3.0 * m * d * itemsize / self.memory_bytes_per_s
                          + self.hot_fixed_seconds) + (
            (12.0 if differentiated else 4.0) * m * d * k / self.gemm_flops_per_s)
        return lists > gemms

    def hbm_gather_rate(self, device_kind: str | None = None) -> float:
        """Bytes per second at which ``row_up_down`` gathers weight rows that do not fit in
        the L2: ``gather_hbm_bytes_per_s``, or when None the rate measured on the kind of
        device (``device_kind``, default: JAX's first device; the H100's rate on any kind
        not measured)."""
        if self.gather_hbm_bytes_per_s is not None:
            return self.gather_hbm_bytes_per_s
        kind = jax.devices()[0].device_kind if device_kind is None else device_kind
        for name, rate in HBM_GATHER_BYTES_PER_S.items():
            if name in kind:
                return rate
        return HBM_GATHER_BYTES_PER_S["H100"]

    def dense_ffn_seconds(self, m: int, d: int, f: int, itemsize: int) -> float:
        """The whole dense FFN: three GEMMs' math or their weight reads, whichever is larger."""
        return 1.5 * self.dense_up_down_seconds(m, d, f, itemsize)

    def dense_up_down_seconds(self, m: int, d: int, f: int, itemsize: int) -> float:
        """Two dense GEMMs [m, d] x [d, f]: the larger of their math and weight-read times."""
        return max(4.0 * m * d * f / self.gemm_flops_per_s,
                   2.0 * d * f * itemsize / self.memory_bytes_per_s)

    def sparse_costs_more(self, m: int, d: int, f: int, light_nnz, num_heavy, itemsize: int,
                          margin: float = 1.0):
        """[] bool: the sparse up/down (``sparse_up_down_seconds``) costs more than ``margin``
        x two dense GEMMs of m rows (``dense_up_down_seconds``). Works on traced counts."""
        sparse = self.sparse_up_down_seconds(d, f, light_nnz, num_heavy, itemsize)
        return sparse > margin * self.dense_up_down_seconds(m, d, f, itemsize)

    def sparse_up_down_seconds(self, d: int, f: int, light_nnz, num_heavy, itemsize: int):
        """The sparse up/down: two gathered weight rows of d elements per entry of a light row
        (``light_nnz`` entries in all), plus the dense backup's three GEMMs on ``num_heavy``
        rows (their math or their weight reads, whichever is larger). Works on traced counts."""
        weights = 2.0 * d * f * itemsize
        rate = self.gather_bytes_per_s if weights <= self.l2_bytes else self.hbm_gather_rate()
        backup = jnp.maximum(num_heavy * 6.0 * d * f / self.gemm_flops_per_s,
                             1.5 * weights / self.memory_bytes_per_s)
        return light_nnz * 2.0 * d * itemsize / rate + jnp.where(num_heavy > 0, backup, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TwELLConfig:
    """Knobs of the TwELL + dense-backup (hybrid) format.

    Attributes:
      tile_width: T, FFN columns per tile. It is the gate GEMM's block width: the epilogue
        compacts each row's non-zeros within one [block_m, T] tile. F is padded up to a
        multiple of T internally (padded columns are never active).
      slots_per_tile: S = T / C, stored (value, column) pairs per (row, tile). A row whose
        count exceeds S in any tile is *heavy* and is computed by the dense backup.
        Default 8 of 128 (C = 16): at ~28 active of 5632 units per token a tile holds
        0.64 non-zeros on average and P(count > 8) ~ 1e-9, so uniform rows are never heavy.
      backup_rows: capacity of the dense backup in rows. ``None`` (default): no fixed
        capacity; the backup is sized at run time from static buckets (M/64, M/32, M/16,
        M/8, 3M/16, M/4, 5M/16, M/2), so it costs at most twice the heavy rows' dense work and
        never overflows; past M/2 heavy rows the whole batch goes dense. An int:
        at most that many heavy rows take the backup; if more rows are heavy, the whole
        batch takes the exact dense path and the statistics report ``backup_overflow``.
        Either way the backup's spare rows take the densest light rows (free: its GEMMs
        run at its full size).
      max_row_density: a row with more than ``max_row_density * F`` active units is heavy too,
        even if no tile overflows: such a row is cheaper in the dense backup (dense GEMMs on the
        tensor cores) than as gathered weight rows. On the H100 a gathered non-zero moves two
        4 KB rows (~2 ns at the measured ~4-5 TB/s) while a dense row costs ~0.1 us of GEMM,
        so the break-even is near 60 of 5632 units; the default 1/96 (58 of 5632) keeps every
        uniform ~28-unit token sparse and sends the heavy tail to the backup. (H100, M =
        16384, against 1/64: our trained model's counts -4% forward, -3% forward + backward;
        the heavy-tailed case +9% / +1.3%; uniform rows unchanged.)
        ``1.0`` disables.
      dense_fallback_density: only for ``implementation="pallas"``: when the whole batch is
        cheaper dense, the up/down projections run as dense GEMMs (decided on the device from
        the counts, after the gate). ``None`` (default): decided by ``cost_model`` from the
        light rows' entries and the heavy rows' count (at M = 16384, D = 2048 light rows break
        even near 44 of 5632 units), and, from the shapes alone, the whole call runs dense when the
        sparse path's fixed cost exceeds the dense FFN (decode sizes on the H100). The cost
        model applies only to compiled kernels: in interpret mode (no GPU) the sparse path
        always runs. A float: dense when the mean fraction of active units exceeds it
        (``1.0``: never dense, ``0.0``: always). On the decode path (``decode_rows``) the
        same share of the call's M * F (row, unit) entries switches its up/down to dense
        products, chosen inside its kernels (``CostModel.decode_dense_above`` when None).
      cost_model: the measured device rates behind the ``None`` decision.
      decode_rows: calls of at most this many token rows that are not differentiated (decode
        steps, small batches) run the backend's list-free decode path when it has one
        (``"pallas"``: the gate product on the ``gemv`` kernel (up to 64 rows), then one
        ``scan_up_down`` kernel that walks each row's active units; no packing, no backup, no
        device-side routing). 0 disables it.
      hot_units: K, the most units a batch may take off the lists as *hot* units: units
        active on many of its tokens, computed by a small dense GEMM (``twell_jax.
        hot_units``), found per batch on the device from a sample of rows. 0 (default)
        disables. Turn it on (64) for models with units that fire on most tokens: on the
        H100, 64 units on 85% of the tokens, M = 16384, forward 0.98x -> 1.35x of dense,
        forward + backward 0.83x -> 1.51x. Off by default because its device-side choice
        costs batches without hot units time: the FFN alone 2-3%, a 0.5b prefill under
        the layer scan 1-2.5%.
      hot_unit_rate: a unit is hot when active on at least this share of the sampled rows.
      hot_min_rows: calls of fewer token rows take no hot units (their launches would cost
        more than they save).
    """

    tile_width: int = 128
    slots_per_tile: int = 8
    backup_rows: int | None = None
    max_row_density: float = 1 / 96
    dense_fallback_density: float | None = None
    cost_model: CostModel = dataclasses.field(default_factory=lambda: CostModel())
    decode_rows: int = 64
    hot_units: int = 0
    hot_unit_rate: float = 1 / 32
    hot_min_rows: int = 1024

    def __post_init__(self):
        if not is_power_of_two(self.tile_width) or self.tile_width < 16:
            raise ValueError(f"tile_width must be a power of two >= 16, got {self.tile_width!r}")
        if not is_power_of_two(self.slots_per_tile) or self.slots_per_tile > self.tile_width:
            raise ValueError(
                f"slots_per_tile must be a power of two <= tile_width={self.tile_width}, "
                f"got {self.slots_per_tile!r}"
            )
        if self.backup_rows is not None and (
            not isinstance(self.backup_rows, int) or self.backup_rows < 0
        ):
            raise ValueError(f"backup_rows must be None or an int >= 0, got {self.backup_rows!r}")
        if not isinstance(self.decode_rows, int) or self.decode_rows < 0:
            raise ValueError(f"decode_rows must be an int >= 0, got {self.decode_rows!r}")
        for name in ("hot_units", "hot_min_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not 0.0 < self.hot_unit_rate <= 1.0:
            raise ValueError(f"hot_unit_rate must be in (0, 1], got {self.hot_unit_rate!r}")
        if not 0.0 < self.max_row_density <= 1.0:
            raise ValueError(f"max_row_density must be in (0, 1], got {self.max_row_density!r}")
        if self.dense_fallback_density is not None and not (
                0.0 <= self.dense_fallback_density <= 1.0):
            raise ValueError(
                f"dense_fallback_density must be in [0, 1], got {self.dense_fallback_density!r}"
            )

    @property
    def compression_factor(self) -> int:
        """C = T / S."""
        return self.tile_width // self.slots_per_tile

    def num_tiles(self, d_ff: int) -> int:
        """Column tiles covering ``d_ff`` units (the last one padded)."""
        return -(-d_ff // self.tile_width)

    def cost_model_decides(self, interpret: bool) -> bool:
        """Whether ``cost_model`` routes: no fixed ``dense_fallback_density``, and the kernels
        run compiled (``interpret`` False). Its rates are the device's; in interpret mode (no
        GPU) the sparse kernels always run, so CPU users and CI exercise them."""
        return self.dense_fallback_density is None and not interpret

    def max_row_nnz(self, d_ff: int) -> int:
        """Active units a row may have before it is heavy (at least one full tile's slots)."""
        return max(self.slots_per_tile, int(self.max_row_density * d_ff))

    def row_slots(self, d_ff: int) -> int:
        """K = num_tiles * S: the most packed entries a light row can hold."""
        return self.num_tiles(d_ff) * self.slots_per_tile


DEFAULT_CONFIG = TwELLConfig()

"""Stage-by-stage timing of the sparse FFN's kernels and their variants (H100 probe).

    python tools/bench_stages.py --cases m16k_uniform28 --out runs/stages.jsonl

Times, in one process: the dense FFN as a user writes it (three bf16 GEMMs; the same as plain
``nnx.Linear`` layers), ``implementation="xla"`` and ``"pallas"``, XLA's bare gate GEMM, the
packing pass (``row_pack``) and the up/down kernel (``row_up_down``) with several knob settings
(``--stages forward``), and the backward's dW kernel (``sparse_outer``: one or two values
arrays, [F, D] outputs) with several blocks (``--stages outer``), each
checked before it is timed. One JSON line per measurement; a table last.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from twell_jax.benchmarking import ffn_cases

import twell_jax as tj
from pallas_kernels.row_pack import RowPackConfig, row_pack
from pallas_kernels.row_up_down import (RowUpDownConfig, row_up_down,
                                        row_up_down_reference)
from pallas_kernels.sparse_outer import SparseOuterConfig, sparse_outer

# row_pack (tiles_per_chunk, num_warps, num_stages)
PACK_VARIANTS = [(4, 1, 2), (4, 1, 1), (4, 1, 3), (2, 1, 2), (4, 2, 2), (8, 1, 2)]
UP_DOWN_VARIANTS = [(2048, 4, 1), (2048, 4, 2), (2048, 8, 1), (1024, 4, 1)]
# sparse_outer (block_f, block_d, num_warps, unroll); the default: the first for one values
# array, the second for two (8 units, 8 warps, 2 entries a step); then their
# neighbours.
OUTER_VARIANTS = [(8, 512, 8, 2), (8, 256, 8, 2), (16, 512, 4, 1), (16, 256, 4, 1),
                  (8, 256, 4, 1), (16, 256, 8, 2), (8, 256, 4, 2)]


def run(case_name: str, runs: int, emit, stages: tuple[str, ...] = ("forward",)) -> None:
    case = ffn_cases.CASES[case_name]
    x, wg, wu, wd = ffn_cases.make_case_inputs(case)
    m, d = x.shape
    f = wg.shape[1]
    cfg = tj.TwELLConfig()
    slots = cfg.max_row_nnz(f)
    timing = dict(runs=runs, min_batch_ms=25.0)  # back-to-back calls (ffn_cases.time_ms)
    rows = np.random.default_rng(1).choice(m, min(m, 256), replace=False)

    def measure(stage, label, fn, *args, nbytes=None, y_check=False):
        out = fn(*args)
        err = None
        if y_check:
            err = ffn_cases.rel_error_float64(out, x, wg, wu, wd, rows)
        t = ffn_cases.time_ms(jax.jit(fn), *args, **timing)
        row = {"case": case_name, "stage": stage, "variant": label, **t, "rel_err": err}
        if nbytes:
            row["TB_per_s"] = nbytes / (t["median_ms"] * 1e-3) / 1e12
        emit(row)

    if "outer" in stages:
        outer_variants(case_name, x, wg, cfg, slots, measure, emit)
    if "forward" not in stages:
        return
    dense = lambda x, wg, wu, wd: jnp.dot(jax.nn.relu(jnp.dot(x, wg)) * jnp.dot(x, wu), wd)
    measure("ffn", "dense_bf16_gemms", jax.jit(dense), x, wg, wu, wd, y_check=True)
    measure("ffn", "flax_nnx_linear", jax.jit(ffn_cases.flax_dense_mlp), x, wg, wu, wd)
    for impl in ("xla", "pallas"):
        fn = jax.jit(lambda x, a, b, c, impl=impl: tj.gated_mlp(x, a, b, c, implementation=impl))
        measure("ffn", impl, fn, x, wg, wu, wd, y_check=True)

    gemm = jax.jit(lambda x, w: jnp.dot(x, w))
    pre = gemm(x, wg)
    measure("gate", "xla_gemm_bf16", gemm, x, wg, nbytes=pre.size * 2)
    _, _, counts, total = row_pack(pre, tile_width=cfg.tile_width, num_slots=slots)
    for tiles, warps, stages in PACK_VARIANTS:
        if cfg.num_tiles(f) % tiles:
            continue
        conf = RowPackConfig(tiles_per_chunk=tiles, num_warps=warps, num_stages=stages)
        fn = jax.jit(lambda p, conf=conf: row_pack(p, tile_width=cfg.tile_width,
                                                   num_slots=slots, config=conf))
        got = fn(pre)
        assert np.array_equal(np.asarray(got[3]), np.asarray(total)), conf
        measure("pack", f"t{tiles}_w{warps}_s{stages}", fn, pre, nbytes=pre.size * 2)

    heavy = tj.format.heavy_rows(counts, cfg, f)
    values, columns, _, _ = row_pack(pre, tile_width=cfg.tile_width, num_slots=slots)
    row_nnz = jnp.where(heavy, 0, total)
    values, columns = tj.format.mask_lists(values, columns, row_nnz)
    w_up_t = wu.T
    y_ref, up_ref = jax.jit(row_up_down_reference)(x, w_up_t, wd, values, columns, row_nnz)
    gathered = float(jnp.sum(row_nnz)) * 2 * d * 2
    emit({"case": case_name, "stage": "lists", "heavy_rows": int(heavy.sum()),
          "nnz_mean": float(jnp.mean(total)), "list_slots": slots})
    for block_d, warps, stages in UP_DOWN_VARIANTS:
        if d % block_d:
            continue
        conf = RowUpDownConfig(block_d=block_d, num_warps=warps, num_stages=stages)
        fn = jax.jit(lambda *a, conf=conf: row_up_down(*a, config=conf))
        y, up = fn(x, w_up_t, wd, values, columns, row_nnz)
        err = float(jnp.linalg.norm((y - y_ref).astype(jnp.float32))
                    / jnp.linalg.norm(y_ref.astype(jnp.float32)))
        assert err < 1e-2 and bool(jnp.all(jnp.isfinite(up))), (conf, err)
        measure("up_down", f"d{block_d}_w{warps}_s{stages}", fn, x, w_up_t, wd, values,
                columns, row_nnz, nbytes=gathered)

    def composed(x, wg, w_up_t, wd):
        pre = jnp.dot(x, wg)
        v, c, cnt, tot = row_pack(pre, tile_width=cfg.tile_width, num_slots=slots)
        nnz = jnp.where(tj.format.heavy_rows(cnt, cfg, f), 0, tot)
        return row_up_down(x, w_up_t, wd, v, c, nnz)[0]

    measure("ffn", "gemm+row_pack+row_up_down (light rows only)", jax.jit(composed), x, wg,
            w_up_t, wd)


def outer_variants(case_name, x, wg, cfg, slots, measure, emit) -> None:
    """``sparse_outer`` as the backward runs it: dW_down from one values array against dy
    (``n1``), dW_gate and dW_up from two against x (``n2``), [F, D] outputs; each variant
    checked against the default blocks' result."""
    m, d = x.shape
    f = wg.shape[1]
    pre = jnp.dot(x, wg)
    values, columns, counts, total = row_pack(pre, tile_width=cfg.tile_width, num_slots=slots)
    row_nnz = jnp.where(tj.format.heavy_rows(counts, cfg, f), 0, total)
    values, columns = tj.format.mask_lists(values, columns, row_nnz)
    second = values.astype(jnp.float32) * 0.5 + 1.0  # a second values array on the pattern
    entries = float(jnp.sum(row_nnz))
    emit({"case": case_name, "stage": "outer_lists", "entries": entries})
    for n in (1, 2):
        vals = (values.astype(jnp.float32), second)[:n]
        want = jax.jit(lambda v, c, r, b: sparse_outer(v, c, r, b, f))(vals, columns, row_nnz, x)
        for bf, bd, warps, unroll in OUTER_VARIANTS:
            if f % bf or d % bd:  # blocks that do not divide this case's shape
                continue
            conf = SparseOuterConfig(block_f=bf, block_d=bd, num_warps=warps, unroll=unroll)
            fn = jax.jit(lambda v, c, r, b, conf=conf: sparse_outer(v, c, r, b, f, config=conf))
            got = fn(vals, columns, row_nnz, x)
            for g, w in zip(got, want):
                assert bool(jnp.allclose(g, w, rtol=1e-5, atol=1e-5)), conf
            # gathered rows of b (bf16) + the [F, D] float32 outputs written
            nbytes = entries * d * 2 + n * f * d * 4
            measure("outer", f"n{n}_FxD_f{bf}_d{bd}_w{warps}_u{unroll}", fn, vals, columns,
                    row_nnz, x, nbytes=nbytes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="m16k_uniform28", help="comma list of bench_ffn cases")
    parser.add_argument("--runs", type=int, default=30, help="timed batches (median reported)")
    parser.add_argument("--stages", default="forward",
                        help="comma list: forward (pack, up/down), outer (the backward's dW)")
    parser.add_argument("--out", default="runs/stages.jsonl", help="JSON lines, appended")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows = []

    def emit(row):
        rows.append(row)
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    for name in args.cases.split(","):
        run(name, args.runs, emit, tuple(args.stages.split(",")))
    print(f"\n{'case':18} {'stage':8} {'variant':44} {'ms':>7} {'TB/s':>6} {'err':>8}")
    for r in rows:
        if "median_ms" in r:
            tb = f"{r['TB_per_s']:.2f}" if "TB_per_s" in r else ""
            err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else ""
            print(f"{r['case']:18} {r['stage']:8} {r['variant']:44} {r['median_ms']:7.3f} "
                  f"{tb:>6} {err:>8}")


if __name__ == "__main__":
    main()

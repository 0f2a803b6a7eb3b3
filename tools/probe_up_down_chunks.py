"""GPU probe: the up/down over F in chunks whose W_up / W_down slices fit the L2.

``row_up_down`` walks each token row's list over all of F, so when W_up and W_down overflow the
L2 (D = 4096, F = 14336: 235 MB against 50 MB) its gathers run at HBM speed. Here the lists are
split by XLA into ``C`` chunks of F (a row's entries are in column order, so each chunk's are a
contiguous run of its list) and each chunk runs as one ``row_up_down`` launch over all rows, its
float32 output summed after: within a launch only that chunk's weight rows are read. For each
case it times, in one process, the plain dense FFN, XLA's gate GEMM, ``row_up_down`` on the
whole lists, the chunked form for each ``C`` (checked against the whole-list output first:
y, the up values and the L1 statistic), the chunk split alone, and the public op
(``"xla"``, ``"pallas"``, and ``"pallas"`` with the sparse route forced). One JSON line each,
a table last.

    python tools/probe_up_down_chunks.py --cases wide_m16k_uniform,wide_m16k_uniform28 \\
        --chunks 2,3,4,6,8 --out runs/up_down_chunks.jsonl
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import twell_jax as tj
from pallas_kernels.row_pack import row_pack
from pallas_kernels.row_up_down import row_up_down
from twell_jax import cli
from twell_jax.benchmarking import ffn_cases


def split_lists(values, columns, row_nnz, d_ff: int, num_chunks: int):
    """Per chunk of ``ceil(F / C)`` units: (values [M, K], columns [M, K], row_nnz [M]) of the
    entries in it, and the chunk of each entry [M, K] (C past a row's count) with each chunk's
    first slot [M, C]. Relies on each row's valid entries being in column order."""
    m, k = columns.shape
    width = -(-d_ff // num_chunks)
    slot = jnp.arange(k, dtype=jnp.int32)
    valid = slot[None, :] < jnp.clip(row_nnz, 0, k)[:, None]
    chunk = jnp.where(valid, columns // width, num_chunks)
    counts = jnp.sum(chunk[:, :, None] == jnp.arange(num_chunks), axis=1, dtype=jnp.int32)
    starts = jnp.cumsum(counts, axis=1) - counts
    parts = []
    for c in range(num_chunks):
        index = jnp.minimum(starts[:, c:c + 1] + slot[None], k - 1)
        parts.append((jnp.take_along_axis(values, index, 1),
                      jnp.take_along_axis(columns, index, 1), counts[:, c]))
    return parts, chunk, starts


def chunked_up_down(x, w_up_t, w_down, values, columns, row_nnz, num_chunks: int):
    """``row_up_down``'s (y, up, l1), one launch per chunk of F (``split_lists``)."""
    k = columns.shape[1]
    parts, chunk, starts = split_lists(values, columns, row_nnz, w_down.shape[0], num_chunks)
    outs = [row_up_down(x, w_up_t, w_down, *part, out_dtype=jnp.float32) for part in parts]
    y = sum(o[0] for o in outs)
    l1 = sum(o[2] for o in outs)
    # Each entry's up value back in its own slot.
    stacked = jnp.concatenate([o[1] for o in outs], axis=1)  # [M, C * K]
    owner = jnp.minimum(chunk, num_chunks - 1)
    offset = jnp.arange(k, dtype=jnp.int32)[None] - jnp.take_along_axis(starts, owner, 1)
    up = jnp.take_along_axis(stacked, owner * k + jnp.clip(offset, 0, k - 1), 1)
    return y.astype(x.dtype), jnp.where(chunk < num_chunks, up, 0.0), l1


def run_case(name: str, chunk_counts, runs: int, emit) -> list[tuple]:
    cfg = tj.TwELLConfig()
    timing = dict(runs=runs, min_batch_ms=25.0)
    x, wg, wu, wd = ffn_cases.make_case_inputs(ffn_cases.CASES[name])
    d, f = wg.shape
    pre = jnp.dot(x, wg)
    values, columns, counts, total = row_pack(pre, tile_width=cfg.tile_width,
                                              num_slots=cfg.max_row_nnz(f))
    heavy = tj.format.heavy_rows(counts, cfg, f)
    row_nnz = jnp.where(heavy, 0, total)
    values, columns = tj.format.mask_lists(values, columns, row_nnz)
    w_up_t = jnp.asarray(wu.T)
    del pre
    gathered = float(jnp.sum(row_nnz)) * 2 * d * 2
    emit({"case": name, "stage": "lists", "nnz_mean": float(jnp.mean(total)),
          "nnz_p99": float(jnp.percentile(total, 99)), "heavy_rows": int(heavy.sum()),
          "weights_MB": 2 * d * f * 2 / 1e6})
    table = []

    def measure(label, fn, *args, nbytes=None):
        t = ffn_cases.time_ms(jax.jit(fn), *args, **timing)
        row = {"case": name, "variant": label, **t}
        if nbytes:
            row["TB_per_s"] = nbytes / (t["median_ms"] * 1e-3) / 1e12
        emit(row)
        table.append((name, label, t["median_ms"], row.get("TB_per_s")))

    lists = (values, columns, row_nnz)
    measure("dense_flax", ffn_cases.flax_dense_mlp, x, wg, wu, wd)
    measure("gate_gemm", lambda x, w: jnp.dot(x, w), x, wg)
    y0, up0, l0 = jax.jit(row_up_down)(x, w_up_t, wd, *lists)
    measure("up_down_C1", row_up_down, x, w_up_t, wd, *lists, nbytes=gathered)
    for c in chunk_counts:
        y, up, l1 = jax.jit(chunked_up_down, static_argnums=6)(x, w_up_t, wd, *lists, c)
        f32 = lambda a: a.astype(jnp.float32)
        emit({"case": name, "variant": f"check_C{c}",
              "rel_err_y": float(jnp.linalg.norm(f32(y) - f32(y0)) / jnp.linalg.norm(f32(y0))),
              "max_err_up": float(jnp.max(jnp.abs(up - up0))),
              "max_rel_err_l1": float(jnp.max(jnp.abs(l1 - l0) / (jnp.abs(l0) + 1e-6))),
              "finite": bool(jnp.all(jnp.isfinite(y)))})
        measure(f"up_down_C{c}", lambda *a, c=c: chunked_up_down(*a, c), x, w_up_t, wd, *lists,
                nbytes=gathered)
        measure(f"split_only_C{c}", lambda *a, c=c: split_lists(*a, f, c)[0], *lists)
    weights = tj.prepare_weights(wg, wu, wd)
    forced = tj.TwELLConfig(dense_fallback_density=1.0)
    for label, impl, conf in (("op_xla", "xla", None), ("op_pallas", "pallas", None),
                              ("op_pallas_forced_sparse", "pallas", forced)):
        measure(label, lambda x, w, impl=impl, conf=conf: tj.feed_forward(
            x, w, implementation=impl, config=conf), x, weights)
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="wide_m16k_uniform,wide_m16k_uniform28,m16k_uniform28")
    parser.add_argument("--chunks", default="2,3,4,6,8", help="chunk counts C to time")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default="runs/up_down_chunks.jsonl")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "a") as out:
        def emit(row):
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)

        emit(cli.header("tools/probe_up_down_chunks.py", args=vars(args)))
        table = []
        for name in args.cases.split(","):
            table += run_case(name, [int(c) for c in args.chunks.split(",")], args.runs, emit)
    print("\ncase | variant | ms | TB/s")
    for name, label, ms, rate in table:
        print(f"{name} | {label} | {ms:.3f} | {'' if rate is None else f'{rate:.2f}'}")


if __name__ == "__main__":
    main()

"""GPU probe: decode-sized products ``x @ w + bias`` (the FFN gate; ``--f 2048``: an attention
projection) timed three ways.

For M in ``--ms`` (default 1, 8, 64) rows, D = ``--d`` (2048), F = ``--f`` (5632), bf16 (23 MB
of weights at the defaults), bias a threshold (about 0.5% of the outputs positive), it times

* ``xla gate_pre_activation``: ``twell_jax.dense.gate_pre_activation`` (the current path: XLA's
  dot with a float32 output, the bias added before one rounding to bf16);
* ``xla jnp.dot f32``: a plain ``jnp.dot(x, w, preferred_element_type=float32)``;
* ``xla jnp.dot bf16 + bias``: as a plain Flax layer (bf16 product, then the bias in bf16);
* ``xla jnp.dot f32, barrier, + bias``: gate_pre_activation's numerics, the product kept out
  of a fusion with the bias add;
* ``gemv ...``: ``pallas_kernels.gemv`` under several configs (the default first, then
  a sweep of column blocks, D steps, D splits, warps and stages);
* ``loop overhead``: the same loop with an identity in place of the product.

Each variant's largest error max|out - ref| / max|ref| is checked against a float32 HIGHEST
reference first (bf16 output rounding alone gives ~2e-3). Timing: at these sizes one call
from Python times the host's dispatch (~35 us), so each variant runs inside one jitted
``fori_loop`` of 100 steps, each calling it on 4 different weight matrices in turn (92 MB: no
matrix stays in the 50 MB L2 between its calls), each call's x being x + 0 * the running sum
of the outputs (not folded for floats: no call is hoisted or dropped). Per call = median over
10 timed loops / (4 * 100 calls), the loop's glue (the identity's time) included. A variant
that fails to compile or run is recorded with its error; the sweep goes on. Sweep configs past
their M's share of ``--budget-s`` are recorded as skipped.

    python tools/probe_gemv.py               # H100, ~1-2 minutes
    python tools/probe_gemv.py --unit-rows   # weights stored [F, D], as the FFN's gate reads
    python tools/probe_gemv.py --smoke       # CPU, interpret mode, tiny shapes

Without ``--unit-rows`` the weights are [D, F], the attention projections' layout. Rows go to
``$OUT/gemv_probe_{D}x{F}.jsonl`` (``..._unit_rows.jsonl`` with ``--unit-rows``; the current
directory when $OUT is unset); a table is printed last.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # the budget counts the imports too

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gemv import GemvConfig, default_gemv_config, gemv
from twell_jax.dense import gate_pre_activation

LAYERS = 4
THRESHOLD = 2.576  # P(N(0, 1) > 2.576) = 0.5%


def cfg(block_f, block_k, k_splits, num_warps=4, num_stages=3) -> GemvConfig:
    return GemvConfig(block_f=block_f, block_k=block_k, k_splits=k_splits, num_warps=num_warps,
                      num_stages=num_stages)


# Per M: configs worth a try at D = 2048, F = 5632 (44 column blocks of 128; 32 D steps of 64).
# The default config of each M is timed first, separately. (A broadcast product on the CUDA
# cores is not swept: it was slower at every size on the H100.)
SWEEP = {
    1: [cfg(128, 64, 1),                   # no split: 44 programs (what the splits are worth)
        cfg(128, 64, 4, 4, 4),
        cfg(64, 128, 4, 4, 4),
        cfg(128, 32, 16),
        cfg(256, 64, 8, 8, 3),
        cfg(128, 128, 8, 8, 2)],
    8: [cfg(128, 64, 8),
        cfg(64, 64, 4),
        cfg(128, 128, 4),
        cfg(256, 64, 8, 8, 3),
        cfg(64, 128, 2, 4, 4),
        cfg(128, 32, 8, 4, 4),
        cfg(128, 64, 4, 4, 2)],
    64: [cfg(64, 64, 1),                   # no split, one launch: 88 programs
         cfg(32, 64, 1),                   # 176 programs
         cfg(32, 128, 1, 4, 4),
         cfg(128, 64, 2, 8, 3),
         cfg(64, 64, 4),
         cfg(16, 128, 1, 2, 4),            # 352 programs, 32-byte tile rows
         cfg(64, 32, 1, 4, 5),
         cfg(128, 64, 1, 8, 4)],
}


def describe(config: GemvConfig) -> str:
    return (f"bf{config.block_f} bk{config.block_k} s{config.k_splits} "
            f"w{config.num_warps} st{config.num_stages}")


def decode_loop(fn, steps: int, d: int, f: int):
    """Jitted loop: ``steps`` steps, each calling ``fn(x_i, w, b)`` for the LAYERS weight sets
    in turn; x_i = x + 0 * (running sum of outputs)[:, :d], so each call waits for the last."""
    width = min(d, f)

    def run(x, weights, biases):
        def step(_, acc):
            for w, b in zip(weights, biases):
                xi = x.astype(jnp.float32).at[:, :width].add(0.0 * acc[:, :width])
                acc = acc + fn(xi.astype(x.dtype), w, b).astype(jnp.float32)
            return acc
        return jax.lax.fori_loop(0, steps, step, jnp.zeros((x.shape[0], f), jnp.float32))
    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check: interpret mode, tiny shapes, 2 steps, 2 timed loops")
    parser.add_argument("--budget-s", type=float, default=125.0,
                        help="seconds for the whole run: each M gets an equal share; sweep "
                        "configs starting after their M's share are skipped (the XLA "
                        "baselines, the default config and the identity always run)")
    parser.add_argument("--d", type=int, default=2048, help="contraction length D")
    parser.add_argument("--f", type=int, default=5632,
                        help="output width F (2048: an attention projection)")
    parser.add_argument("--ms", default="1,8,64", help="comma list of row counts M")
    parser.add_argument("--unit-rows", action="store_true",
                        help="weights stored [F, D] (the FFN gate's layout) instead of [D, F] "
                        "(the attention projections')")
    args = parser.parse_args()
    ms = tuple(int(v) for v in args.ms.split(","))
    if args.smoke:
        d, f, steps, runs = 96, 320, 2, 2
    else:
        d, f, steps, runs = args.d, args.f, 100, 10
    interpret = args.smoke or jax.default_backend() != "gpu"
    out_dir = os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    layout = "_unit_rows" if args.unit_rows else ""
    out_path = os.path.join(out_dir, f"gemv_probe_{d}x{f}{layout}.jsonl")
    calls = LAYERS * steps
    weight_bytes = d * f * 2
    stored = "[F, D]" if args.unit_rows else "[D, F]"
    print(f"# probe_gemv: device {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"D={d} F={f} bf16 stored {stored}, {steps} steps x {LAYERS} weight sets per loop, "
          f"median of {runs} loops, interpret={interpret}", flush=True)

    key = jax.random.PRNGKey(0)
    keys = jax.random.split(key, 2 * LAYERS + 1)
    unit_rows = args.unit_rows
    shape = (f, d) if unit_rows else (d, f)
    weights = tuple((jax.random.normal(keys[i], shape, jnp.float32) / np.sqrt(d))
                    .astype(jnp.bfloat16) for i in range(LAYERS))
    # XLA's variants take w as [D, F] (gate_pre_activation as [F, D]); the transposes fold
    # into the dot.
    as_dxf = (lambda w: w.T) if unit_rows else (lambda w: w)
    as_fxd = (lambda w: w) if unit_rows else (lambda w: w.T)
    biases = tuple(-THRESHOLD + 0.1 * jax.random.normal(keys[LAYERS + i], (f,), jnp.float32)
                   for i in range(LAYERS))
    rows: list[dict] = []
    sink = open(out_path, "w")

    def emit(row: dict) -> None:
        rows.append(row)
        sink.write(json.dumps(row) + "\n")
        sink.flush()
        status = row.get("error") or row.get("skipped") or (
            f"{row['us']:.2f} us, {row['gbps']:.0f} GB/s"
            + (f", rel err {row['rel_err']:.2e}" if "rel_err" in row else ""))
        print(f"M={row['m']:>2} {row['variant']:<40} {status}", flush=True)

    for i_m, m in enumerate(ms):
        deadline = T_START + args.budget_s * (i_m + 1) / len(ms)
        x = jax.random.normal(keys[-1], (m, d), jnp.float32).astype(jnp.bfloat16)
        dot = np.asarray(jnp.dot(x, as_dxf(weights[0]), preferred_element_type=jnp.float32,
                                 precision=jax.lax.Precision.HIGHEST), np.float64)
        refs = {True: dot + np.asarray(biases[0], np.float64), False: dot}
        variants = [  # (name, fn(x, w, b), config, adds the bias)
            ("xla gate_pre_activation",  # takes [F, D]
             lambda x, w, b: gate_pre_activation(x, as_fxd(w), b), None, True),
            ("xla jnp.dot f32 (no bias)",
             lambda x, w, b: jnp.dot(x, as_dxf(w), preferred_element_type=jnp.float32), None,
             False),
            # As a plain Flax layer computes it: bf16 product, bf16 bias add (two roundings).
            ("xla jnp.dot bf16 + bias (Flax)",
             lambda x, w, b: jnp.dot(x, as_dxf(w)) + b.astype(x.dtype), None, True),
            # gate_pre_activation's numerics with the product kept out of a fusion with the
            # bias add (XLA may then pick cuBLAS for the float32-output product).
            ("xla jnp.dot f32, barrier, + bias",
             lambda x, w, b: (jax.lax.optimization_barrier(
                 jnp.dot(x, as_dxf(w), preferred_element_type=jnp.float32)) + b
                 ).astype(x.dtype), None, True),
        ]
        default = default_gemv_config(m, d, f)
        sweep = [c for c in SWEEP.get(m, []) if c.block_f <= f]
        for i, config in enumerate([default] + sweep):
            name = ("gemv default " if i == 0 else "gemv ") + describe(config)
            fn = (lambda c: lambda x, w, b: gemv(x, w, b, config=c, unit_rows=unit_rows,
                                                      interpret=interpret))(config)
            variants.append((name, fn, config, True))
        variants.append(("loop overhead (identity)",
                         lambda x, w, b: jnp.pad(x, ((0, 0), (0, f - d))) if f > d else x[:, :f],
                         None, None))

        for name, fn, config, biased in variants:
            row = {"m": m, "d": d, "f": f, "variant": name}
            if config is not None:
                row["config"] = {k: getattr(config, k) for k in
                                 ("block_f", "block_k", "k_splits", "num_warps",
                                  "num_stages")}
                row["programs"] = -(-f // config.block_f) * config.k_splits
            optional = config is not None and "default" not in name
            if optional and time.perf_counter() > deadline:
                row["skipped"] = f"M={m}'s share of the {args.budget_s:.0f} s budget spent"
                emit(row)
                continue
            try:
                t0 = time.perf_counter()
                if biased is not None:
                    got = np.asarray(jax.jit(fn)(x, weights[0], biases[0]), np.float64)
                    ref = refs[biased]
                    row["rel_err"] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                loop = decode_loop(fn, steps, d, f)
                jax.block_until_ready(loop(x, weights, biases))  # compile
                row["compile_s"] = round(time.perf_counter() - t0, 2)
                jax.block_until_ready(loop(x, weights, biases))  # warm
                samples = []
                for _ in range(runs):
                    t0 = time.perf_counter()
                    jax.block_until_ready(loop(x, weights, biases))
                    samples.append(time.perf_counter() - t0)
                row["us"] = float(np.median(samples)) / calls * 1e6
                row["us_min"] = float(np.min(samples)) / calls * 1e6
                row["gbps"] = weight_bytes / (row["us"] * 1e-6) / 1e9
            except Exception as e:  # a config that fails to compile is a result too
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            emit(row)
    sink.close()

    print(f"\n# per call (median loop / {calls}), weight bytes {weight_bytes / 1e6:.1f} MB; "
          f"{time.perf_counter() - T_START:.0f} s in all; rows in {out_path}")
    print(f"{'variant':<44} {'M':>3} {'us':>8} {'GB/s':>7} {'rel err':>9}")
    for row in rows:
        if "us" in row:
            err = f"{row['rel_err']:.2e}" if "rel_err" in row else "-"
            print(f"{row['variant']:<44} {row['m']:>3} {row['us']:>8.2f} {row['gbps']:>7.0f} "
                  f"{err:>9}")
        else:
            print(f"{row['variant']:<44} {row['m']:>3} "
                  f"{'FAILED' if 'error' in row else 'skipped':>8}")


if __name__ == "__main__":
    main()

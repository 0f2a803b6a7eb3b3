"""FFN forward benchmark: TwELL ("pallas") against dense XLA, in one process.

On a laptop CPU (interpret mode, tiny shapes, about a minute):

    python experiments/bench_ffn.py --suite smoke

On the H100 (the numbers in docs/performance.md):

    python experiments/bench_ffn.py --suite paper --out runs/bench_ffn.jsonl
    python experiments/bench_ffn.py --suite training --backward   # forward + backward
    python experiments/bench_ffn.py --suite training --backward --weights-dtype float32
                                          # float32 master weights, as the models hold them

With ``--backward`` each case times forward + backward instead (all four gradients against a
random cotangent, dense XLA and the sparse path), checks every gradient against a float32
HIGHEST-precision dense reference, and reports the bytes each path saves for the backward
(``saved_residuals``; inputs excluded), then the backward's kernels alone (``row_backward``,
both ``sparse_outer`` calls) with the bytes they read and their rates.

For each case (shape x sparsity pattern) it checks both paths against float64 (numpy, on a sample
of rows, heavy rows included) before timing, then times the jitted forwards: median over
``--runs`` batches after warm-up, each batch ~25 ms of calls queued back to back and
synchronised once with ``block_until_ready`` (``time_ms``; a lone call's latency beside it).
The sparse path gets its weights stored [F, D], one row per unit, made once
(``twell_jax.prepare_weights``), as the layers store them; the dense ``"xla"`` path is timed on
the Flax layout (the ratios' baseline) and on [F, D]. Beside them it times three plain bf16
``nnx.Linear`` layers (a user's dense FFN), and the stages alone (XLA's gate GEMM,
``row_pack``, ``row_up_down``) with bytes and rates, so a missed target can be traced to a
stage (knob sweeps: ``tools/bench_stages.py``).
Decode sizes (M <= ``decode_rows``, forward only) are timed per call inside an on-device loop
over 4 layers' weights (``decode_loop``): one call from Python would time the host's dispatch.
Sparsity statistics per case: mean / p99 / max active units per token, fraction of (row, tile)
pairs over S, heavy rows. One JSON line per measurement goes to ``--out``; a table is printed last.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from twell_jax import cli
from twell_jax.cli import flag

import twell_jax as tj
from pallas_kernels.row_backward import row_backward
from pallas_kernels.row_pack import row_pack
from pallas_kernels.row_up_down import row_up_down
from pallas_kernels.sparse_outer import sparse_outer
from pallas_kernels.scan_up_down import scan_up_down
from twell_jax.format import heavy_rows, mask_lists
from twell_jax.benchmarking.ffn_cases import (CASES, Case, SUITES, decode_loop, flax_dense_mlp,
                                              make_case_inputs, rel_error_float64,
                                              sparsity_stats, time_ms, unrolled_calls)


@dataclasses.dataclass(frozen=True)
class BenchArgs:
    suite: str = flag("smoke", "smoke (CPU, tiny), paper (H100: the paper's shapes) or a "
                      "comma list of case names")
    runs: int = flag(50, "timed batches per measurement; the median is reported")
    min_batch_ms: float = flag(25.0, "each timed batch queues the call back to back until it "
                               "lasts at least this long (time_ms)")
    check_rows: int = flag(512, "rows compared against the float64 reference before timing")
    backward: bool = flag(False, "time forward + backward (all four gradients) instead of the "
                          "forward alone")
    weights_dtype: str = flag("bfloat16", "dtype of the weights passed to the FFNs (x is bf16): "
                              "float32 for master weights, as the models hold them",
                              choices=("bfloat16", "float32"))
    hot_units: int = flag(tj.TwELLConfig().hot_units, "TwELLConfig.hot_units: the most units "
                          "a batch may move to the hot GEMMs (0: none)")
    out: str = flag("runs/bench_ffn.jsonl", "JSON-lines file the measurements are appended to")


# ----------------------------------------------------------------------------------------
# Inputs with controlled sparsity (the bias trick: x[:, -1] = 1, w_gate[-1] = -threshold).


# ----------------------------------------------------------------------------------------
# Checking and timing.


def _check_rows(m: int, heavy_mask: np.ndarray, n: int, rng) -> np.ndarray:
    n = min(n, m)
    heavy = np.nonzero(heavy_mask)[0][: n // 4]
    rest = rng.choice(m, n - len(heavy), replace=False)
    return np.unique(np.concatenate([heavy, rest]))


def _record(case: Case, label: str, results: list[dict], emit: Callable,
            measure_into: Callable[[dict], None], kind: str = "time", **extra) -> dict:
    """One timing row: ``measure_into(row)`` fills it (a failure is reported in the row, never
    hidden); its speedup is against ``results[0]``, the dense XLA FFN. Emitted and appended."""
    row = {"case": case.name, "kind": kind, "label": label, **extra}
    try:
        measure_into(row)
        base = results[0] if results else row
        if "median_ms" in base:
            row["speedup_vs_xla"] = base["median_ms"] / row["median_ms"]
    except Exception as e:  # a failing variant is reported, never hidden
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    emit(row)
    results.append(row)
    return row


DECODE_LAYERS, DECODE_STEPS = 4, 100
UNROLLED_SETS = 8


def run_decode_case(case: Case, args: BenchArgs, config: tj.TwELLConfig,
                    emit: Callable) -> list[dict]:
    """M <= 64: every variant timed per call inside an on-device loop over 4 layers' weights
    (``decode_loop``); "loop overhead" is the same loop with an identity FFN."""
    x, w_gate, w_up, w_down = make_case_inputs(case)
    stats, _ = sparsity_stats(x, w_gate, config)
    emit({"case": case.name, "kind": "sparsity", **stats})
    layers = [make_case_inputs(case, seed=seed)[1:] for seed in range(DECODE_LAYERS)]
    layers_t = [(g, u.T, d) for g, u, d in layers]  # w_up stored [F, D], as the kernel reads
    rows = np.arange(case.m)
    results = []

    def measure(label, fn, weight_sets, check=True):
        def measure_into(row):
            if check:
                row["rel_err"] = rel_error_float64(fn(x, *weight_sets[0]), x, w_gate, w_up,
                                                   w_down, rows)
            t = time_ms(decode_loop(fn, DECODE_STEPS), x, weight_sets, runs=args.runs,
                        min_batch_ms=1.0)
            calls = DECODE_STEPS * DECODE_LAYERS
            t.pop("latency_ms")  # of the whole loop: not a call's
            row.update({k: (v / calls if k.endswith("_ms") else v) for k, v in t.items()})

        _record(case, label, results, emit, measure_into,
                timed=f"per call, on-device loop of {DECODE_STEPS} x {DECODE_LAYERS} layers")

    op = lambda impl: (lambda x, *w: tj.gated_mlp(x, *w, implementation=impl, config=config))
    # The sparse FFN on weights stored [F, D], made once (as the layers store them).
    prepared = lambda impl: (lambda x, *w: tj.feed_forward(
        x, tj.FFNWeights(*w), implementation=impl, config=config))
    op_layers = [op_weights(args, *weights) for weights in layers]
    unit_rows = [tuple(tj.prepare_weights(*weights)) for weights in op_layers]
    measure("xla dense FFN", op("xla"), op_layers)
    measure("xla dense FFN, weights [F, D]", prepared("xla"), unit_rows)
    measure("pallas TwELL FFN", prepared("pallas"), unit_rows)
    measure("flax: three bf16 nnx.Linear layers", flax_dense_mlp, op_layers)
    measure("stage: xla gate GEMM (x @ w_gate, bf16 out)",
            lambda x, g, u, d: jnp.dot(x, g)[:, :x.shape[1]], layers, check=False)
    measure("stage: gate GEMM + scan_up_down (w_up stored [F, D])",
            lambda x, g, ut, d: scan_up_down(jnp.dot(x, g), x, ut, d)[0], layers_t)
    measure("loop overhead (identity FFN)", lambda x, *w: x, layers, check=False)

    # The same calls unrolled over distinct weight sets: what a per-call transpose costs.
    flax_sets = [op_weights(args, *make_case_inputs(case, seed=seed)[1:])
                 for seed in range(UNROLLED_SETS)]
    rows_sets = [tuple(tj.prepare_weights(*weights)) for weights in flax_sets]

    def measure_unrolled(label, fn, sets):
        def measure_into(row):
            # Set 0 holds the case's weights (seed 0), in either layout.
            row["rel_err"] = rel_error_float64(jax.jit(fn)(x, *sets[0]), x, w_gate, w_up,
                                               w_down, rows)
            t = time_ms(unrolled_calls(fn), x, sets, runs=args.runs, min_batch_ms=5.0)
            t.pop("latency_ms")
            row.update({k: (v / UNROLLED_SETS if k.endswith("_ms") else v) for k, v in t.items()})
        _record(case, label, results, emit, measure_into,
                timed=f"per call, {UNROLLED_SETS} weight sets unrolled in one jit")

    measure_unrolled("unrolled: flax: three bf16 nnx.Linear layers", flax_dense_mlp, flax_sets)
    measure_unrolled("unrolled: pallas TwELL FFN", prepared("pallas"), rows_sets)
    measure_unrolled("unrolled: pallas TwELL FFN on the Flax layout (gated_mlp)", op("pallas"),
                     flax_sets)
    return results


def run_case(case: Case, args: BenchArgs, config: tj.TwELLConfig, emit: Callable) -> list[dict]:
    if case.m <= config.decode_rows and not args.backward:
        return run_decode_case(case, args, config, emit)
    x, w_gate, w_up, w_down = make_case_inputs(case)
    stats, heavy_mask = sparsity_stats(x, w_gate, config)
    emit({"case": case.name, "kind": "sparsity", **stats})
    rng = np.random.default_rng(1)
    rows = _check_rows(case.m, heavy_mask, args.check_rows, rng)
    timing = dict(runs=args.runs, min_batch_ms=args.min_batch_ms)
    results = []

    def measure(label, fn, *fn_args, check=True, **extra):
        def measure_into(row):
            if check:
                y = fn(*fn_args)
                y = y[0] if isinstance(y, tuple) else y
                row["rel_err"] = rel_error_float64(y, x, w_gate, w_up, w_down, rows)
            row.update(time_ms(fn, *fn_args, **timing))
            if "bytes" in row:  # a stage's bytes moved: its rate
                row["TB_per_s"] = row["bytes"] / row["median_ms"] / 1e9

        return _record(case, label, results, emit, measure_into, **extra)

    # Both FFN rows compute y alone, as a plain Flax MLP does: the ratio compares like with
    # like. The statistics are timed beside them, on both paths: they cost a pass over the
    # [M, F] activity on the dense path, and on the sparse one where it made no lists
    # (0.12-0.19 ms at 2% uniform on the H100).
    # The sparse FFN gets its weights stored [F, D], made once, as the layers store them
    # (``tj.prepare_weights``); the dense rows both layouts.
    ffn = lambda implementation, stats, cfg=config: jax.jit(lambda x, *w: tj.feed_forward(
        x, tj.FFNWeights(*w), implementation=implementation, config=cfg, return_stats=stats))
    weights = op_weights(args, w_gate, w_up, w_down)
    unit_rows = tuple(tj.prepare_weights(*weights))
    sparse_with_stats = ffn("pallas", True)
    sparse_stats = sparse_with_stats(x, *unit_rows)[1]
    fallback = bool(sparse_stats.dense_fallback)
    plain = jax.jit(lambda *a: tj.gated_mlp(*a, implementation="xla", config=config))
    measure("xla dense FFN", plain, x, *weights)
    measure("pallas TwELL FFN", ffn("pallas", False), x, *unit_rows, fallback=fallback,
            hot_units=int(sparse_stats.hot_units))
    measure("xla dense FFN, weights [F, D]", ffn("xla", False), x, *unit_rows)
    measure("xla dense FFN, with statistics", ffn("xla", True), x, *unit_rows)
    measure("pallas TwELL FFN, with statistics", sparse_with_stats, x, *unit_rows,
            fallback=fallback)
    no_switch = dataclasses.replace(config, dense_fallback_density=1.0)
    measure("pallas TwELL FFN, sparse forced", ffn("pallas", False, no_switch), x, *unit_rows)
    flax_mlp = jax.jit(lambda *a: flax_dense_mlp(*a))
    measure("flax: three bf16 nnx.Linear layers", flax_mlp, x, *weights)

    # Stages alone (knob sweeps: tools/bench_stages.py).
    mm = jax.jit(lambda a, b: jnp.dot(a, b))
    measure("stage: xla gate GEMM (x @ w_gate, bf16 out)", mm, x, w_gate, check=False)
    pre, pack = _gate_and_pack(x, w_gate, config)
    measure("stage: row_pack (pre-activation -> row lists)", pack, pre, check=False,
            bytes=pre.size * pre.dtype.itemsize)
    values, columns, row_nnz = _light_lists(pack(pre), config, case.f)
    up_down = jax.jit(lambda *a: row_up_down(*a)[0])
    measure("stage: row_up_down (light rows)", up_down, x, jnp.asarray(w_up.T), w_down, values,
            columns, row_nnz, check=False,
            bytes=int(jnp.sum(row_nnz)) * 2 * case.d * w_down.dtype.itemsize)
    return results


def _gate_and_pack(x, w_gate, config: tj.TwELLConfig):
    """The gate pre-activation (F padded to whole tiles, as the backend pads it) and the
    jitted ``row_pack`` of it, as the pallas path runs them."""
    f = w_gate.shape[1]
    f_pad = config.num_tiles(f) * config.tile_width
    pre = jnp.dot(x, jnp.pad(w_gate, ((0, 0), (0, f_pad - f))))
    slots = config.max_row_nnz(f)
    return pre, jax.jit(lambda p: row_pack(p, tile_width=config.tile_width, num_slots=slots))


def _light_lists(packed, config: tj.TwELLConfig, f: int):
    """``row_pack``'s output -> the light rows' lists (heavy rows get no entries)."""
    values, columns, counts, total = packed
    row_nnz = jnp.where(heavy_rows(counts, config, f), 0, total)
    values, columns = mask_lists(values, columns, row_nnz)
    return values, columns, row_nnz


def run_backward_stages(case: Case, x, weights, dy, config: tj.TwELLConfig, timing: dict,
                        results: list[dict], emit: Callable) -> None:
    """The backward's kernels alone on the case's light rows, with the bytes of weight rows
    (``row_backward``: w_down, w_up, w_gate per entry) or of gathered b rows
    (``sparse_outer``: x or dy per entry) they read and the rate: the backward's stage table."""
    w_gate, w_up, w_down = (w.astype(x.dtype) for w in weights)
    pre, pack = _gate_and_pack(x, w_gate, config)
    values, columns, row_nnz = _light_lists(pack(pre), config, case.f)
    prepared = tj.prepare_weights(w_gate, w_up, w_down)  # [F, D], as the kernels read them
    w_up_t, w_gate_t = prepared.up, prepared.gate
    _, up, _ = jax.jit(row_up_down)(x, w_up_t, w_down, values, columns, row_nnz)
    l1 = jnp.float32(1e-4 / case.m)
    row_bytes = int(jnp.sum(row_nnz)) * case.d * x.dtype.itemsize  # one D-row per entry

    def stage(label, fn, *fn_args, bytes):
        def measure_into(row):
            row.update(time_ms(fn, *fn_args, **timing))
            row["bytes"] = bytes
            row["TB_per_s"] = bytes / row["median_ms"] / 1e9
        _record(case, label, results, emit, measure_into, kind="stage_bwd")

    backward = jax.jit(lambda *a: row_backward(*a, dx_dtype=x.dtype))
    stage("stage: row_backward (dh, du, dg; dx)", backward, dy, w_down, w_up_t, w_gate_t,
          values, up, columns, row_nnz, l1, bytes=3 * row_bytes)
    _, du, dg = backward(dy, w_down, w_up_t, w_gate_t, values, up, columns, row_nnz, l1)
    f = case.f
    outer_x = jax.jit(lambda a, b, c, n, b_rows: sparse_outer((a, b), c, n, b_rows, f))
    stage("stage: sparse_outer dW_gate + dW_up (column sort in)", outer_x, dg, du, columns,
          row_nnz, x, bytes=row_bytes)
    outer_dy = jax.jit(lambda a, c, n, b_rows: sparse_outer((a,), c, n, b_rows, f))
    stage("stage: sparse_outer dW_down (column sort in)", outer_dy,
          values.astype(jnp.float32) * up, columns, row_nnz, dy, bytes=row_bytes)


def op_weights(args: BenchArgs, *weights: jax.Array) -> tuple[jax.Array, ...]:
    """The case's bf16 weights in ``--weights-dtype`` (float32 holds them exactly): what the
    timed FFNs get. The stages and the float64 check use the bf16 ones (the same values)."""
    return tuple(w.astype(args.weights_dtype) for w in weights)


def residual_bytes(fn: Callable, *args) -> dict:
    """Bytes ``fn``'s VJP keeps for the backward: all, and those that are not inputs.

    Uses ``jax._src.ad_checkpoint.saved_residuals`` (what ``jax.ad_checkpoint.
    print_saved_residuals`` prints); the largest non-input residuals are listed by shape.
    """
    from jax._src.ad_checkpoint import saved_residuals

    saved = saved_residuals(fn, *args)
    nbytes = lambda aval: int(np.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize
    own = [(aval, why) for aval, why in saved if not why.startswith("from the argument")]
    own.sort(key=lambda r: -nbytes(r[0]))
    return {"residual_bytes_all": sum(nbytes(a) for a, _ in saved),
            "residual_bytes": sum(nbytes(a) for a, _ in own),
            "largest_residuals": [f"{a.dtype}{list(a.shape)}" for a, _ in own[:6]]}


def run_backward_case(case: Case, args: BenchArgs, config: tj.TwELLConfig,
                      emit: Callable) -> list[dict]:
    """Forward + backward of the FFN (all four gradients, random cotangent, L1 term on)."""
    x, w_gate, w_up, w_down = make_case_inputs(case)
    stats, _ = sparsity_stats(x, w_gate, config)
    emit({"case": case.name, "kind": "sparsity", **stats})
    dy = jax.random.normal(jax.random.PRNGKey(7), x.shape, jnp.float32).astype(x.dtype)
    inputs = (x, *op_weights(args, w_gate, w_up, w_down))
    l1_coeff = 1e-4
    f32 = lambda a: a.astype(jnp.float32)

    @jax.jit
    def reference_grads(x, wg, wu, wd):  # float32, highest precision: the yardstick
        def loss(*a):
            dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)
            h = jax.nn.relu(dot(a[0], a[1])) * dot(a[0], a[2])
            return jnp.sum(dot(h, a[3]) * f32(dy)) + l1_coeff * jnp.mean(jnp.sum(jnp.abs(h), -1))
        return jax.grad(loss, argnums=(0, 1, 2, 3))(*map(f32, (x, wg, wu, wd)))

    want = reference_grads(*inputs)
    names = ("dx", "dw_gate", "dw_up", "dw_down")
    timing = dict(runs=args.runs, min_batch_ms=args.min_batch_ms)
    results = []

    # The plain dense FFN on the Flax layout; every other row on weights stored [F, D], made
    # once (``tj.prepare_weights``), as the layers store them: their dW_gate and dW_up come
    # back [F, D] and are compared transposed.
    unit_rows = (x, *tj.prepare_weights(*inputs[1:]))

    def ffn_of(implementation, cfg, flax_layout):
        if flax_layout:
            return functools.partial(tj.gated_mlp, implementation=implementation, config=cfg)
        return lambda x, wg, wu, wd, **kw: tj.feed_forward(
            x, tj.FFNWeights(wg, wu, wd), implementation=implementation, config=cfg, **kw)

    def measure(label, implementation, cfg=config, flax_layout=False):
        def measure_into(row):
            ffn = ffn_of(implementation, cfg, flax_layout)

            def loss(x, wg, wu, wd):
                y, st = ffn(x, wg, wu, wd, return_stats=True)
                return jnp.sum(f32(y) * f32(dy)) + l1_coeff * st.l1

            args_in = inputs if flax_layout else unit_rows
            step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
            got = list(step(*args_in))
            if not flax_layout:
                got[1], got[2] = got[1].T, got[2].T
            # The FFN's own residuals (the loss's product with dy saves dy: not the FFN's).
            row.update(residual_bytes(ffn, *args_in))
            for name, g, w in zip(names, got, want):
                g = np.asarray(f32(g), np.float64)
                w = np.asarray(w, np.float64)
                row[f"rel_err_{name}"] = float(np.linalg.norm(g - w) / np.linalg.norm(w)) \
                    if np.all(np.isfinite(g)) else float("nan")
            row.update(time_ms(step, *args_in, **timing))
            if results and "residual_bytes" in results[0]:
                row["residuals_vs_xla"] = row["residual_bytes"] / max(
                    results[0]["residual_bytes"], 1)

        return _record(case, label, results, emit, measure_into, kind="time_fwd_bwd")

    measure("xla dense FFN fwd+bwd", "xla", flax_layout=True)
    measure("pallas TwELL FFN fwd+bwd", "pallas")
    measure("xla dense FFN fwd+bwd, weights [F, D]", "xla")
    measure("pallas TwELL FFN fwd+bwd, sparse forced", "pallas",
            cfg=dataclasses.replace(config, dense_fallback_density=1.0))
    if case.m <= 4096:  # the jnp reference is slow at training sizes: small cases only
        measure("reference (jnp) TwELL FFN fwd+bwd", "reference")
    run_backward_stages(case, x, inputs[1:], dy, config, timing, results, emit)
    return results


def main(argv=None) -> list[dict]:
    # The flags were spelled --min_batch_ms once: both spellings stay accepted.
    parser = cli.flag_parser(BenchArgs, __doc__.split("\n")[0], underscore_aliases=True)
    args = BenchArgs(**vars(parser.parse_args(argv)))
    names = SUITES.get(args.suite, args.suite.split(","))
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; have {sorted(CASES)} and suites {sorted(SUITES)}")
    config = tj.TwELLConfig(hot_units=args.hot_units)
    header = cli.header(" ".join(sys.argv), backend=jax.default_backend(),
                           config=dataclasses.asdict(config), args=dataclasses.asdict(args))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = []
    with open(args.out, "a") as log:
        def emit(row):
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)

        emit(header)
        for i, name in enumerate(names):
            print(f"[{i + 1}/{len(names)}] {name}", flush=True)
            run = run_backward_case if args.backward else run_case
            rows += run(CASES[name], args, config, emit)
    print_table(rows)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':<20} {'what':<66} {'ms':>9} {'vs xla':>7} {'rel err':>9} {'lone call':>9}")
    for r in rows:
        ms = f"{r['median_ms']:.3f}" if "median_ms" in r else "ERROR"
        lone = f"{r['latency_ms']:.3f}" if "latency_ms" in r else ""
        ratio = f"{r['speedup_vs_xla']:.2f}x" if "speedup_vs_xla" in r else ""
        errs = [v for k, v in r.items() if k.startswith("rel_err")]
        err = f"{max(errs):.2e}" if errs else ""
        extra = f" {r['TB_per_s']:.2f} TB/s" if "TB_per_s" in r else ""
        if "residual_bytes" in r:
            extra += f" residuals {r['residual_bytes'] / 2**20:.1f} MiB"
        print(f"{r['case']:<20} {r['label'][:66]:<66} {ms:>9} {ratio:>7} {err:>9} {lone:>9}{extra}"
              + (f"  {r['error'][:80]}" if "error" in r else ""))


if __name__ == "__main__":
    main()

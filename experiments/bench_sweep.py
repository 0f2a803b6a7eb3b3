"""Where the sparse FFN pays: a sweep of density x rows x shape against the plain dense FFN.

    python experiments/bench_sweep.py                       # GPU: the full map
    python experiments/bench_sweep.py --smoke               # CPU: tiny shapes, interpret mode

For each (D, F) in ``--shapes``, M in ``--rows`` and mean density (active units per token / F) in
``--densities`` (uniform rows: every token near the mean), it times the public op
``twell_jax.feed_forward(..., implementation="pallas")`` on weights stored [F, D] (made once per
cell with ``twell_jax.prepare_weights``), jitted alone, against the dense FFN a Flax
user writes (three bias-free bf16 ``nnx.Linear`` layers), forward and forward + backward (all
four gradients of ``sum(y * dy)``), in the same process. Both are compared before timing (the
relative error of y, or of dx, is recorded with each cell). Every call is timed inside an on-device loop of
``--repeats`` calls, each on the previous call's output added at weight 0 (not folded for
floats), so the host's dispatch (~40 us a call) is not what is measured at small M.

One JSON line per cell goes to ``--out``; ``--plot`` draws the heat map of dense / sparse time
(above 1: the sparse op is faster), one panel per shape and pass. ``--draw-from`` draws the map
and prints the table from recorded runs instead of measuring (a map made of several runs):

    python experiments/bench_sweep.py --draw-from a.jsonl b.jsonl --plot map.png
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
from tqdm import tqdm

from twell_jax import cli
from twell_jax.cli import flag

import twell_jax as tj
from twell_jax.benchmarking.ffn_cases import Case, flax_dense_mlp, make_case_inputs, time_ms


@dataclasses.dataclass(frozen=True)
class SweepArgs:
    shapes: str = flag("2048x5632,4096x14336", "comma list of DxF")
    rows: str = flag("1,8,64,2048,16384", "comma list of token rows M")
    densities: str = flag("0.1,0.25,0.5,1,2,5,20,50", "comma list of mean active units, in % of F")
    passes: str = flag("forward,backward", "forward and / or backward (forward + backward)")
    repeats: int = flag(10, "calls per timed on-device loop")
    runs: int = flag(5, "timed loops per cell; the median is reported")
    smoke: bool = flag(False, "CPU: D 64, F 256, M 8, two densities, 2 repeats")
    out: str = flag("runs/bench_sweep.jsonl", "JSON-lines file the cells are appended to")
    plot: str = flag("runs/bench_sweep.png", "PNG heat map of the ratios ('' for none)")
    draw_from: tuple = flag((), "JSON-lines files of earlier runs: draw --plot and print the "
                            "table from their cells, measuring nothing; a cell in a later "
                            "file replaces the same cell in an earlier one")


def parse_list(text: str, kind: Callable) -> list:
    return [kind(v) for v in text.split(",") if v]


def repeated(fn: Callable, repeats: int) -> Callable:
    """Jitted: ``repeats`` calls of ``fn(x, *weights) -> y [M, D]`` in a ``fori_loop``, each on
    x plus 0 * the running sum of outputs, so no call is hoisted or dropped."""
    def run(x, *weights):
        def step(_, acc):
            xi = (x.astype(jnp.float32) + 0.0 * acc).astype(x.dtype)
            return acc + fn(xi, *weights).astype(jnp.float32)
        return jax.lax.fori_loop(0, repeats, step, jnp.zeros(x.shape, jnp.float32))
    return jax.jit(run)


def forward_and_backward(ffn: Callable) -> Callable:
    """(x, weights...) -> dx + 0 * (sum of the weight gradients): all four gradients of
    ``sum(ffn(x, ...) * dy)`` computed, dx [M, D] returned (dy a fixed pseudo-random sign)."""
    def fn(x, *weights):
        dy = jnp.where(jnp.arange(x.size).reshape(x.shape) % 3 == 0, 1.0, -1.0).astype(x.dtype)
        loss = lambda *a: jnp.sum(ffn(*a).astype(jnp.float32) * dy)
        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(x, *weights)
        touch = sum(jnp.sum(g[:1, :1].astype(jnp.float32)) for g in grads[1:])
        return grads[0].astype(jnp.float32) + 0.0 * touch
    return fn


def sparse_ffn(x, gate, up, down):
    """The sparse FFN on weights stored [F, D] (``tj.prepare_weights``, made once per cell)."""
    return tj.feed_forward(x, tj.FFNWeights(gate, up, down), implementation="pallas")


@functools.lru_cache(maxsize=None)
def timed_loops(backward: bool, repeats: int) -> dict[str, Callable]:
    """The jitted loops, made once so that cells of one shape share their compiles."""
    fns = {"dense": flax_dense_mlp, "sparse": sparse_ffn}
    if backward:
        fns = {k: forward_and_backward(fn) for k, fn in fns.items()}
    return {k: repeated(fn, repeats) for k, fn in fns.items()}


def measure_cell(d: int, f: int, m: int, density: float, backward: bool,
                 args: SweepArgs) -> dict:
    case = Case(f"sweep_{d}x{f}_m{m}_{density}pct", m, d, f, "uniform", density / 100 * f)
    x, w_gate, w_up, w_down = make_case_inputs(case)
    weights = (w_gate, w_up, w_down)
    counts = np.asarray(jnp.sum(jnp.dot(x, w_gate) > 0, axis=1))
    row = {"kind": "cell", "d": d, "f": f, "m": m, "density_pct": density,
           "pass": "forward+backward" if backward else "forward",
           "nnz_mean": float(counts.mean()), "nnz_max": int(counts.max())}
    loops = timed_loops(backward, args.repeats)
    # The dense FFN on the Flax layout, the sparse one on its own ([F, D], made once).
    inputs = {"dense": weights, "sparse": tuple(tj.prepare_weights(*weights))}
    # Each loop returns repeats x the output of one call on x: compare those before timing.
    outs = {k: np.asarray(loop(x, *inputs[k]), np.float32) for k, loop in loops.items()}
    row["rel_err_vs_dense"] = float(np.linalg.norm(outs["sparse"] - outs["dense"])
                                    / max(float(np.linalg.norm(outs["dense"])), 1e-30))
    row["finite"] = bool(np.isfinite(outs["sparse"]).all())
    for label, loop in loops.items():
        t = time_ms(loop, x, *inputs[label], runs=args.runs, min_batch_ms=1.0)
        row[f"{label}_ms"] = t["median_ms"] / args.repeats
    row["ratio"] = row["dense_ms"] / row["sparse_ms"]
    return row


def draw(rows: list[dict], path: str) -> None:
    """One heat map panel per (shape, pass): densities down, rows across, dense / sparse."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    panels = sorted({(r["d"], r["f"], r["pass"]) for r in rows},
                    key=lambda p: (p[0], p[1], p[2] != "forward"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=2.0)
    for ax, (d, f, pass_) in zip(axes[0], panels):
        cells = [r for r in rows if (r["d"], r["f"], r["pass"]) == (d, f, pass_)]
        ms = sorted({r["m"] for r in cells})
        dens = sorted({r["density_pct"] for r in cells})
        grid = np.full((len(dens), len(ms)), np.nan)
        for r in cells:
            grid[dens.index(r["density_pct"]), ms.index(r["m"])] = r["ratio"]
        ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
        for i in range(len(dens)):
            for j in range(len(ms)):
                if np.isfinite(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(ms)), [str(m) for m in ms])
        ax.set_yticks(range(len(dens)), [f"{v:g}%" for v in dens])
        ax.set_xlabel("token rows M")
        ax.set_ylabel("active units per token (% of F)")
        ax.set_title(f"D {d}, F {f}, {pass_}", fontsize=10)
    fig.suptitle("dense / sparse time (above 1: TwELL faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def recorded_cells(paths) -> list[dict]:
    """The cells of earlier runs' JSON-lines files, one per (D, F, M, density, pass): where
    several files hold a cell, the last file's (a map redrawn with some cells re-run)."""
    cells = {}
    for path in paths:
        with open(path) as fh:
            for line in fh:
                row = json.loads(line)
                if row.get("kind") == "cell":
                    key = (row["d"], row["f"], row["m"], row["density_pct"], row["pass"])
                    cells[key] = row
    return list(cells.values())


def main(argv=None) -> list[dict]:
    parser = cli.flag_parser(SweepArgs, __doc__.split("\n")[0])
    args = SweepArgs(**vars(parser.parse_args(argv)))
    if args.draw_from:
        try:
            rows = recorded_cells(args.draw_from)
        except (OSError, ValueError, KeyError) as e:
            parser.error(f"--draw-from: cannot read the cells: {type(e).__name__}: {e}")
        if not rows:
            parser.error(f"--draw-from: no cells in {', '.join(args.draw_from)}")
        if args.plot:
            draw(rows, args.plot)
        report(rows)
        return rows
    if args.smoke:
        args = dataclasses.replace(args, shapes="64x256", rows="8", densities="2,50",
                                   repeats=2, runs=2)
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
        rows_m, densities = parse_list(args.rows, int), parse_list(args.densities, float)
    except ValueError as e:
        parser.error(f"--shapes DxF, --rows and --densities comma lists of numbers: {e}")
    passes = parse_list(args.passes, str)
    if set(passes) - {"forward", "backward"} or not passes:
        parser.error(f"--passes: forward and / or backward, got {args.passes!r}")
    cells = [(d, f, m, density, pass_ == "backward") for d, f in shapes for m in rows_m
             for pass_ in passes for density in densities]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    rows = []
    with open(args.out, "a") as log:
        log.write(json.dumps(cli.header(" ".join(sys.argv), backend=jax.default_backend(),
                                        args=dataclasses.asdict(args))) + "\n")
        for d, f, m, density, backward in tqdm(cells, desc="cells", file=sys.stdout):
            try:
                row = measure_cell(d, f, m, density, backward, args)
            except Exception as e:  # a cell that fails (memory, say) is reported, not fatal
                row = {"kind": "error", "d": d, "f": f, "m": m, "density_pct": density,
                       "pass": "forward+backward" if backward else "forward",
                       "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            log.write(json.dumps(row) + "\n")
            log.flush()
            rows.append(row)
    good = [r for r in rows if r["kind"] == "cell"]
    if args.plot and good:
        draw(good, args.plot)
    report(rows)
    return rows


def report(rows: list[dict]) -> None:
    """The table of cells (and errors), and how many are below 0.95x."""
    good = [r for r in rows if r["kind"] == "cell"]
    print(f"\n{'D x F':>11} {'pass':>17} {'M':>6} {'density':>8} {'dense ms':>9} "
          f"{'sparse ms':>9} {'ratio':>6} {'rel err':>8}")
    for r in rows:
        if r["kind"] != "cell":
            print(f"{r['d']}x{r['f']:<6} {r['pass']:>17} {r['m']:>6} {r['density_pct']:>7g}% "
                  f"ERROR {r['error']}")
            continue
        print(f"{r['d']}x{r['f']:<6} {r['pass']:>17} {r['m']:>6} {r['density_pct']:>7g}% "
              f"{r['dense_ms']:>9.4f} {r['sparse_ms']:>9.4f} {r['ratio']:>6.2f} "
              f"{r['rel_err_vs_dense']:>8.1e}")
    if good:
        worst = min(good, key=lambda r: r["ratio"])
        print(f"cells below 0.95x: {sum(r['ratio'] < 0.95 for r in good)} of {len(good)}; "
              f"worst {worst['ratio']:.2f}x (D {worst['d']}, M {worst['m']}, "
              f"{worst['density_pct']:g}%, {worst['pass']})")


if __name__ == "__main__":
    main()

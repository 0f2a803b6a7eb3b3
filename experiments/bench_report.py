"""Renders the experiments' JSON lines as Markdown (for benchmarks/LOG.md): ``bench_ffn.py``'s
as tables of each case's timings; any other row (a model, a profile, a multi-GPU run) as one
line of its scalar fields.

    python experiments/bench_report.py runs/bench_ffn.jsonl > runs/bench_ffn.md
"""

from __future__ import annotations

import argparse
import json


def render(lines: list[dict]) -> str:
    out = []
    base = {}  # case -> dense XLA median, for ratios
    for row in lines:
        if row.get("label") == "xla dense FFN" and "median_ms" in row:
            base[row["case"]] = row["median_ms"]
    for row in lines:
        kind = row.get("kind")
        if kind == "header":
            out.append(f"\n#### Run {row['date'][:19]}Z on {row['device']} (jax {row['jax']}, "
                       f"commit {row['commit']})\n")
            out.append(f"`{row['command']}`\n")
            if "config" in row:
                out.append(f"Config: `{json.dumps(row['config'])}`\n")
        elif kind == "sparsity":
            out.append(f"\n**{row['case']}**: active units per token mean {row['nnz_mean']:.1f}, "
                       f"p99 {row['nnz_p99']:.0f}, max {row['nnz_max']}; (row, tile) pairs over "
                       f"S: {100 * row['tiles_over_S']:.2f}%; heavy rows: {row['heavy_rows']}\n")
            out.append("| what | median ms (p10-p90) | XLA dense / this | rel. error vs f64 |")
            out.append("|---|---|---|---|")
        elif kind == "time" and "case" in row and "label" in row:
            if "median_ms" not in row:
                out.append(f"| {row['label']} | failed: {row.get('error', '')[:90]} | | |")
                continue
            ratio = ""
            if row["case"] in base and not row["label"].startswith(("stage", "diagnostic")):
                ratio = f"{base[row['case']] / row['median_ms']:.2f}x"
            err = f"{row['rel_err']:.2e}" if "rel_err" in row else ""
            if row.get("fallback"):
                err += " (took the dense path)"
            out.append(f"| {row['label']} | {row['median_ms']:.3f} ({row['p10_ms']:.3f}-"
                       f"{row['p90_ms']:.3f}) | {ratio} | {err} |")
        else:
            out.append(scalar_line(row))
    return "\n".join(out) + "\n"


def scalar_line(row: dict) -> str:
    """A row of no known layout as one Markdown bullet: its scalar fields, floats to 4
    significant digits (lists and objects are left to the raw file)."""
    def text(value) -> str:
        return format(value, ".4g") if isinstance(value, float) else str(value)

    fields = [f"{k}={text(v)}" for k, v in row.items()
              if k != "kind" and isinstance(v, (str, int, float, bool)) and v is not None]
    return f"- {row.get('kind', 'row')}: " + ", ".join(fields)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("jsonl", nargs="+", help="JSON-lines files the experiments wrote")
    args = parser.parse_args(argv)
    lines = []
    for path in args.jsonl:
        with open(path) as f:
            lines += [json.loads(line) for line in f if line.strip()]
    print(render(lines))


if __name__ == "__main__":
    main()

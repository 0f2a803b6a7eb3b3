"""Probe: decode attention over a KV cache on the GPU, XLA vs cuDNN vs the Pallas kernel.

    python tools/probe_decode_attention.py            # H100, < 2 minutes
    python tools/probe_decode_attention.py --smoke    # CPU, interpret mode, tiny shapes

Cases (bf16, N = Nkv = 32 heads of 64, S = 2048, the 0.5b model's decode step): B = 1 and 8
with the query at the cache's end (positions = S - 1), and B = 1 at positions = S / 4 (a short
context in a long cache). Variants: (a) ``twell_jax.model.decode_attention`` (XLA einsums and a
masked softmax), (b) the same math on caches stored [B, Nkv, S, H], (c) cuDNN through
``jax.nn.dot_product_attention(..., key_value_seq_lengths=positions + 1)`` (a failure is
recorded), (d) ``pallas_kernels.decode_attention`` with its default config and a sweep of
configs (a config that fails to compile is recorded, not fatal; past ``--budget-s`` seconds
the remaining sweep configs are skipped and recorded so, to stay under two minutes).

Each variant is first checked against the float32 jnp reference (max abs error / max |ref| and
the norm-relative error), then timed per call inside one jitted ``fori_loop`` of ``--steps``
steps, each step calling it on ``LAYERS`` = 8 different layers' caches in turn (B = 8: 8 x 16 MB
per layer, more than the 50 MB L2), each call's q made dependent on the previous outputs
(q + 0 * acc) so nothing is hoisted or dropped. Per call: median loop time / (steps * layers);
the empty loop (identity attention) is reported as "loop overhead" (not subtracted). GB/s: the
K and V bytes actually needed (positions + 1 entries per sequence) per call time.

One JSON line per measurement to ``$OUT/decode_attention_probe.jsonl`` (``$OUT`` unset: the
current directory); a table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_attention import (DecodeAttentionConfig,
                                             decode_attention, decode_attention_reference,
                                             default_decode_attention_config)
from twell_jax import model

LAYERS = 8

# (block_s, block_k, num_warps, num_stages); the default config is timed besides.
SWEEP = [(64, 64, 2, 1), (128, 128, 4, 1), (128, 64, 4, 2), (256, 128, 4, 2), (256, 64, 4, 3),
         (256, 256, 8, 1), (512, 128, 4, 3), (512, 128, 8, 2), (1024, 128, 8, 2)]
# The short-context case (positions = S / 4) times the first len // 2 + 1 of them.
SMOKE_SWEEP = [(16, 16, 1, 1), (32, 16, 2, 2)]


def xla_transposed(q, k_t, v_t, positions):
    """``model.decode_attention``'s math on caches stored [B, Nkv, S, H]."""
    b, n, h = q.shape
    n_kv, s = k_t.shape[1], k_t.shape[2]
    qg = q.reshape(b, n_kv, n // n_kv, h).astype(k_t.dtype)
    scores = jnp.einsum("bkgh,bksh->bkgs", qg, k_t, preferred_element_type=jnp.float32)
    scores = scores / np.sqrt(h)
    valid = jnp.arange(s)[None, :] <= positions[:, None]
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_t.dtype)
    out = jnp.einsum("bkgs,bksh->bkgh", probs, v_t, preferred_element_type=jnp.float32)
    return out.reshape(b, n, h).astype(q.dtype)


def cudnn(q, k, v, positions):
    out = jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn",
                                       key_value_seq_lengths=positions + 1)
    return out[:, 0]


def attention_loop(fn, steps: int):
    """Jitted: ``steps`` steps, each calling ``fn(q, k, v, positions)`` on every layer's caches
    in turn; each call's q is q + 0 * (the running sum of outputs), so no call is hoisted."""
    def run(q, positions, layers):
        def step(_, acc):
            for k, v in layers:
                qi = (q.astype(jnp.float32) + 0.0 * acc).astype(q.dtype)
                acc = acc + fn(qi, k, v, positions).astype(jnp.float32)
            return acc
        return jax.lax.fori_loop(0, steps, step, jnp.zeros(q.shape, jnp.float32))
    return jax.jit(run)


def time_loop(loop, args, runs: int) -> float:
    """Median seconds of one loop call over ``runs`` synchronised calls (after compile and a
    warm-up call)."""
    jax.block_until_ready(loop(*args))
    jax.block_until_ready(loop(*args))
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def errors(out, ref) -> dict:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return {"max_rel_err": float("nan"), "norm_rel_err": float("nan"), "finite": False}
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    return {"max_rel_err": float(np.max(np.abs(out - ref)) / scale),
            "norm_rel_err": float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)),
            "finite": True}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU interpret mode, tiny shapes")
    parser.add_argument("--runs", type=int, default=None, help="timed loop calls per variant")
    parser.add_argument("--steps", type=int, default=None, help="loop steps (x 8 layers)")
    parser.add_argument("--budget-s", type=float, default=100.0,
                        help="skip the remaining sweep configs after this many seconds")
    args = parser.parse_args(argv)
    smoke = args.smoke
    if smoke:
        b_values, s, n, h, sweep = (1, 2), 64, 4, 16, SMOKE_SWEEP
        steps, runs = args.steps or 2, args.runs or 2
    else:
        b_values, s, n, h, sweep = (1, 8), 2048, 32, 64, SWEEP
        steps, runs = args.steps or 100, args.runs or 7
    # The short-context case sweeps the first configs only (small chunks), for the time limit.
    short_sweep = max(1, len(sweep) // 2 + 1)
    dtype = jnp.bfloat16
    n_kv = n
    cases = [(b, s - 1) for b in b_values] + [(1, s // 4)]
    out_dir = os.environ.get("OUT") or "."
    path = os.path.join(out_dir, "decode_attention_probe.jsonl")
    t_start = time.perf_counter()
    rows = []
    with open(path, "w") as f:
        def emit(row):
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)
            rows.append(row)

        emit({"kind": "header", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "smoke": smoke, "steps": steps, "layers": LAYERS, "runs": runs,
              "shape": {"S": s, "N": n, "Nkv": n_kv, "H": h, "dtype": "bfloat16"}})
        for b, position in cases:
            case = f"B={b} S={s} pos={position}"
            keys = iter(jax.random.split(jax.random.key(b * 7919 + position), 2 * LAYERS + 1))
            normal = lambda shape: jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)
            q = normal((b, n, h))
            positions = jnp.full((b,), position, jnp.int32)
            layers = [(normal((b, s, n_kv, h)), normal((b, s, n_kv, h))) for _ in range(LAYERS)]
            layers_t = [tuple(jnp.transpose(a, (0, 2, 1, 3)) for a in kv) for kv in layers]
            jax.block_until_ready((layers, layers_t))
            k0, v0 = layers[0]
            with jax.default_matmul_precision("highest"):  # no TF32 in the reference
                ref = decode_attention_reference(q.astype(jnp.float32), k0.astype(jnp.float32),
                                                 v0.astype(jnp.float32), positions)
            needed = 2 * b * (position + 1) * n_kv * h * jnp.dtype(dtype).itemsize
            default = default_decode_attention_config(b, s, n_kv, h)
            variants = [
                ("loop overhead (identity)", lambda q, k, v, p: q, layers, False, None),
                ("xla model.decode_attention", model.decode_attention, layers, True, None),
                ("xla, caches [B,Nkv,S,H]", xla_transposed, layers_t, True, None),
                ("cudnn dot_product_attention", cudnn, layers, True, None),
                ("pallas default", None, layers, True, default),
            ] + [("pallas", None, layers, True,
                  DecodeAttentionConfig(block_s=bs, block_k=bk, num_warps=w, num_stages=st))
                 for bs, bk, w, st in (sweep if position == s - 1 else sweep[:short_sweep])]
            for label, fn, sets, check, config in variants:
                row = {"kind": "time", "case": case, "B": b, "position": position,
                       "label": label}
                if config is not None:
                    row["config"] = {"block_s": config.block_s,
                                     "block_k": config.rows_per_tile(h),
                                     "num_warps": config.num_warps,
                                     "num_stages": config.num_stages}
                    fn = (lambda c: lambda q, k, v, p: decode_attention(q, k, v, p, config=c))(
                        config)
                if label == "pallas" and time.perf_counter() - t_start > args.budget_s:
                    row["skipped"] = f"time budget {args.budget_s} s spent"
                    emit(row)
                    continue
                try:
                    if check:
                        k1, v1 = sets[0]
                        row.update(errors(jax.jit(fn)(q, k1, v1, positions), ref))
                    seconds = time_loop(attention_loop(fn, steps), (q, positions, sets), runs)
                    row["us_per_call"] = seconds / (steps * LAYERS) * 1e6
                    if check:
                        row["kv_GBps"] = needed / (row["us_per_call"] * 1e-6) / 1e9
                except Exception as e:  # a failing variant is recorded, never fatal
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    if smoke and "cudnn" not in label:
                        traceback.print_exc()
                row["elapsed_s"] = round(time.perf_counter() - t_start, 1)
                emit(row)
            del layers, layers_t

    print(f"\n{'case':<24} {'variant':<30} {'config (bs,bk,w,st)':<20} {'us/call':>9} "
          f"{'GB/s':>7} {'max rel err':>11}")
    for row in rows:
        if row["kind"] != "time":
            continue
        cfg = row.get("config")
        cfg = f"{cfg['block_s']},{cfg['block_k']},{cfg['num_warps']},{cfg['num_stages']}" \
            if cfg else ""
        if "us_per_call" in row:
            gbps = f"{row['kv_GBps']:7.0f}" if "kv_GBps" in row else " " * 7
            err = f"{row['max_rel_err']:11.2e}" if "max_rel_err" in row else ""
            print(f"{row['case']:<24} {row['label']:<30} {cfg:<20} {row['us_per_call']:9.2f} "
                  f"{gbps} {err}")
        else:
            why = row.get("error") or row.get("skipped")
            print(f"{row['case']:<24} {row['label']:<30} {cfg:<20} {why[:60]}")
    print(f"\nwrote {path} ({time.perf_counter() - t_start:.0f} s)")
    return rows


if __name__ == "__main__":
    main()

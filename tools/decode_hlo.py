"""Which weight-sized transposes, dtype converts and copies run inside the decode loop?

Compiles ``generate``'s decode loop (``model.generation_steps``) for a preset on this machine's
backend and lists every transpose / convert / copy whose result has the shape of a parameter (or its
transpose), split into those inside the ``lax.while_loop`` body (paid every decode step; "in a
branch" when under a ``conditional``, e.g. the sparse FFN's ``lax.cond``) and those XLA left in
the entry computation (paid once per call, e.g. casts it hoisted out of the loop):

    python tools/decode_hlo.py --preset tiny --implementation pallas
    python tools/decode_hlo.py --preset 0.5b --implementation pallas --force-sparse \\
        --param-dtype float32 --hlo-out runs/decode_0.5b.hlo.txt
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from twell_jax import model as model_lib
from twell_jax.config import TwELLConfig

_OP = re.compile(r"= (\w+)\[([\d,]*)\]\S*\s+(transpose|convert|copy)\(")
_CALLED = re.compile(r"(calls|body|condition|to_apply|branch_computations|true_computation|"
                     r"false_computation)=\{?([%\w.\-]+(?:, ?[%\w.\-]+)*)\}?")


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """(computation name -> its instruction lines, the entry computation's name)."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
        elif current is not None and line.startswith(" "):
            comps[current].append(line)
    return comps, entry


def reachable(comps: dict[str, list[str]], root: str) -> dict[str, bool]:
    """Computations reachable from ``root`` -> whether every path to it passes through a
    ``conditional``'s branch (False: some path runs it unconditionally)."""
    seen: dict[str, bool] = {}
    stack = [(root, False)]
    while stack:
        name, in_branch = stack.pop()
        if name not in comps or (name in seen and (seen[name] is False or in_branch)):
            continue
        seen[name] = in_branch
        for line in comps[name]:
            for kind, names in _CALLED.findall(line):
                for called in names.replace("%", "").split(","):
                    stack.append((called.strip(), in_branch or kind == "branch_computations"))
    return seen


def weight_ops(hlo: str, shapes: set[tuple[int, ...]]) -> dict[str, list[str]]:
    """Weight-shaped transpose / convert / copy ops: {"loop": [...], "loop, in a branch":
    [...], "outside the loop": [...]}, each "op dtype[shape] (computation)"."""
    comps, entry = computations(hlo)
    bodies = [m.group(1) for line in comps[entry] if " while(" in line
              for m in [re.search(r"body=%?([\w.\-]+)", line)] if m]
    inside: dict[str, bool] = {}
    for body in bodies:
        for name, in_branch in reachable(comps, body).items():
            inside[name] = inside.get(name, True) and in_branch
    found: dict[str, list[str]] = {"loop": [], "loop, in a branch": [], "outside the loop": []}
    for name, lines in comps.items():
        for line in lines:
            m = _OP.search(line)
            if not m or tuple(int(v) for v in m.group(2).split(",") if v) not in shapes:
                continue
            where = ("outside the loop" if name not in inside
                     else "loop, in a branch" if inside[name] else "loop")
            op_name = re.search(r'op_name="([^"]*)"', line)
            found[where].append(f"{m.group(3)} {m.group(1)}[{m.group(2)}] ({name}"
                                + (f", {op_name.group(1)})" if op_name else ")"))
    return found


def main(argv: Sequence[str] | None = None) -> dict[str, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(model_lib.CONFIGS))
    parser.add_argument("--implementation", default="pallas", choices=("xla", "pallas"))
    parser.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--force-sparse", action="store_true",
                        help="TwELLConfig(dense_fallback_density=1.0): never the dense switch")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hlo-out", default="", help="also write the compiled HLO text here")
    args = parser.parse_args(argv)
    model = model_lib.build(args.preset, implementation=args.implementation, gate_bias=True,
                            param_dtype=jnp.dtype(args.param_dtype),
                            twell=TwELLConfig(dense_fallback_density=1.0)
                            if args.force_sparse else None)
    graphdef, state = nnx.split(model)
    prompts = jnp.zeros((args.batch, 8), jnp.int32)
    lengths = jnp.full((args.batch,), 8, jnp.int32)
    sampling, key = model_lib.Sampling(), jax.random.key(0)
    stop = jnp.zeros((model.cfg.vocab_size,), bool)
    decode_state, _, _, _ = model_lib.generation_start(graphdef, state, prompts, lengths, key,
                                                       stop, sampling=sampling, cache_len=16)
    hlo = model_lib.generation_steps.lower(graphdef, state, decode_state, jnp.int32(4),
                                           sampling=sampling, chunk=4).compile().as_text()
    if args.hlo_out:
        Path(args.hlo_out).write_text(hlo)
    shapes = {tuple(leaf.shape) for leaf in jax.tree.leaves(state.to_pure_dict())
              if leaf.ndim == 2}
    shapes |= {s[::-1] for s in shapes}
    found = weight_ops(hlo, shapes)
    print(f"{args.preset} {args.implementation} params {args.param_dtype}"
          f"{' force-sparse' if args.force_sparse else ''} on {jax.devices()[0].device_kind}: "
          f"weight-shaped transpose / convert / copy ops")
    for where, ops in found.items():
        print(f"  {where}: {len(ops)}")
        for op in ops:
            print(f"    {op}")
    return found


if __name__ == "__main__":
    main()

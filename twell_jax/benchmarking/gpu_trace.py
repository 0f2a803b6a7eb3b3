"""GPU kernel times from a JAX profiler trace: which kernels a call ran, for how long, and
how much of a collective's time no other kernel hid.

``profile(fn, runs)`` times and traces a call; the other functions read the trace's events,
(name, start_ns, duration_ns) per kernel or copy, one list per GPU. On a machine without a GPU
the trace has no GPU planes and every table is empty.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
from typing import Callable

import jax
import numpy as np

KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("collective", ("nccl",)),
    ("twell", ("twell_",)),
    ("attention", ("cudnn", "flash", "fmha", "sdpa", "attention")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "dot")),
    ("copy", ("memcpy", "memset", "copy", "transpose", "dynamic_update_slice")),
    ("fusion", ("fusion", "loop_", "input_", "reduce", "convert", "broadcast", "select",
                "concatenate", "slice", "add", "multiply")),
)


def kind_of(name: str) -> str:
    """The kind of a GPU kernel from its name (twell, attention, gemm, copy, fusion, other)."""
    lowered = name.lower()
    for kind, keys in KINDS:
        if any(k in lowered for k in keys):
            return kind
    return "other"


def gpu_events(trace_dir: str) -> tuple[dict[str, list[tuple[str, float, float]]],
                                         dict[str, int]]:
    """Per GPU plane of the ``.xplane.pb`` under ``trace_dir`` (none on a machine without a
    GPU; "/device:GPU:0", ...), the (name, start_ns, duration_ns) of every kernel and copy;
    and the events per line of those planes (what the trace held, to check the choice of
    lines)."""
    from jax.profiler import ProfileData

    events, lines = {}, {}
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                line_events = [(e.name, e.start_ns, e.duration_ns) for e in line.events]
                lines[f"{plane.name} {line.name}"] = len(line_events)
                # Stream lines hold the kernels and copies; the "XLA Ops" / "XLA Modules"
                # lines annotate the same time and would count it twice.
                if not line.name.lower().startswith("xla"):
                    events.setdefault(plane.name, []).extend(line_events)
    return events, lines


def _merged(events: list[tuple[str, float, float]]) -> list[tuple[float, float]]:
    """The union of the events' intervals as sorted, disjoint (start, stop) pairs."""
    merged: list[list[float]] = []
    for _, start, duration in sorted(events, key=lambda e: e[1]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + duration)
        else:
            merged.append([start, start + duration])
    return [(a, b) for a, b in merged]


def busy_ns(events: list[tuple[str, float, float]]) -> float:
    """Length of the union of the events' intervals."""
    return sum((stop - start for start, stop in _merged(events)), 0.0)


def collective_alone_ns(events: list[tuple[str, float, float]]) -> float:
    """Time some collective kernel (``kind_of`` "collective": NCCL) runs on one GPU while no
    other kernel does: collectives the program failed to overlap with work."""
    return busy_ns(events) - busy_ns([e for e in events if kind_of(e[0]) != "collective"])


def alone_ns_by_collective(events: list[tuple[str, float, float]]) -> dict[str, float]:
    """Per collective kernel name, the time its kernels ran while no other (non-collective)
    kernel did: which collective kind the program leaves exposed (NCCL names carry the
    operation and dtype, e.g. ``ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL``). Two
    collectives running at once both count that time."""
    others = _merged([e for e in events if kind_of(e[0]) != "collective"])
    starts = [a for a, _ in others]
    alone: dict[str, float] = {}
    for name, start, duration in events:
        if kind_of(name) != "collective":
            continue
        stop, hidden = start + duration, 0.0
        # Intervals of the others that may overlap [start, stop): from the last one that
        # starts at or before ``start`` on.
        i = max(0, int(np.searchsorted(starts, start, side="right")) - 1)
        while i < len(others) and others[i][0] < stop:
            hidden += max(0.0, min(stop, others[i][1]) - max(start, others[i][0]))
            i += 1
        alone[name] = alone.get(name, 0.0) + duration - hidden
    return alone


def device_summary(events: list[tuple[str, float, float]], runs: int) -> dict:
    """One GPU's busy time, its collectives' time (union) and the part of it no other kernel
    ran beside, in ms per run, and that part per collective kernel name (largest first)."""
    collectives = [e for e in events if kind_of(e[0]) == "collective"]
    by_name = sorted(alone_ns_by_collective(events).items(), key=lambda kv: -kv[1])
    return {"busy_ms": busy_ns(events) / 1e6 / runs,
            "collective_ms": busy_ns(collectives) / 1e6 / runs,
            "collective_alone_ms": collective_alone_ns(events) / 1e6 / runs,
            "collective_alone_by_kernel_ms": {name: ns / 1e6 / runs for name, ns in by_name}}


def profile(fn: Callable[[], object], runs: int) -> dict:
    """Times ``runs`` synchronised calls of ``fn`` (after one warm-up call), then profiles
    as many more.

    Returns wall_ms (median, unprofiled: the profiler itself slows the host and turns off
    XLA's command buffers), profiled_wall_ms, and per run: busy_ms (the union over every GPU),
    kernel_ms (summed), launches, the kernels [{name, kind, ms, calls}] by total time, the
    kinds {kind: ms} and ``devices`` {GPU plane: ``device_summary``}."""
    def timed() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        return (time.perf_counter() - t0) * 1e3

    jax.block_until_ready(fn())
    walls = [timed() for _ in range(runs)]
    trace_dir = tempfile.mkdtemp(prefix="twell_profile_")
    with jax.profiler.trace(trace_dir):
        profiled = [timed() for _ in range(runs)]
    per_device, lines = gpu_events(trace_dir)
    events = [e for device in per_device.values() for e in device]
    by_name: dict[str, list[float]] = {}
    for name, _, duration in events:
        by_name.setdefault(name, []).append(duration)
    kernels = sorted(({"name": n, "kind": kind_of(n), "ms": sum(d) / 1e6 / runs,
                       "calls": len(d) / runs} for n, d in by_name.items()),
                     key=lambda k: -k["ms"])
    kinds: dict[str, float] = {}
    for k in kernels:
        kinds[k["kind"]] = kinds.get(k["kind"], 0.0) + k["ms"]
    return {"wall_ms": float(np.median(walls)), "profiled_wall_ms": float(np.median(profiled)),
            "busy_ms": busy_ns(events) / 1e6 / runs,
            "kernel_ms": sum(k["ms"] for k in kernels), "launches": len(events) / runs,
            "kinds": kinds, "kernels": kernels, "trace_lines": lines,
            "devices": {name: device_summary(device, runs)
                        for name, device in sorted(per_device.items())}}

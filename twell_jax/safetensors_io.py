"""Reads and writes the safetensors format with numpy, without the ``safetensors`` package.

The format: an 8-byte little-endian unsigned header length N, N bytes of JSON mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the byte
buffer that follows the header; an optional ``"__metadata__"`` entry maps strings to strings),
then the raw little-endian, row-major tensor bytes.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(bool),
}
"""safetensors dtype names -> numpy dtypes (bf16 through ``ml_dtypes``, a jax dependency)."""

_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the reference implementation's limit on the JSON header


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file, as numpy arrays (memory-mapped, read-only)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER:
            raise ValueError(f"{path}: header length {n} is implausible (not safetensors?)")
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if os.path.getsize(
        path) > 8 + n else np.zeros(0, np.uint8)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
        dtype = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape)) * dtype.itemsize or end > len(data):
            raise ValueError(f"{path}: tensor {name!r} has offsets {begin}..{end} that do not "
                             f"match shape {shape} {info['dtype']} or the file size")
        tensors[name] = np.ndarray(shape, dtype, buffer=data, offset=begin)
    return tensors


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike,
              metadata: dict[str, str] | None = None) -> None:
    """Writes numpy arrays (dtypes of ``DTYPES``) to ``path`` in the safetensors format."""
    header: dict = {} if metadata is None else {"__metadata__": dict(metadata)}
    arrays, offset = [], 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])  # tobytes() below writes row-major order
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} has no safetensors name")
        array = array.astype(dtype, copy=False)
        header[name] = {"dtype": _NAMES[dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        arrays.append(array)
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for array in arrays:
            f.write(array.tobytes())

"""Reads and writes the safetensors format with numpy, without the ``safetensors`` package
(tensors memory-mapped, bf16 through ml_dtypes); the reader validates every header field as
the reference implementation does, so files from strangers fail with a ValueError.

The format: an 8-byte little-endian unsigned header length N, N bytes of JSON mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the byte
buffer that follows the header; an optional ``"__metadata__"`` entry maps strings to strings),
then the raw little-endian, row-major tensor bytes.
"""

from __future__ import annotations

import json
import math
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
_KNOWN_DTYPES = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32",
                 "U32", "F32", "F64", "I64", "U64")  # the format's names (some unsupported here)


def _is_count(value) -> bool:
    """A JSON integer >= 0 (not a bool, not a float such as 2.0)."""
    return type(value) is int and value >= 0


def _no_duplicates(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicates = sorted({key for key in keys if keys.count(key) > 1})
        raise ValueError(f"the header names {duplicates[:3]} more than once")
    return dict(pairs)


def read_header(path: str | os.PathLike) -> tuple[dict, int, int]:
    """The validated header of a .safetensors file: ``(tensors, data_start, data_length)``,
    ``tensors`` mapping each name to ``(dtype, shape, begin, end)`` (offsets into the data
    buffer that starts at byte ``data_start`` of the file and is ``data_length`` bytes long).

    The checks of the reference implementation (the Rust ``safetensors`` crate), so that a
    malformed or hostile file raises ValueError naming the file and the problem instead of
    reading outside the buffer: the header length fits the file; the header is UTF-8 JSON,
    an object without duplicate names; ``__metadata__`` maps strings to strings; each tensor
    has a known ``dtype``, a ``shape`` of integers >= 0 and ``data_offsets`` [begin, end] of
    integers with begin <= end; end - begin is the shape's byte size; the tensors, ordered by
    offset, tile the data buffer exactly (from 0, no gap, no overlap, to its last byte).
    """
    size = os.path.getsize(path)
    if size < 8:
        raise ValueError(f"{path}: not a safetensors file ({size} bytes, shorter than the "
                         "8-byte header length)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER:
            raise ValueError(f"{path}: header length {n} is over the format's limit of "
                             f"{_MAX_HEADER} bytes (not safetensors?)")
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} exceeds the file ({size} bytes): "
                             "truncated or not safetensors")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: the header is not UTF-8 ({e.reason} at byte {e.start})") \
            from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: the header is not JSON ({e})") from None
    except ValueError as e:  # duplicates
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"{path}: __metadata__ must map strings to strings")
    data_start, data_length = 8 + n, size - 8 - n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ValueError(f"{where}: its entry is not an object")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in info:
                raise ValueError(f"{where}: no {key!r}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:  # (a list is not hashable)
            known = "a dtype this reader does not support" if dtype in _KNOWN_DTYPES else \
                "an unknown dtype"
            raise ValueError(f"{where}: {dtype!r} is {known} (supported: {sorted(DTYPES)})")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise ValueError(f"{where}: shape {shape!r} is not a list of integers >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_count(o) for o in offsets) or offsets[0] > offsets[1]):
            raise ValueError(f"{where}: data_offsets {offsets!r} is not [begin, end] with "
                             "0 <= begin <= end")
        begin, end = offsets
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize  # Python ints: no overflow
        if end - begin != nbytes:
            raise ValueError(f"{where}: shape {shape} {dtype} is {nbytes} bytes but "
                             f"data_offsets {offsets} span {end - begin}")
        tensors[name] = (dtype, tuple(shape), begin, end)
    position = 0
    for name, (_, _, begin, end) in sorted(tensors.items(), key=lambda item: item[1][2:]):
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else \
                f"leaves a gap of {begin - position} bytes before it"
            raise ValueError(f"{path}: tensor {name!r} at data_offsets [{begin}, {end}] {what} "
                             "(tensors must tile the data buffer in order)")
        position = end
    if position != data_length:
        raise ValueError(f"{path}: the tensors cover {position} bytes, which do not match the "
                         f"data buffer's {data_length} (truncated or padded file)")
    return tensors, data_start, data_length


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file, as numpy arrays (memory-mapped, read-only).
    ValueError naming the file and the problem for any malformed header (``read_header``)."""
    tensors, data_start, data_length = read_header(path)
    data = (np.memmap(path, dtype=np.uint8, mode="r", offset=data_start) if data_length
            else np.zeros(0, np.uint8))
    return {name: np.ndarray(shape, DTYPES[dtype], buffer=data, offset=begin)
            for name, (dtype, shape, begin, _) in tensors.items()}


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

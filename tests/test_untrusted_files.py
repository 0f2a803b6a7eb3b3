"""Files from strangers: every malformed or hostile .safetensors file and Hugging Face
config.json raises a ValueError naming the file and the problem (never a crash, never a silent
load). Where the ``safetensors`` package is installed, it serves as the oracle that each
malformed file is indeed invalid."""

from __future__ import annotations

import json
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from tests.utils import subprocess_env
from twell_jax import model as model_lib
from twell_jax import safetensors_io

ROOT = pathlib.Path(__file__).resolve().parents[1]

HF_CONFIG = {
    "model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500.0,
    "hidden_act": "relu", "tie_word_embeddings": False,
}


def raw_file(header, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file with this header (a JSON-able value, or bytes taken as is), data
    buffer and (default: true) header length."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


F32x4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
DATA16 = np.arange(4, dtype="<f4").tobytes()

# name -> (file bytes, the ValueError's message must contain this).
CASES = {
    "negative data_offsets": (raw_file({"a": {**F32x4, "data_offsets": [-16, 0]}}, DATA16),
                              "data_offsets [-16, 0]"),
    "begin > end": (raw_file({"a": {**F32x4, "shape": [0], "data_offsets": [16, 0]}}, DATA16),
                    "0 <= begin <= end"),
    "offsets outside the buffer": (raw_file({"a": {**F32x4, "data_offsets": [16, 32]}}, DATA16),
                                   "gap of 16 bytes"),
    "end past the buffer": (raw_file({"a": {**F32x4, "shape": [8], "data_offsets": [0, 32]}},
                                     DATA16), "do not match the data buffer"),
    "overlapping offsets": (raw_file({"a": {**F32x4, "shape": [2], "data_offsets": [0, 8]},
                                      "b": {**F32x4, "shape": [2], "data_offsets": [4, 12]}},
                                     DATA16), "overlaps"),
    "gapped offsets": (raw_file({"a": {**F32x4, "shape": [1], "data_offsets": [0, 4]},
                                 "b": {**F32x4, "shape": [2], "data_offsets": [8, 16]}},
                                DATA16), "gap of 4 bytes"),
    "offsets past the data, out of order": (
        raw_file({"a": {**F32x4, "shape": [2], "data_offsets": [8, 16]},
                  "b": {**F32x4, "shape": [2], "data_offsets": [16, 24]}}, DATA16),
        "gap of 8 bytes"),
    "header is a JSON list": (raw_file([1, 2, 3]), "JSON list, not an object"),
    "header is a JSON string": (raw_file("abc"), "JSON str, not an object"),
    "header is not JSON": (raw_file(b"{not json at all"), "not JSON"),
    "header is not UTF-8": (raw_file(b'{"\xff\xfe": 1}'), "not UTF-8"),
    "duplicate names": (raw_file(b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}'
                                 b', "a": {"dtype": "F32", "shape": [4], "data_offsets": '
                                 b'[0, 16]}}', DATA16), "more than once"),
    "entry is not an object": (raw_file({"a": [1, 2]}, DATA16), "not an object"),
    "missing data_offsets": (raw_file({"a": {"dtype": "F32", "shape": [4]}}, DATA16),
                             "no 'data_offsets'"),
    "missing dtype": (raw_file({"a": {"shape": [4], "data_offsets": [0, 16]}}, DATA16),
                      "no 'dtype'"),
    "missing shape": (raw_file({"a": {"dtype": "F32", "data_offsets": [0, 16]}}, DATA16),
                      "no 'shape'"),
    "negative dimension": (raw_file({"a": {**F32x4, "shape": [-4]}}, DATA16), "shape [-4]"),
    "float dimension": (raw_file({"a": {**F32x4, "shape": [4.0]}}, DATA16), "shape [4.0]"),
    "shape is not a list": (raw_file({"a": {**F32x4, "shape": 4}}, DATA16), "shape 4"),
    "three data_offsets": (raw_file({"a": {**F32x4, "data_offsets": [0, 8, 16]}}, DATA16),
                           "data_offsets [0, 8, 16]"),
    "huge shape": (raw_file({"a": {**F32x4, "shape": [2**40, 2**40]}}, DATA16),
                   "bytes but data_offsets [0, 16] span 16"),
    "huge offsets": (raw_file({"a": {**F32x4, "shape": [2**62], "data_offsets": [0, 2**64]}},
                              DATA16), "do not match the data buffer"),
    "shape inconsistent with the byte length": (raw_file({"a": {**F32x4, "shape": [3]}}, DATA16),
                                                "is 12 bytes but data_offsets [0, 16] span 16"),
    "dtype inconsistent with the byte length": (raw_file({"a": {**F32x4, "dtype": "F64"}},
                                                         DATA16), "is 32 bytes"),
    "unknown dtype": (raw_file({"a": {**F32x4, "dtype": "Q7"}}, DATA16), "unknown dtype"),
    "dtype not a string": (raw_file({"a": {**F32x4, "dtype": 4}}, DATA16), "unknown dtype"),
    "dtype a list": (raw_file({"a": {**F32x4, "dtype": ["F32"]}}, DATA16), "unknown dtype"),
    "metadata not strings": (raw_file({"__metadata__": {"format": 1}, "a": F32x4}, DATA16),
                             "__metadata__"),
    "truncated data": (raw_file({"a": F32x4}, DATA16[:-3]), "do not match the data buffer"),
    "trailing bytes": (raw_file({"a": F32x4}, DATA16 + b"xx"), "do not match the data buffer"),
    "truncated header": (raw_file({"a": F32x4})[:-5], "exceeds the file"),
    "header length larger than the file": (raw_file({"a": F32x4}, DATA16, length=10_000),
                                           "exceeds the file"),
    "header length huge": (raw_file({"a": F32x4}, DATA16, length=2**63 + 5), "over the format"),
    "zero-length file": (b"", "0 bytes, shorter than"),
    "five bytes": (b"\x01\x02\x03\x04\x05", "5 bytes, shorter than"),
}

# The Rust reader keeps one of two entries of the same name; a file that names a tensor twice
# is ambiguous, so it is refused here.
STRICTER_THAN_THE_REFERENCE = {"duplicate names"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_safetensors_raise_value_error(tmp_path, case):
    content, message = CASES[case]
    path = tmp_path / "m.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        safetensors_io.load_file(path)
    assert str(path) in str(info.value) and message in str(info.value), str(info.value)
    if case in STRICTER_THAN_THE_REFERENCE:
        return
    try:  # the reference implementation rejects the file too (when installed)
        from safetensors.numpy import load_file as reference_load
    except ImportError:
        return
    with pytest.raises(Exception):
        reference_load(str(path))


def test_negative_offsets_in_a_subprocess(tmp_path):
    """Negative data_offsets once made numpy read before the buffer (a segfault): run it where
    a crash cannot take pytest down, and require the clean ValueError."""
    path = tmp_path / "neg.safetensors"
    path.write_bytes(raw_file({"a": {"dtype": "F32", "shape": [1 << 20],
                                     "data_offsets": [-(1 << 24), -(1 << 24) + (4 << 20)]}}))
    code = ("import sys; from twell_jax import safetensors_io\n"
            "try:\n    safetensors_io.load_file(sys.argv[1])\n"
            "except ValueError as e:\n    print('VALUEERROR', e)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT,
                          env=subprocess_env())
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.startswith("VALUEERROR") and str(path) in proc.stdout, proc.stdout


def test_valid_edge_cases_still_load(tmp_path):
    """What the format allows: no tensors, zero-size tensors, tensors listed out of order."""
    path = tmp_path / "ok.safetensors"
    path.write_bytes(raw_file({"__metadata__": {"format": "pt"}}))
    assert safetensors_io.load_file(path) == {}
    header = {"b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
              "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "z": {"dtype": "I64", "shape": [0, 3], "data_offsets": [16, 16]}}
    path.write_bytes(raw_file(header, DATA16))
    loaded = safetensors_io.load_file(path)
    np.testing.assert_array_equal(loaded["a"], [0, 1])
    np.testing.assert_array_equal(loaded["b"], [2, 3])
    assert loaded["z"].shape == (0, 3)


# ------------------------------------------------------------------------------------------
# config.json of a Hugging Face folder.


def hf_folder(tmp_path, config_text: str) -> pathlib.Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(config_text)
    return folder


@pytest.mark.parametrize("text, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('"llama"', "not a JSON object"),
    ("", "not JSON"),
])
def test_config_json_not_an_object(tmp_path, text, message):
    folder = hf_folder(tmp_path, text)
    with pytest.raises(ValueError, match=message) as info:
        model_lib.from_hf(folder)
    assert str(folder / "config.json") in str(info.value)


@pytest.mark.parametrize("change, key, message", [
    ({"hidden_size": None}, "hidden_size", "missing"),
    ({"vocab_size": None}, "vocab_size", "missing"),
    ({"num_hidden_layers": None}, "num_hidden_layers", "missing"),
    ({"hidden_size": "32"}, "hidden_size", "positive integer"),
    ({"hidden_size": True}, "hidden_size", "positive integer"),
    ({"hidden_size": 32.0}, "hidden_size", "positive integer"),
    ({"hidden_size": 0}, "hidden_size", "positive integer"),
    ({"intermediate_size": -64}, "intermediate_size", "positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads", "positive integer"),
    ({"num_attention_heads": 5}, "num_attention_heads", "does not divide"),
    ({"num_key_value_heads": "2"}, "num_key_value_heads", "positive integer"),
    ({"vocab_size": 2**40}, "vocab_size", "at most"),
    ({"max_position_embeddings": 1.5}, "max_position_embeddings", "positive integer"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps", "number"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps", "positive"),
    ({"rms_norm_eps": 2.0}, "rms_norm_eps", r"in \(0, 1\)"),
    ({"rms_norm_eps": True}, "rms_norm_eps", "number"),
    ({"rope_theta": 0}, "rope_theta", "positive"),
    ({"rope_theta": float("nan")}, "rope_theta", "positive"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings", "true or false"),
    ({"hidden_act": 3}, "hidden_act", "not supported"),
    ({"rope_parameters": [1]}, "rope_parameters", "object"),
    ({"rope_parameters": {"rope_theta": "1e4"}}, "rope_parameters.rope_theta", "number"),
])
def test_config_json_bad_values(tmp_path, change, key, message):
    cfg = {k: v for k, v in {**HF_CONFIG, **change}.items() if v is not None}
    folder = hf_folder(tmp_path, json.dumps(cfg))
    with pytest.raises(ValueError, match=message) as info:
        model_lib.from_hf(folder)
    assert str(folder / "config.json") in str(info.value) and key in str(info.value), info.value
    with pytest.raises(ValueError, match=key):  # the dict form names the key too
        model_lib.hf_config(cfg)

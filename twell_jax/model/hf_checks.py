"""Type and range checks of a Hugging Face ``config.json`` (a stranger's file) before
``hf_config`` reads it: ValueError naming the key, never a TypeError deep in model code."""

from __future__ import annotations

import math

_MAX_SIZE = 2**31 - 1  # sizes index int32 arrays
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
_OPTIONAL_SIZES = ("num_key_value_heads", "max_position_embeddings", "head_dim")


def check_config_types(hf) -> None:
    """ValueError naming the key for a config.json value of the wrong type or range (the
    values a stranger's file could hold: strings, bools, floats, zero or negative sizes)."""
    if not isinstance(hf, dict):
        raise ValueError(f"not a JSON object but a {type(hf).__name__}")
    for key in _REQUIRED + _OPTIONAL_SIZES:
        if key not in hf or (key in _OPTIONAL_SIZES and hf[key] is None):
            if key in _REQUIRED:
                raise ValueError(f"required key {key!r} is missing")
            continue
        value = hf[key]
        if type(value) is not int or value < 1:  # not bool, not 2.0
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if value > _MAX_SIZE:
            raise ValueError(f"{key} {value} is out of range (at most {_MAX_SIZE})")
    if hf["hidden_size"] % hf["num_attention_heads"]:
        raise ValueError(f"num_attention_heads {hf['num_attention_heads']} does not divide "
                         f"hidden_size {hf['hidden_size']}")
    rope = hf.get("rope_parameters")
    rope_theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    for key, value in (("rms_norm_eps", hf.get("rms_norm_eps")),
                       ("rope_theta", hf.get("rope_theta")),
                       ("rope_parameters.rope_theta", rope_theta)):
        if value is None:
            continue
        if type(value) not in (int, float):
            raise ValueError(f"{key} must be a number, got {value!r}")
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"{key} must be positive and finite, got {value!r}")
    if "rms_norm_eps" in hf and not hf["rms_norm_eps"] < 1:
        raise ValueError(f"rms_norm_eps must be in (0, 1), got {hf['rms_norm_eps']!r}")
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise ValueError(f"{key} must be true or false, got {hf[key]!r}")
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ValueError(f"{key} must be an object or null, got {hf[key]!r}")

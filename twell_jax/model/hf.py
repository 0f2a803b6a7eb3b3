"""Hugging Face Llama checkpoints: ``config.json`` to ``ModelConfig``, ``*.safetensors`` to a
``Transformer``."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax import safetensors_io
from twell_jax.model.config import ModelConfig
from twell_jax.model.hf_checks import check_config_types
from twell_jax.model.transformer import Transformer


# LlamaForCausalLM parameter names -> (our path, transpose): HF linear weights are [out, in];
# ours are [in, out], except the FFN's, stored one row per hidden unit ([F, D]: the gate and up
# projections as HF stores them, the down projection transposed).
_HF_LAYER_PARAMS = {
    "self_attn.q_proj.weight": (("attn", "w_q"), True),
    "self_attn.k_proj.weight": (("attn", "w_k"), True),
    "self_attn.v_proj.weight": (("attn", "w_v"), True),
    "self_attn.o_proj.weight": (("attn", "w_o"), True),
    "mlp.gate_proj.weight": (("ffn", "w_gate"), False),
    "mlp.up_proj.weight": (("ffn", "w_up"), False),
    "mlp.down_proj.weight": (("ffn", "w_down"), True),
    "input_layernorm.weight": (("attn_norm", "scale"), False),
    "post_attention_layernorm.weight": (("ffn_norm", "scale"), False),
}


def hf_config(hf: dict, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face Llama ``config.json`` (a dict).

    What differs from our defaults, and why the mapping is faithful: HF Llama does not scale
    the input embedding (``embed_scale=False``); its RMSNorm is ``weight * x / sqrt(mean(x^2) +
    eps)`` as ours (ones at init, not Gemma's 1 + weight), with ``rms_norm_eps``; its rotary
    embedding rotates the split halves (rotate_half) with inv_freq = theta^(-2i/H), as
    ``apply_rope``; ``num_key_value_heads`` maps to grouped-query attention; the output
    projection is tied or a separate ``lm_head``. Only what we can run is accepted: ``hidden_act``
    "relu" (the paper's ReLU-gated FFN), no biases, no rope scaling, head_dim = D / heads.
    ``overrides`` replace fields (dtype, implementation, max_seq_len, ...). ValueError, naming
    the key, for a missing key or a value of the wrong type or range.
    """
    check_config_types(hf)
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"model_type {model_type!r} is not supported (only 'llama')")
    act = hf.get("hidden_act", "silu")
    if act != "relu":
        raise ValueError(f"hidden_act {act!r} is not supported: TwELL FFNs are ReLU-gated "
                         "(hidden_act 'relu')")
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name):
            raise ValueError(f"{name}=true is not supported (the model has no biases)")
    # transformers >= 5 writes rope_parameters; older versions rope_theta and rope_scaling.
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    if scaling or rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {scaling or rope!r} is not supported (plain rotary "
                         "embeddings only)")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // heads):
        raise ValueError(f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads = "
                         f"{d // heads} is not supported")
    kv = hf.get("num_key_value_heads") or heads
    fields = dict(
        vocab_size=hf["vocab_size"], d_model=d, d_ff=hf["intermediate_size"],
        n_layers=hf["num_hidden_layers"], n_heads=heads, n_kv_heads=None if kv == heads else kv,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), embed_scale=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    return ModelConfig(**{**fields, **overrides})


def from_hf(folder, **overrides) -> Transformer:
    """Loads a local Hugging Face LlamaForCausalLM folder (``config.json`` + ``*.safetensors``).

    Args:
      folder: the folder's path.
      overrides: ``ModelConfig`` fields to replace (``implementation``, ``dtype``,
        ``max_seq_len``, ``twell`` ...); see ``hf_config`` for the mapping and what is rejected.
    Returns:
      The model, parameters in its ``param_dtype``. Every checkpoint tensor must be used and
      every parameter present (``rotary_emb.inv_freq`` buffers are ignored); ValueError names
      the offenders.
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model folder")
    try:  # a stranger's file: every problem as a ValueError naming the file
        cfg = hf_config(json.loads(config_path.read_text()), **overrides)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not JSON ({e})") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{config_path}: {e}") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        tensors.update(safetensors_io.load_file(path))

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    params = abstract.to_pure_dict()
    used = set()

    def take(name: str, target: dict, key: str, transpose: bool) -> None:
        if name not in tensors:
            raise ValueError(f"{folder}: tensor {name!r} is missing")
        value = np.asarray(tensors[name])
        value = value.T if transpose else value
        expected = target[key].shape
        if value.shape != tuple(expected):
            raise ValueError(f"{folder}: tensor {name!r} has shape {tensors[name].shape}, "
                             f"expected {expected[::-1] if transpose else expected}")
        target[key] = jnp.asarray(value.astype(np.float32), cfg.param_dtype)
        used.add(name)

    take("model.embed_tokens.weight", params, "embedding", False)
    take("model.norm.weight", params["final_norm"], "scale", False)
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints store the copy as well
    else:
        take("lm_head.weight", params, "lm_head", True)
    for i in range(cfg.n_layers):
        for hf_name, ((module, param), transpose) in _HF_LAYER_PARAMS.items():
            take(f"model.layers.{i}.{hf_name}", params["blocks"][i][module], param, transpose)
    unused = sorted(n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"{folder}: tensors not used by the model: {unused[:8]}"
                         + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))
    nnx.replace_by_pure_dict(abstract, params)
    return nnx.merge(graphdef, abstract)

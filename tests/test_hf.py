"""Tests of Hugging Face Llama loading (``model.from_hf``) and ``safetensors_io``, against an
independent float64 numpy forward of the HF Llama computation."""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
from flax import nnx
import numpy as np
import pytest

from tests.utils import TOLERANCES, rel_err
from twell_jax import model as model_lib
from twell_jax import safetensors_io

# Small, with every feature that differs from our defaults: grouped-query attention (4 query
# heads on 2 kv heads), untied lm_head, eps 1e-5, a rope theta that rotates visibly.
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 500.0, "hidden_act": "relu",
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "torch_dtype": "float32",
}


def hf_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under LlamaForCausalLM's names and [out, in] layout."""
    rng = np.random.default_rng(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    h = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * h
    normal = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    norm = lambda: (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    w = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32),
         "model.norm.weight": norm()}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": normal(d, d), p + "self_attn.k_proj.weight": normal(kv, d),
              p + "self_attn.v_proj.weight": normal(kv, d), p + "self_attn.o_proj.weight": normal(d, d),
              p + "mlp.gate_proj.weight": normal(f, d), p + "mlp.up_proj.weight": normal(f, d),
              p + "mlp.down_proj.weight": normal(d, f),
              p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm()}
    return w


def write_hf_folder(path, cfg: dict, weights: dict[str, np.ndarray], shards: int = 1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    names = sorted(weights)
    for s in range(shards):
        part = {n: weights[n] for n in names[s::shards]}
        safetensors_io.save_file(part, path / f"model-{s + 1:05d}-of-{shards:05d}.safetensors")
    return path


def hf_llama_forward(cfg: dict, w: dict[str, np.ndarray], ids) -> np.ndarray:
    """LlamaForCausalLM's forward in float64 numpy: ids [T] -> logits [T, V]."""
    w = {k: np.asarray(a, np.float64) for k, a in w.items()}
    t = len(ids)
    n, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // n
    eps = cfg["rms_norm_eps"]

    def rms_norm(x, weight):
        return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    angles = np.arange(t)[:, None] * inv_freq[None, :]
    emb = np.concatenate([angles, angles], axis=-1)  # [T, hd]
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]

    def rotate_half(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([-x2, x1], axis=-1)

    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    causal = np.tril(np.ones((t, t), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, n, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, n_kv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, n_kv, hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = (np.repeat(a, n // n_kv, axis=1) for a in (k, v))  # repeat_kv
        scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(hd)
        scores = np.where(causal[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("nts,snh->tnh", probs, v).reshape(t, n * hd)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate = np.maximum(h @ w[p + "mlp.gate_proj.weight"].T, 0.0)  # hidden_act "relu"
        x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


IDS = [3, 17, 95, 0, 42, 42, 7, 63, 11, 5, 80, 2]


@nnx.jit
def forward(model, tokens):
    return model(tokens)


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_from_hf_matches_float64_llama(tmp_path, tied):
    cfg = {**HF_CONFIG, "tie_word_embeddings": tied}
    weights = hf_weights(cfg)
    folder = write_hf_folder(tmp_path / "hf", cfg, weights, shards=2)
    expected = hf_llama_forward(cfg, weights, IDS)
    model = model_lib.from_hf(folder, dtype=jnp.float32, implementation="xla")
    mcfg = model.cfg
    assert (mcfg.n_kv_heads, mcfg.embed_scale, mcfg.tie_embeddings, mcfg.norm_eps) == (
        2, False, tied, 1e-5)
    assert (model.lm_head is None) == tied
    logits = forward(model, jnp.asarray([IDS]))[0]
    assert rel_err(logits, expected) < TOLERANCES["logits"][jnp.dtype(jnp.float32)]
    bf16 = model_lib.from_hf(folder, implementation="xla")  # default compute dtype bf16
    assert (rel_err(forward(bf16, jnp.asarray([IDS]))[0], expected)
            < TOLERANCES["logits"][jnp.dtype(jnp.bfloat16)])


def test_from_hf_generate_greedy_matches_float64(tmp_path):
    """Cached decoding of the loaded model (GQA, untied) picks the float64 model's argmax."""
    weights = hf_weights(HF_CONFIG, seed=1)
    model = model_lib.from_hf(write_hf_folder(tmp_path / "hf", HF_CONFIG, weights),
                              dtype=jnp.float32, implementation="xla")
    prompt = IDS[:5]
    tokens = np.asarray(model_lib.generate(model, [prompt], max_new_tokens=6))[0]
    seq = list(prompt)
    for _ in range(6):
        logits = hf_llama_forward(HF_CONFIG, weights, seq)[-1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-4, "near-tie: the test would be flaky"
        seq.append(int(np.argmax(logits)))
    assert tokens.tolist() == seq[len(prompt):]


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "silu"}, "hidden_act 'silu' is not supported"),
    ({"model_type": "mistral"}, "model_type 'mistral'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling"),
    ({"head_dim": 16}, "head_dim 16"),
    ({"num_key_value_heads": 3}, "n_kv_heads must be None or a positive int dividing"),
])
def test_hf_config_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        model_lib.hf_config({**HF_CONFIG, **change})


def test_from_hf_missing_and_unexpected_tensors(tmp_path):
    weights = hf_weights(HF_CONFIG)
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight' is missing"):
        model_lib.from_hf(write_hf_folder(tmp_path / "a", HF_CONFIG, missing))
    extra = {**weights, "model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}
    with pytest.raises(ValueError, match="not used by the model.*q_proj.bias"):
        model_lib.from_hf(write_hf_folder(tmp_path / "b", HF_CONFIG, extra))
    wrong = {**weights, "model.norm.weight": np.ones(31, np.float32)}
    with pytest.raises(ValueError, match="model.norm.weight' has shape"):
        model_lib.from_hf(write_hf_folder(tmp_path / "c", HF_CONFIG, wrong))
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_lib.from_hf(tmp_path / "nothing")


def test_safetensors_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "b.bf16": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),
               "c": np.arange(6, dtype=np.int64).reshape(2, 3),
               "d.f16": np.ones((2, 2, 2), np.float16),
               "scalar": np.asarray(2.5, np.float64)}
    safetensors_io.save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "pt"})
    raw = (tmp_path / "t.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    assert header["b.bf16"]["dtype"] == "BF16" and header["c"]["shape"] == [2, 3]
    loaded = safetensors_io.load_file(tmp_path / "t.safetensors")
    assert sorted(loaded) == sorted(tensors)
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape
        np.testing.assert_array_equal(loaded[name], array)
    (tmp_path / "bad.safetensors").write_bytes(raw[:-4])  # truncated data
    with pytest.raises(ValueError, match="do not match"):
        safetensors_io.load_file(tmp_path / "bad.safetensors")

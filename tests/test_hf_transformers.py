"""``model.from_hf`` against Hugging Face ``transformers`` itself: a tiny random LlamaForCausalLM
saved with ``save_pretrained`` (safetensors), loaded by ``from_hf``, the same logits in float32.

Skipped unless both ``torch`` and ``transformers`` are importable (they are not dependencies of
twell-jax; the GPU machines may have them). ``tests/test_hf.py`` checks the same mapping
against an independent float64 numpy forward without them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from twell_jax import model as model_lib
from twell_jax.config import TwELLConfig

torch = pytest.importorskip("torch", reason="torch is not installed: the comparison with "
                                            "transformers needs it")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")


def tiny_llama(tmp_path, tied: bool):
    """Saves a random float32 LlamaForCausalLM with every feature ``from_hf`` maps (ReLU gate,
    grouped-query attention: 4 query heads on 2 kv heads, rms_norm_eps, rope_theta, tied or
    untied embeddings) to ``tmp_path``; returns (the torch model in eval mode, the folder)."""
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=500.0, hidden_act="relu", tie_word_embeddings=tied,
        attention_bias=False, mlp_bias=False, initializer_range=0.1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # norms at their init (ones) would not test that they are loaded
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    folder = tmp_path / ("tied" if tied else "lm_head")
    hf.save_pretrained(folder)  # safetensors: the default (and in transformers 5 the only)
    assert list(folder.glob("*.safetensors")), "save_pretrained wrote no safetensors file"
    return hf, folder


def rel_err(actual, expected) -> float:
    """||actual - expected|| / ||expected|| (float64)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@nnx.jit
def forward_with_stats(model, tokens):
    """(logits [B, T, V] float32, the FFN statistics each layer sowed)."""
    return nnx.capture(model, nnx.Intermediate)(tokens)


@pytest.mark.parametrize("implementation", ["xla", "reference", "pallas"])
@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_logits_match_transformers(tmp_path, tied, implementation):
    hf, folder = tiny_llama(tmp_path, tied)
    ids = np.random.default_rng(1).integers(0, 96, size=(3, 16))
    with torch.no_grad():
        expected = hf(torch.as_tensor(ids)).logits.numpy()  # [3, 16, 96] float32

    # A random ReLU gate fires on about half of the 64 units: with the default knobs every row
    # would be heavy (more than 8 per tile) and take the dense backup. 64 slots in the one
    # (padded) tile keep every row light, so the sparse products themselves are compared.
    twell = TwELLConfig(slots_per_tile=64, max_row_density=1.0)
    model = model_lib.from_hf(folder, implementation=implementation, dtype=jnp.float32,
                              twell=twell)
    assert model.cfg.tie_embeddings is tied and model.cfg.kv_heads == 2
    assert model.cfg.rope_theta == 500.0 and model.cfg.norm_eps == 1e-5
    with jax.default_matmul_precision("highest"):  # no TF32 on a GPU
        logits, inter = forward_with_stats(model, jnp.asarray(ids, jnp.int32))
    stats = model_lib.layer_stats(inter, model.cfg.n_layers)
    assert all(int(s.heavy_rows) == 0 and not bool(s.dense_fallback) for s in stats)
    assert logits.shape == expected.shape
    assert np.std(expected) > 0.1  # not a degenerate model: the comparison means something
    assert rel_err(logits, expected) < 1e-4


def test_greedy_generation_matches_transformers(tmp_path):
    hf, folder = tiny_llama(tmp_path, tied=False)
    prompt = np.random.default_rng(2).integers(0, 96, size=(2, 7))
    with torch.no_grad():
        # min_new_tokens: the config's end-of-sequence id must not stop HF early.
        out = hf.generate(torch.as_tensor(prompt), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False, pad_token_id=0)
    expected = out[:, prompt.shape[1]:].numpy()
    model = model_lib.from_hf(folder, implementation="xla", dtype=jnp.float32)
    with jax.default_matmul_precision("highest"):
        tokens = model_lib.generate(model, prompt, max_new_tokens=8)
    np.testing.assert_array_equal(np.asarray(tokens), expected)

"""Tests of text generation: the KV cache (``prefill`` / ``decode_step``), ``generate`` and
``generate_chunks`` in ``twell_jax.model``, and ``experiments/generate.py``.

Compiles dominate on the CPU, so the tests share a few shapes: two prompts of 6 and 4 tokens,
8 new tokens."""

from __future__ import annotations

import dataclasses
import functools
import re
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.common import default_interpret
from tests.test_hf import HF_CONFIG, hf_weights, write_hf_folder
from tests.utils import TOLERANCES, load_experiment, rel_err, slow
from twell_jax import model as model_lib
from twell_jax.config import TwELLConfig
from twell_jax import data

PROMPTS = [[5, 104, 101, 108, 108, 111], [7, 200, 33, 64]]
NEW = 8
WIDTH = 6 + NEW  # the uncached reference runs on one padded width: one compile
PAD = model_lib.PAD_TOKEN
# As test_model.py: no heavy rows, so the sparse paths compute every token themselves.
ALL_SPARSE = TwELLConfig(tile_width=16, slots_per_tile=16, max_row_density=1.0,
                         dense_fallback_density=1.0, backup_rows=0)


@nnx.jit
def forward(model, tokens):
    return model(tokens)


@nnx.jit
def prefill(model, tokens, lengths, cache):
    return model.prefill(tokens, lengths, cache)


@nnx.jit
def decode_step(model, tokens, cache):
    return model.decode_step(tokens, cache)


@nnx.jit
def token_nnz(model, tokens):
    return model_lib.token_nnz(model, tokens)


def padded(prompts, width):
    out = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        out[i, :len(p)] = p
    return out, np.asarray([len(p) for p in prompts], np.int32)


def uncached_greedy(model, prompts, steps):
    """Greedy tokens and each step's logits [steps, B, V] from the full forward on the growing
    sequences (right-padded to one width: causal attention ignores the padding)."""
    seqs, lengths = padded(prompts, WIDTH)
    rows = np.arange(len(prompts))
    tokens, logits = [], []
    for i in range(steps):
        step_logits = np.asarray(forward(model, jnp.asarray(seqs)))[rows, lengths + i - 1]
        token = step_logits.argmax(-1)
        seqs[rows, lengths + i] = token
        tokens.append(token)
        logits.append(step_logits)
    return np.stack(tokens, 1), np.stack(logits)


# ------------------------------------------------------------------------------------------
# The cache and greedy decoding against the full forward.


@pytest.mark.parametrize("dtype", [jnp.float32,
                                   pytest.param(jnp.bfloat16, marks=pytest.mark.slow)],
                         ids=["f32", "bf16"])
def test_cached_decoding_matches_full_forward(dtype):
    model = model_lib.build("tiny", dtype=dtype, seed=1, implementation="xla")
    expected_tokens, expected_logits = uncached_greedy(model, PROMPTS, NEW)
    # Logits of every step: prefill + decode_step on the cache against the full forward.
    tokens, lengths = padded(PROMPTS, 6)
    cache = model.init_cache(2, WIDTH)
    assert cache.k[0].shape == (2, WIDTH, 4, 16) and cache.k[0].dtype == jnp.dtype(dtype)
    logits, cache = prefill(model, jnp.asarray(tokens), jnp.asarray(lengths), cache)
    for i in range(NEW):
        assert rel_err(logits, expected_logits[i]) < TOLERANCES["logits"][jnp.dtype(dtype)], i
        np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + i)
        logits, cache = decode_step(model, jnp.asarray(expected_tokens[:, i]), cache)
    # generate: one jitted program, same greedy tokens.
    generated, stats = model_lib.generate(model, PROMPTS, max_new_tokens=NEW,
                                          return_stats=True)
    assert generated.shape == (2, NEW) and generated.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(generated), expected_tokens)
    assert stats["nnz_mean"].shape == (NEW, model.cfg.n_layers)
    if dtype == jnp.float32:
        # Step statistics: the mean active units of the tokens each forward ran on.
        seqs, _ = padded([p + list(t) for p, t in zip(PROMPTS, expected_tokens)], WIDTH)
        nnz = np.asarray(token_nnz(model, jnp.asarray(seqs))).reshape(-1, 2, WIDTH)
        rows = np.arange(2)
        decode = np.stack([nnz[:, rows, lengths + i].mean(-1) for i in range(NEW - 1)])
        np.testing.assert_allclose(stats["nnz_mean"][1:], decode, rtol=1e-6)
        prompt_nnz = np.asarray(token_nnz(model, jnp.asarray(tokens))).mean(-1)
        np.testing.assert_allclose(stats["nnz_mean"][0], prompt_nnz, rtol=1e-6)


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow),
                                   jnp.bfloat16], ids=["f32", "bf16"])
def test_decode_kernels_match_xla(dtype):
    """``ModelConfig.decode_kernels``: the attention's few-row products on the Pallas kernels
    (interpret mode here) give the plain XLA model's logits at every step, and its tokens."""
    models = {flag: model_lib.build("tiny", dtype=dtype, seed=2, implementation="xla",
                                    decode_kernels=flag) for flag in (False, True)}
    cache = models[True].init_cache(2, WIDTH)
    for flag, model in models.items():  # the kernels run exactly when asked for
        jaxpr = str(jax.make_jaxpr(lambda t, c, m=model: m.decode_step(t, c))(
            jnp.zeros((2,), jnp.int32), cache))
        assert ("twell_gemv" in jaxpr) == flag and ("twell_decode_attention" in jaxpr) == flag
        # Two launches per layer: q, k and v in one, the output projection.
        assert jaxpr.count("name=twell_gemv") == (2 * model.cfg.n_layers if flag else 0)
        # Each residual add inside the norm after it: two a layer and the final norm; q, k, v
        # finished, rotated and written into the cache: one a layer.
        assert jaxpr.count("name=twell_add_rms_norm") == (
            2 * model.cfg.n_layers + 1 if flag else 0)
        assert jaxpr.count("name=twell_qkv_rope_cache") == (model.cfg.n_layers if flag else 0)
    # Under a context mesh of several devices the plain XLA products run (XLA partitions them).
    attn = models[True].blocks[0].attn
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("data",))):
        assert not attn._kernels()
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("data",))):
        assert attn._kernels()
    tokens, lengths = padded(PROMPTS, 6)
    state = {}
    for flag, model in models.items():
        cache = model.init_cache(2, WIDTH)
        logits, cache = prefill(model, jnp.asarray(tokens), jnp.asarray(lengths), cache)
        state[flag] = [np.asarray(logits)]
        for i in range(3):
            logits, cache = decode_step(model, jnp.asarray(np.arange(2) + 3 * i), cache)
            state[flag].append(np.asarray(logits))
    for i, (want, got) in enumerate(zip(state[False], state[True])):
        assert np.isfinite(got).all()
        assert rel_err(got, want) < TOLERANCES["logits"][jnp.dtype(dtype)], i
    if dtype == jnp.float32:
        np.testing.assert_array_equal(
            np.asarray(model_lib.generate(models[True], PROMPTS, max_new_tokens=NEW)),
            np.asarray(model_lib.generate(models[False], PROMPTS, max_new_tokens=NEW)))


def test_padded_prompt_same_as_alone():
    """bf16: the short prompt gives the same tokens alone as padded in a batch with a longer
    one, given as a list or as a padded array with prompt_lengths (padding of any value)."""
    model = model_lib.build("tiny", seed=2, implementation="xla")
    together = np.asarray(model_lib.generate(model, PROMPTS, max_new_tokens=NEW))
    array, lengths = padded(PROMPTS, 6)
    array[1, 4:] = 99
    again = model_lib.generate(model, array, prompt_lengths=lengths, max_new_tokens=NEW)
    np.testing.assert_array_equal(np.asarray(again), together)
    alone = model_lib.generate(model, [PROMPTS[1]], max_new_tokens=NEW)
    np.testing.assert_array_equal(np.asarray(alone)[0], together[1])


def test_sparse_implementations_decode_like_dense():
    """float32, every row on the sparse path (pallas: the kernels in interpret mode, inside
    the decode loop; also with ``decode_kernels``, as on a GPU: the attention's kernels and
    each residual add fused into the next norm): the same tokens and FFN statistics as the
    dense FFN."""
    prompts = [[1, 2, 3], [4, 5]]
    # One layer: the interpret-mode kernels are slow to compile.
    kw = dict(dtype=jnp.float32, seed=3, twell=ALL_SPARSE, n_layers=1)
    run = lambda impl, **more: model_lib.generate(
        model_lib.build("tiny", implementation=impl, **kw, **more), prompts, max_new_tokens=3,
        return_stats=True)
    expected, expected_stats = run("xla")
    for impl, more in (("reference", {}), ("pallas", {}), ("pallas", {"decode_kernels": True})):
        tokens, stats = run(impl, **more)
        what = f"{impl} {more}"
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected), err_msg=what)
        np.testing.assert_allclose(stats["nnz_mean"], expected_stats["nnz_mean"], rtol=1e-6,
                                   err_msg=what)


def test_decode_loop_runs_dense_when_the_prefill_says_so():
    """The decode loop runs its FFN layers dense when the prefill's activity says the decode
    path would cost more (here a fixed density threshold below the random model's ~half
    active units): the same tokens as the dense model, from ``generate`` and the stream, and
    the choice is False where it cannot apply (no threshold and no GPU cost model)."""
    prompts = [[1, 2, 3], [4, 5]]
    dense_decode = dataclasses.replace(ALL_SPARSE, dense_fallback_density=0.1)
    kw = dict(dtype=jnp.float32, seed=3, n_layers=1)
    expected = model_lib.generate(model_lib.build("tiny", implementation="xla", **kw), prompts,
                                  max_new_tokens=3)
    model = model_lib.build("tiny", implementation="pallas", twell=dense_decode, **kw)
    tokens, stats = model_lib.generate(model, prompts, max_new_tokens=3, return_stats=True)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected))
    assert float(stats["nnz_mean"][0, 0]) > 0.1 * model.cfg.d_ff  # the prefill's activity
    assert bool(model_lib.decode_runs_dense(model.cfg, stats["nnz_mean"][0], 2))
    assert not bool(model_lib.decode_runs_dense(model.cfg, np.zeros((1,), np.float32), 2))
    streamed = np.concatenate([t for t, _ in model_lib.generate_chunks(
        model, prompts, max_new_tokens=3, chunk_size=2)], axis=1)
    np.testing.assert_array_equal(streamed, np.asarray(expected))
    graphdef, state = nnx.split(model)
    seqs, lengths = padded(prompts, 3)
    ds, _, nnz_mean, nnz_p99 = model_lib.generation_start(
        graphdef, state, jnp.asarray(seqs), jnp.asarray(lengths), jax.random.key(0),
        jnp.zeros((model.cfg.vocab_size,), bool), sampling=model_lib.Sampling(),
        cache_len=WIDTH)
    np.testing.assert_array_equal(np.asarray(nnz_mean), stats["nnz_mean"][0])
    assert np.isnan(np.asarray(nnz_p99)).all()  # a fixed threshold reads no tails
    for dense_ffn in (False, True):  # the dense loop runs no TwELL kernel
        text = str(jax.make_jaxpr(functools.partial(
            model_lib.generation_steps, sampling=model_lib.Sampling(), chunk=2,
            dense_ffn=dense_ffn), static_argnums=0)(graphdef, state, ds, jnp.int32(2)))
        assert ("twell_scan_up_down" in text) != dense_ffn
    for cfg in (dataclasses.replace(model.cfg, twell=ALL_SPARSE),  # threshold 1.0: never
                dataclasses.replace(model.cfg, implementation="xla")):
        assert model_lib.decode_runs_dense(cfg, stats["nnz_mean"][0], 2) is False
    cost_model = dataclasses.replace(model.cfg, twell=None)
    if default_interpret():  # interpret mode: the kernels always run
        assert model_lib.decode_runs_dense(cost_model, stats["nnz_mean"][0], 2) is False
    else:  # compiled, the cost model sends half the units active dense
        assert bool(model_lib.decode_runs_dense(cost_model, stats["nnz_mean"][0], 2))


def test_first_token_routed_dense_is_the_dense_models_program(compiled_kernels):
    """On a GPU a prompt too short for the sparse path's fixed cost runs its FFN layers dense
    by their shape: the first token's program (prefill, the layers' activity that the decode
    loop's choice reads, sampling) is then the dense model's, statement for statement, so
    the sparse model's first token costs what the dense model's does."""
    from twell_jax import ffn
    prompts = jnp.ones((2, 48), jnp.int32)  # 96 token rows: past decode_rows
    lengths = jnp.asarray([48, 40], jnp.int32)
    programs = {}
    for implementation in ("xla", "pallas"):
        model = model_lib.build("tiny", seed=1, implementation=implementation)
        cfg = model.cfg
        assert ffn.path_for(implementation, prompts.size, cfg.d_model, cfg.d_ff,
                            cfg.dtype) == "dense"
        graphdef, state = nnx.split(model)
        stop = jnp.zeros((cfg.vocab_size,), bool)
        programs[implementation] = model_lib.generation_start.lower(
            graphdef, state, prompts, lengths, jax.random.key(0), stop,
            sampling=model_lib.Sampling(), cache_len=64,
            stacked=model.stack_for_inference()).as_text(debug_info=False)
    assert programs["pallas"] == programs["xla"]


def test_decode_density_limit_depends_on_rows(monkeypatch):
    """With the cost model deciding (as compiled on a GPU), a decode loop at ~8% active units
    stays sparse for 1-4 rows, where the decode kernel's narrower slices still beat dense,
    and runs dense from 5 rows; past 1/8 it runs dense at one row too, and the design point
    stays sparse at 64 rows."""
    from twell_jax import ffn
    monkeypatch.setattr(ffn, "default_interpret", lambda: False)
    d, f = 2048, 5632

    def dense(share: float, rows: int) -> bool:
        nnz = np.full((3,), share * f, np.float32)
        return bool(ffn.decode_runs_dense("pallas", nnz, rows, d, f, jnp.bfloat16))

    assert [dense(0.08, rows) for rows in (1, 2, 4, 5, 8)] == [False, False, False, True, True]
    assert dense(0.15, 1) and dense(0.5, 1)
    assert not dense(0.005, 1) and not dense(0.005, 64)


@pytest.mark.parametrize("batch", [1, slow(2), slow(4)])
def test_prefill_records_the_tails_the_choice_reads(monkeypatch, batch):
    """generation_start returns the prefill's own per-layer p99 where the decode loop's choice
    can depend on it (with the cost model deciding, from 3 rows at these shapes), else NaN;
    in interpret mode the cost model never decides."""
    from twell_jax import ffn
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]][:batch]
    model = model_lib.build("tiny", implementation="pallas", dtype=jnp.float32, seed=5,
                            n_layers=2)
    graphdef, state = nnx.split(model)
    seqs, lengths = (jnp.asarray(a) for a in padded(prompts, 5))
    _, inter = nnx.capture(model.prefill, nnx.Intermediate)(
        seqs, lengths, model.init_cache(batch, WIDTH))
    expected = {name: [float(getattr(s, name)) for s in model_lib.layer_stats(inter, 2)]
                for name in ("nnz_mean", "nnz_p99")}

    def start():
        return model_lib.generation_start(graphdef, state, seqs, lengths, jax.random.key(0),
                                          jnp.zeros((model.cfg.vocab_size,), bool),
                                          sampling=model_lib.Sampling(), cache_len=WIDTH)

    monkeypatch.setattr(ffn, "default_interpret", lambda: True)  # as on a CPU, on any machine
    jax.clear_caches()
    assert np.isnan(np.asarray(start()[3])).all()
    monkeypatch.setattr(ffn, "default_interpret", lambda: False)
    jax.clear_caches()  # generation_start was traced in interpret mode
    _, _, nnz_mean, nnz_p99 = start()
    np.testing.assert_array_equal(np.asarray(nnz_mean), expected["nnz_mean"])
    if batch >= 3:
        np.testing.assert_array_equal(np.asarray(nnz_p99), expected["nnz_p99"])
        assert (np.asarray(nnz_mean) <= np.asarray(nnz_p99)).all()
    else:
        assert np.isnan(np.asarray(nnz_p99)).all()
    jax.clear_caches()


def test_decode_loop_reads_the_layers_tails(monkeypatch):
    """With the cost model deciding, a layer whose busiest rows hold a few hundred units sends
    a decode loop of many rows dense although its mean alone would not (rows drawn from a
    trained model's counts, mean 41 and p99 243 of 5632: dense at 64 rows, sparse at 8-32,
    where such rows measured 1.00-1.29x of dense); uniform rows' p99 changes nothing."""
    from twell_jax import ffn
    monkeypatch.setattr(ffn, "default_interpret", lambda: False)
    d, f, layers = 2048, 5632, 3

    def dense(mean: float, p99: float | None, rows: int) -> bool:
        nnz_p99 = None if p99 is None else np.full((layers,), p99, np.float32)
        return bool(ffn.decode_runs_dense("pallas", np.full((layers,), mean, np.float32), rows,
                                          d, f, jnp.bfloat16, nnz_p99=nnz_p99))

    assert [dense(41, 243, rows) for rows in (1, 8, 16, 32, 64)] == [False] * 4 + [True]
    assert not dense(41, None, 64)  # the mean alone
    assert not any(dense(28, 41, rows) for rows in (1, 8, 64))  # uniform at the design point
    # Uniform rows just below the mean's break-even at 64 rows: their p99 does not move it.
    assert not dense(40, 40 + 2.33 * 40 ** 0.5, 64) and dense(60, 60 + 2.33 * 60 ** 0.5, 64)
    # One heavy-tailed layer among light ones is enough; the fixed threshold ignores tails.
    assert bool(ffn.decode_runs_dense("pallas", np.full((layers,), 28, np.float32), 64, d, f,
                                      jnp.bfloat16, nnz_p99=np.array([41, 41, 600], np.float32)))
    threshold = TwELLConfig(dense_fallback_density=0.05)
    assert not bool(ffn.decode_runs_dense("pallas", np.full((layers,), 41, np.float32), 64, d,
                                          f, jnp.bfloat16, threshold,
                                          nnz_p99=np.full((layers,), 2000, np.float32)))


def _pallas_calls(jaxpr, name: str):
    """The equations of the pallas_calls named ``name`` in a closed jaxpr, nested ones too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call" and eqn.params.get("name") == name:
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _pallas_calls(sub, name)
    return found


def test_sparse_decode_step_adds_the_ffn_partial_sums_in_the_norm():
    """The "pallas" model's fused decode step hands the FFN's float32 partial sums (one per
    slice of F) straight to the next norm's kernel, as it does the output projection's: every
    ``add_rms_norm`` but the first block's attention norm adds partial sums; the dense model's
    FFN output is added finished."""
    for impl, want in (("pallas", 2), ("xla", 1)):
        model = model_lib.build("tiny", implementation=impl, seed=3, decode_kernels=True)
        cache = model.init_cache(2, WIDTH)
        jaxpr = jax.make_jaxpr(lambda t, c: model.decode_step(t, c))(
            jnp.zeros((2,), jnp.int32), cache).jaxpr
        norms = _pallas_calls(jaxpr, "twell_add_rms_norm")
        assert len(norms) == 2 * model.cfg.n_layers + 1, impl
        partials = [e for e in norms if len(e.invars) == 3 and e.invars[1].aval.ndim == 3
                    and e.invars[1].aval.dtype == jnp.float32]
        assert len(partials) == want * model.cfg.n_layers, impl


# ------------------------------------------------------------------------------------------
# Sampling, stop tokens, chunks.

SAMPLING = dict(temperature=0.9, top_k=50, top_p=0.95)


@pytest.mark.slow
def test_statistics_only_when_asked():
    """generate computes the FFN statistics only with return_stats: the tokens are the same,
    and the compiled decode loop without them has fewer reductions (the per-token counts')."""
    model = model_lib.build("tiny", seed=1, implementation="reference", twell=ALL_SPARSE)
    tokens, stats = model_lib.generate(model, PROMPTS, max_new_tokens=NEW, return_stats=True)
    assert np.isfinite(stats["nnz_mean"]).all()
    np.testing.assert_array_equal(
        np.asarray(model_lib.generate(model, PROMPTS, max_new_tokens=NEW)), np.asarray(tokens))
    graphdef, state = nnx.split(model)
    seqs, lengths = padded(PROMPTS, 6)
    stop = jnp.zeros((model.cfg.vocab_size,), bool)
    sampling = model_lib.Sampling()
    compiled = {}
    for flag in (False, True):
        ds, _, nnz0, p99 = model_lib.generation_start(
            graphdef, state, jnp.asarray(seqs), jnp.asarray(lengths), jax.random.key(0), stop,
            sampling=sampling, cache_len=WIDTH, stats=flag)
        assert np.isnan(np.asarray(nnz0)).all() != flag
        assert np.isnan(np.asarray(p99)).all()  # read only by a cost model's choice
        args = (graphdef, state, ds, jnp.int32(2))
        kwargs = dict(sampling=sampling, chunk=2, stats=flag)
        _, _, nnz = model_lib.generation_steps(*args, **kwargs)
        assert np.isnan(np.asarray(nnz)).all() != flag
        compiled[flag] = model_lib.generation_steps.lower(*args, **kwargs).compile().as_text()
    reductions = {flag: len(re.findall(r" reduce\(", text)) for flag, text in compiled.items()}
    assert reductions[False] < reductions[True], reductions


@pytest.mark.slow
def test_sampling_chunks_and_keys():
    model = model_lib.build("tiny", seed=4, implementation="xla")
    key = jax.random.key(11)
    a = np.asarray(model_lib.generate(model, PROMPTS, max_new_tokens=NEW, key=key, **SAMPLING))
    b = np.asarray(model_lib.generate(model, PROMPTS, max_new_tokens=NEW, key=key, **SAMPLING))
    c = np.asarray(model_lib.generate(model, PROMPTS, max_new_tokens=NEW,
                                      key=jax.random.key(12), **SAMPLING))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.min() >= 0 and a.max() < model.cfg.vocab_size
    # The stream (first the prefill's token, then chunks of 3 decode steps) gives the same.
    chunks = list(model_lib.generate_chunks(model, PROMPTS, max_new_tokens=NEW, chunk_size=3,
                                            key=key, **SAMPLING))
    assert [c[0].shape[1] for c in chunks] == [1, 3, 3, 1]
    np.testing.assert_array_equal(np.concatenate([c[0] for c in chunks], axis=1), a)
    assert np.concatenate([c[1] for c in chunks]).shape == (NEW, model.cfg.n_layers)


def test_generate_with_stacked_parameters(monkeypatch):
    """A stack made once (``stack_for_inference``) gives the tokens of a prefill that stacks
    per call; the prompts here are short, so the scan is forced for every call."""
    monkeypatch.setattr(model_lib.layer_scan, "SCAN_MIN_TOKENS", 1)
    model = model_lib.build("tiny", seed=5, implementation="xla")
    stacked = model.stack_for_inference()
    key = jax.random.key(3)
    plain = np.asarray(model_lib.generate(model, PROMPTS, max_new_tokens=NEW, key=key,
                                          **SAMPLING))
    np.testing.assert_array_equal(np.asarray(model_lib.generate(
        model, PROMPTS, max_new_tokens=NEW, key=key, stacked=stacked, **SAMPLING)), plain)
    chunks = model_lib.generate_chunks(model, PROMPTS, max_new_tokens=NEW, chunk_size=4,
                                       key=key, stacked=stacked, **SAMPLING)
    np.testing.assert_array_equal(np.concatenate([c[0] for c in chunks], axis=1), plain)


def test_sample_logits_filters():
    """Empirical frequencies over 4000 rows: temperature, top-k and top-p keep the right sets."""
    probs = np.asarray([0.5, 0.25, 0.15, 0.1])
    logits = jnp.log(jnp.tile(jnp.asarray(probs, jnp.float32), (4000, 1)))
    key = jax.random.key(0)

    def freq(**kw):
        tokens = np.asarray(model_lib.sample_logits(logits, key, model_lib.Sampling(**kw)))
        return np.bincount(tokens, minlength=4) / len(tokens)

    np.testing.assert_allclose(freq(temperature=1.0), probs, atol=0.03)
    np.testing.assert_array_equal(freq(temperature=0.0), [1, 0, 0, 0])
    np.testing.assert_array_equal(freq(temperature=1.0, top_k=1), [1, 0, 0, 0])
    np.testing.assert_allclose(freq(temperature=1.0, top_k=2), [2 / 3, 1 / 3, 0, 0], atol=0.03)
    # top_p 0.7: 0.5 < 0.7 so token 1 is needed, 0.75 >= 0.7 so token 2 is not.
    np.testing.assert_allclose(freq(temperature=1.0, top_p=0.7), [2 / 3, 1 / 3, 0, 0],
                               atol=0.03)
    np.testing.assert_array_equal(freq(temperature=1.0, top_p=0.4), [1, 0, 0, 0])
    sharp = freq(temperature=0.5)  # probabilities squared, renormalised
    np.testing.assert_allclose(sharp, probs ** 2 / (probs ** 2).sum(), atol=0.03)


def test_stop_tokens_pad_the_rest():
    model = model_lib.build("tiny", seed=5, implementation="xla")
    free = np.asarray(model_lib.generate(model, PROMPTS, max_new_tokens=NEW))
    stop = int(free[0, 2])
    tokens, stats = model_lib.generate(model, PROMPTS, max_new_tokens=NEW, stop_tokens=[stop],
                                       return_stats=True)
    tokens = np.asarray(tokens)
    for row, free_row in zip(tokens, free):
        hits = np.flatnonzero(free_row == stop)
        end = hits[0] + 1 if hits.size else NEW
        np.testing.assert_array_equal(row[:end], free_row[:end])
        assert np.all(row[end:] == PAD)
    # Both sequences stop at their first token: the loop ends at once, later steps are NaN.
    tokens, stats = model_lib.generate(model, PROMPTS, max_new_tokens=NEW,
                                       stop_tokens=[int(free[0, 0]), int(free[1, 0])],
                                       return_stats=True)
    np.testing.assert_array_equal(np.asarray(tokens)[:, 0], free[:, 0])
    assert np.all(np.asarray(tokens)[:, 1:] == PAD)
    assert np.all(np.isfinite(stats["nnz_mean"][0])) and np.all(np.isnan(stats["nnz_mean"][1:]))


# ------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prompts=[[1, 2], []]), ValueError, "empty prompt"),
    (dict(prompts=np.zeros((2, 0), np.int32)), ValueError, "empty prompt"),
    (dict(prompts=[]), ValueError, "prompts is empty"),
    (dict(prompts=np.zeros((1, 120), np.int32), max_new_tokens=10), ValueError,
     "more than max_seq_len=128"),
    (dict(prompts=np.zeros((1, 129), np.int32), max_new_tokens=1), ValueError,
     "more than max_seq_len=128"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=-3), ValueError, "max_new_tokens must be an int >= 1"),
    (dict(temperature=-0.5), ValueError, "temperature must be a number >= 0"),
    (dict(temperature=1.0, top_k=0, key=jax.random.key(0)), ValueError, "top_k must be"),
    (dict(temperature=1.0, top_p=0.0, key=jax.random.key(0)), ValueError, "top_p must be"),
    (dict(temperature=1.0, top_p=1.5, key=jax.random.key(0)), ValueError, "top_p must be"),
    (dict(temperature=1.0), ValueError, "needs a PRNG key"),
    (dict(temperature=1.0, key=3), TypeError, "key must be a PRNG key"),
    (dict(prompts=[[1, 256]]), ValueError, r"token ids must be in \[0, 256\)"),
    (dict(stop_tokens=[300]), ValueError, "stop token 300 is outside"),
    (dict(prompts=np.ones((2, 3), np.float32)), TypeError, "prompts must be integers"),
    (dict(prompts=np.ones((2, 3), np.int32), prompt_lengths=[3, 4]), ValueError, "exceed"),
    (dict(prompt_lengths=[3, 2]), ValueError, "prompt_lengths is for a padded"),
])
def test_generate_rejects(kwargs, error, message):
    model = model_lib.build("tiny", implementation="xla")
    kwargs = {"prompts": PROMPTS, "max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=message):
        model_lib.generate(model, **kwargs)
    with pytest.raises(error, match=message):
        next(model_lib.generate_chunks(model, **kwargs))


def test_config_fields_validated():
    tiny = model_lib.CONFIGS["tiny"]
    with pytest.raises(ValueError, match="n_kv_heads must be"):
        dataclasses.replace(tiny, n_kv_heads=3)
    with pytest.raises(TypeError, match="embed_scale must be a bool"):
        dataclasses.replace(tiny, embed_scale=1)
    with pytest.raises(ValueError, match="norm_eps must be positive"):
        dataclasses.replace(tiny, norm_eps=0.0)
    gqa = dataclasses.replace(tiny, n_kv_heads=2, tie_embeddings=False)
    abstract = nnx.eval_shape(lambda: model_lib.Transformer(gqa, rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert n == gqa.param_count()
    assert abstract.blocks[0].attn.w_k.shape == (64, 32) and abstract.lm_head.shape == (64, 256)


# ------------------------------------------------------------------------------------------
# experiments/generate.py.


@pytest.fixture(scope="module")
def script():
    with load_experiment("generate") as module:
        yield module


def test_script_random_tiny(script, capsys):
    summary = script.main(["--max-new-tokens", "6", "--chunk", "2", "--prompt", "def f",
                           "--no-stop"])
    out = capsys.readouterr().out
    assert len(summary["tokens"]) == 6 and summary["decode_tokens"] == 5
    assert out.splitlines()[1].startswith("def f")
    assert "tokens/s" in out and "active FFN units per token by layer (of 256)" in out
    assert len(summary["nnz_prefill"]) == len(summary["nnz_decode"]) == 2
    # The printed completion is the greedy tokens of the same model (the compiled stream).
    chunks = model_lib.generate_chunks(model_lib.build("tiny", seed=0, implementation="xla"), [list(b"def f")],
                                       max_new_tokens=6, chunk_size=2)
    assert summary["tokens"] == np.concatenate([c[0] for c in chunks], axis=1)[0].tolist()
    with pytest.raises(SystemExit):
        script.main(["--max-new-tokens", "0"])
    with pytest.raises(SystemExit, match="max_seq_len"):
        script.main(["--prompt", "x" * 129], quiet=True)


@pytest.mark.slow  # the script's fast smoke run: test_script_random_tiny
def test_script_restores_train_checkpoint(script, tmp_path, capsys):
    with load_experiment("train") as train:
        corpus = train.Corpus(np.frombuffer(b"abcdefgh " * 200, np.uint8),
                              np.frombuffer(b"abcdefgh " * 20, np.uint8), 256, "test bytes")
        cfg = train.parse_args(["--steps", "3", "--batch-size", "2", "--seq-len", "16",
                                "--implementation", "xla", "--warmup", "1",
                                "--out-dir", str(tmp_path / "run")])
        train.train(cfg, corpus=corpus, quiet=True, stop_after=2)  # no evaluation to compile
        # Restoring only the model gives the parameters of a full restore, not the fresh ones.
        manager = train.checkpoint_manager(tmp_path / "run")
        full, optimizer = train.build(cfg, 256)
        fresh = jax.tree.leaves(nnx.state(full, nnx.Param))
        only = model_lib.build("tiny", implementation="xla", seed=9)
        assert train.restore_checkpoint(manager, full, optimizer) == 2
        assert train.restore_checkpoint(manager, only) == 2
        manager.close()
        restored = jax.tree.leaves(nnx.state(only, nnx.Param))
        for a, b, c in zip(restored, jax.tree.leaves(nnx.state(full, nnx.Param)), fresh):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert any(not np.array_equal(np.asarray(a), np.asarray(c)) for a, c in
                   zip(restored, fresh))
        summary = script.main(["--checkpoint", str(tmp_path / "run"), "--max-new-tokens", "3",
                               "--prompt", "abc", "--temperature", "1.0", "--top-k", "5"])
    assert "from " + str(tmp_path / "run") + " at step 2, FFN xla" in capsys.readouterr().out
    assert 1 <= len(summary["tokens"]) <= 3
    with pytest.raises(SystemExit, match="not a train.py run folder"):
        script.main(["--checkpoint", str(tmp_path / "nothing")])
    with pytest.raises(SystemExit, match="differs from the run's"):
        script.main(["--checkpoint", str(tmp_path / "run"), "--model", "25m"])


def test_script_hf_folder(script, tmp_path, monkeypatch):
    cfg = {**HF_CONFIG, "vocab_size": 256}
    folder = write_hf_folder(tmp_path / "hf", cfg, hf_weights(cfg))
    summary = script.main(["--hf", str(folder), "--tokenizer", "bytes", "--max-new-tokens", "3",
                           "--prompt", "hi", "--no-stop"], quiet=True)
    chunks = model_lib.generate_chunks(model_lib.from_hf(folder, implementation="xla"), [list(b"hi")],
                                       max_new_tokens=3)
    expected = np.concatenate([c[0] for c in chunks], axis=1)[0].tolist()
    assert summary["tokens"] == expected and not summary["stopped"]
    # The config's eos_token_id stops generation (the stop token is not printed).
    write_hf_folder(folder, {**cfg, "eos_token_id": [255, expected[1]]}, hf_weights(cfg))
    summary = script.main(["--hf", str(folder), "--tokenizer", "bytes", "--max-new-tokens", "3",
                           "--prompt", "hi"], quiet=True)
    assert summary["stopped"] and summary["tokens"] == expected[:1]
    # Without --tokenizer the folder's tokenizer.json is read through the tokenizers package.
    with pytest.raises(SystemExit, match="hidden_act 'silu' is not supported"):
        script.main(["--hf", str(write_hf_folder(tmp_path / "silu", {**cfg, "hidden_act": "silu"},
                                                  {})), "--tokenizer", "bytes"], quiet=True)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(SystemExit, match="tokenizers"):
        script.main(["--hf", str(folder), "--max-new-tokens", "2"], quiet=True)


def test_printer_holds_back_split_characters(script, capsys):
    """A UTF-8 character cut between two chunks is printed once it is complete."""
    printer = script._Printer(data.ByteTokenizer(), quiet=False)
    printer.add(list("dé".encode())[:2])  # "d" and the first byte of "é"
    assert capsys.readouterr().out == "d"
    printer.add(list("é!".encode())[1:])
    assert capsys.readouterr().out == "é!"
    printer.add([0xff], final=True)  # invalid at the end: printed as a replacement
    assert capsys.readouterr().out == "\ufffd" and printer.printed == "dé!\ufffd"

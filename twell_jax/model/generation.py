"""Generation: prompts of any lengths prefilled into a KV cache, then a jitted decode loop
(greedy or sampled, with stop tokens and per-step FFN statistics)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax import ffn
from twell_jax.model.cache import KVCache
from twell_jax.model.loss import layer_stats
from twell_jax.model.transformer import Transformer

_F32 = jnp.float32


PAD_TOKEN = -1
"""The value ``generate`` writes after a sequence's stop token (never a valid token id)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How ``generate`` picks each token. Frozen, so hashable (a static jit argument; stop
    tokens are not part of it, so that changing them does not compile again).

    Attributes:
      temperature: 0 = greedy (argmax; top_k / top_p are then irrelevant), else logits are
        divided by it before sampling.
      top_k: keep the k most likely tokens (None: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches p (nucleus
        sampling; None or 1: all). Applied after top_k.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {t!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                              or not 0 < p <= 1):
            raise ValueError(f"top_p must be None or a number in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_logits(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [B, V] -> tokens [B] int32 under ``sampling`` (``key`` unused when greedy).

    Ties at the top-k or top-p boundary keep every tied token.
    """
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(_F32) / sampling.temperature
    vocab = logits.shape[-1]
    if sampling.top_k is not None and sampling.top_k < vocab:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(ordered, axis=-1)
        # A token is kept while the mass of the tokens before it is below p: the top token
        # always, and the set stops at the first one that reaches p.
        keep = jnp.cumsum(probs, axis=-1) - probs < sampling.top_p
        threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class DecodeState(NamedTuple):
    """The decode loop's carry between chunks (a pytree).

    cache: the ``KVCache``. token: [B] int32, the last token of each sequence (the next decode
    input). done: [B] bool, the sequence sampled a stop token. step: [] int32, tokens sampled
    so far. key: the PRNG key; token i is drawn with ``fold_in(key, i)``, so chunking does not
    change the samples. stop: [V] bool, the stop tokens.
    """

    cache: KVCache
    token: jax.Array
    done: jax.Array
    step: jax.Array
    key: jax.Array
    stop: jax.Array


def _with_layer_activity(fn, n_layers: int, stats: bool, tails: bool = False):
    """``fn`` returning also the layers' (nnz_mean, nnz_p99), each [n_layers] float32:
    nnz_mean recorded under ``nnx.capture`` when ``stats``, nnz_p99 when ``tails``, else NaN
    (under jit the FFN layers' statistics that nothing reads are dead code, and XLA drops
    them)."""
    def run(*args, **kwargs):
        nan = jnp.full((n_layers,), jnp.nan, _F32)
        if not (stats or tails):
            return fn(*args, **kwargs), (nan, nan)
        out, inter = nnx.capture(fn, nnx.Intermediate)(*args, **kwargs)
        layers = layer_stats(inter, n_layers)
        mean, p99 = (jnp.stack([jnp.asarray(getattr(s, name), _F32) for s in layers])
                     for name in ("nnz_mean", "nnz_p99"))
        return out, (mean if stats else nan, p99 if tails else nan)
    return run


def decode_runs_dense(cfg, nnz_mean, batch: int, nnz_p99=None):
    """Whether the decode loop runs the FFN layers dense, from the prefill's per-layer
    ``nnz_mean`` [n_layers] (and ``nnz_p99`` [n_layers], which ``generation_start`` returns
    too: a heavy-tailed layer costs the decode path more than its mean says) and the batch:
    ``twell_jax.ffn.decode_runs_dense`` for this model ([] bool array, or False where it never
    does: ``bool()`` of either answers on the host)."""
    return ffn.decode_runs_dense(cfg.implementation, nnz_mean, batch, cfg.d_model, cfg.d_ff,
                                 cfg.dtype, cfg.twell, nnz_p99=nnz_p99)


def _may_run_dense(cfg, batch: int) -> bool:
    return decode_runs_dense(cfg, np.zeros((cfg.n_layers,), np.float32), batch) is not False


def _reads_tails(cfg, batch: int) -> bool:
    """Whether the decode loop's choice can depend on the layers' p99: not for batches so
    small that even every row's units active would keep the decode path ahead."""
    idle = np.zeros((cfg.n_layers,), np.float32)
    with jax.ensure_compile_time_eval():  # constants: answered while tracing
        return bool(decode_runs_dense(cfg, idle, batch, np.full_like(idle, cfg.d_ff)))


def _with_dense_ffn(model: Transformer) -> Transformer:
    """``model`` (merged inside the caller's trace) with its FFN layers on the dense
    implementation: the same parameters, the dense function."""
    for block in model.blocks:
        block.ffn.implementation = "xla"
    return model


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "cache_len", "stats"))
def generation_start(graphdef, state, prompts, lengths, key, stop, *, sampling: Sampling,
                     cache_len: int, stats: bool = True, stacked: nnx.State | None = None):
    """``generate``'s first stage (jitted): prefill and the first token: (DecodeState, token
    [B], nnz_mean [n_layers], nnz_p99 [n_layers]). nnz_mean is NaN without ``stats`` unless
    the decode loop may run dense, nnz_p99 NaN unless that choice can depend on it (a batch
    of more than a few rows, with the cost model deciding): ``decode_runs_dense`` reads them.
    ``stacked``: as in ``Transformer.prefill``."""
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(prompts.shape[0], cache_len)
    stats = stats or _may_run_dense(model.cfg, prompts.shape[0])
    prefill = _with_layer_activity(model.prefill, model.cfg.n_layers, stats,
                                   _reads_tails(model.cfg, prompts.shape[0]))
    (logits, cache), (nnz_mean, nnz_p99) = prefill(prompts, lengths, cache, stacked=stacked)
    token = sample_logits(logits, jax.random.fold_in(key, 0), sampling)
    decode_state = DecodeState(cache, token, stop[token], jnp.ones((), jnp.int32), key, stop)
    return decode_state, token, nnz_mean, nnz_p99


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "chunk", "stats",
                                             "dense_ffn"))
def generation_steps(graphdef, state, decode_state: DecodeState, n, *, sampling: Sampling,
                     chunk: int, stats: bool = True, dense_ffn: bool = False):
    """``generate``'s decode loop (jitted): up to ``n`` (<= chunk, traced) decode steps in one
    ``lax.while_loop``; stops early once every sequence is done. Returns (DecodeState, tokens
    [B, chunk] (PAD_TOKEN past the steps run or a stop), nnz_mean [chunk, n_layers] (NaN past
    the steps run, and everywhere without ``stats``: then no statistic is computed)).
    ``dense_ffn``: the FFN layers run the dense function (``decode_runs_dense``)."""
    n_layers = nnx.merge(graphdef, state).cfg.n_layers
    b = decode_state.token.shape[0]
    tokens = jnp.full((b, chunk), PAD_TOKEN, jnp.int32)
    nnz = jnp.full((chunk, n_layers), jnp.nan, _F32)

    def cond(carry):
        i, ds, _, _ = carry
        return (i < n) & ~jnp.all(ds.done)

    def body(carry):
        i, ds, tokens, nnz = carry
        # Merged inside the loop: the module lives in the loop body's trace.
        model = nnx.merge(graphdef, state)
        if dense_ffn:
            model = _with_dense_ffn(model)
        step = _with_layer_activity(model.decode_step, n_layers, stats)
        (logits, cache), (step_nnz, _) = step(ds.token, ds.cache)
        token = sample_logits(logits, jax.random.fold_in(ds.key, ds.step), sampling)
        done = ds.done | ds.stop[token]
        # A finished sequence keeps feeding its last token: its outputs are discarded.
        feed = jnp.where(ds.done, ds.token, token)
        token = jnp.where(ds.done, PAD_TOKEN, token)
        ds = DecodeState(cache, feed, done, ds.step + 1, ds.key, ds.stop)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, i))
        nnz = jax.lax.dynamic_update_slice(nnz, step_nnz[None], (i, 0))
        return i + 1, ds, tokens, nnz

    _, decode_state, tokens, nnz = jax.lax.while_loop(
        cond, body, (jnp.zeros((), jnp.int32), decode_state, tokens, nnz))
    return decode_state, tokens, nnz


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "cache_len", "steps",
                                             "stats"))
def _generate(graphdef, state, prompts, lengths, key, stop, stacked, *, sampling: Sampling,
              cache_len: int, steps: int, stats: bool):
    decode_state, first, nnz0, p99 = generation_start(
        graphdef, state, prompts, lengths, key, stop, sampling=sampling, cache_len=cache_len,
        stats=stats, stacked=stacked)
    if steps == 0:
        return first[:, None], nnz0[None]
    run = lambda dense_ffn: generation_steps(graphdef, state, decode_state, steps,
                                             sampling=sampling, chunk=steps, stats=stats,
                                             dense_ffn=dense_ffn)[1:]
    # Decided once, from the prefill's activity: a conditional around the loop, not in it.
    dense = decode_runs_dense(nnx.merge(graphdef, state).cfg, nnz0, prompts.shape[0], p99)
    if dense is False:
        tokens, nnz = run(False)
    else:
        tokens, nnz = jax.lax.cond(dense, lambda: run(True), lambda: run(False))
    if not stats:
        nnz0 = jnp.full_like(nnz0, jnp.nan)  # read only for the choice above
    return (jnp.concatenate([first[:, None], tokens], axis=1),
            jnp.concatenate([nnz0[None], nnz], axis=0))


def _prepare(model: Transformer, prompts, prompt_lengths, max_new_tokens, sampling: Sampling,
             key, stop_tokens) -> tuple[np.ndarray, np.ndarray, jax.Array, np.ndarray, int]:
    """Validates ``generate``'s arguments on the host; returns (prompts [B, T] int32,
    lengths [B] int32, key, stop mask [V] bool, cache length)."""
    cfg = model.cfg
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(prompts, (list, tuple)):
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths is for a padded [B, T] array; a list of prompts "
                             "carries its own lengths")
        rows = [np.asarray(p) for p in prompts]
        if not rows:
            raise ValueError("prompts is empty: give at least one prompt")
        for i, row in enumerate(rows):
            if row.ndim != 1 or (row.size and not np.issubdtype(row.dtype, np.integer)):
                raise TypeError(f"prompt {i} must be a 1-D sequence of ints, got "
                                f"{row.dtype} {row.shape}")
        lengths = np.asarray([len(r) for r in rows], np.int32)
        array = np.zeros((len(rows), max(lengths)), np.int32)
        for i, row in enumerate(rows):
            array[i, :len(row)] = row
    else:
        array = np.asarray(prompts)
        if array.ndim != 2:
            raise ValueError(f"prompts must be [batch, time] or a list of 1-D prompts, got "
                             f"shape {array.shape}")
        if array.size and not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"prompts must be integers, got dtype {array.dtype}")
        if array.shape[0] == 0:
            raise ValueError("prompts is empty: give at least one prompt")
        lengths = (np.full((array.shape[0],), array.shape[1], np.int32) if prompt_lengths is None
                   else np.asarray(prompt_lengths))
        if lengths.shape != (array.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"prompt_lengths must be [batch={array.shape[0]}] ints, got "
                             f"{lengths.dtype} {lengths.shape}")
        if np.any(lengths > array.shape[1]):
            raise ValueError(f"prompt_lengths {lengths.tolist()} exceed the prompts' width "
                             f"{array.shape[1]}")
    if np.any(lengths < 1):
        raise ValueError(f"empty prompt (prompt lengths {lengths.tolist()}): generation needs "
                         "at least one token to start from")
    valid = array[np.arange(array.shape[1])[None, :] < lengths[:, None]]
    if valid.min() < 0 or valid.max() >= cfg.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size}), got "
                         f"[{valid.min()}, {valid.max()}]")
    stop = np.zeros((cfg.vocab_size,), bool)
    for s in stop_tokens:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"stop_tokens must be ints, got {s!r}")
        if not 0 <= s < cfg.vocab_size:
            raise ValueError(f"stop token {s} is outside the vocabulary [0, {cfg.vocab_size})")
        stop[s] = True
    # The last token is sampled, never fed back: positions up to T + max_new_tokens - 2.
    cache_len = array.shape[1] + int(max_new_tokens) - 1
    if cache_len > cfg.max_seq_len:
        raise ValueError(f"prompts of {array.shape[1]} tokens + max_new_tokens={max_new_tokens} "
                         f"need a cache of {cache_len} positions, more than max_seq_len="
                         f"{cfg.max_seq_len}")
    if key is not None and not (
            jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key)
            or (jnp.asarray(key).dtype == jnp.uint32 and jnp.shape(key) == (2,))):
        raise TypeError(f"key must be a PRNG key (jax.random.key(seed)), got {key!r}")
    if key is None:
        if not sampling.greedy:
            raise ValueError(f"sampling at temperature {sampling.temperature} needs a PRNG key "
                             "(key=jax.random.key(seed))")
        key = jax.random.key(0)  # unused by greedy decoding
    return array.astype(np.int32), lengths.astype(np.int32), key, stop, cache_len


def generate(model: Transformer, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, key: jax.Array | None = None,
             stop_tokens=(), prompt_lengths=None, return_stats: bool = False,
             stacked: nnx.State | None = None):
    """Generates ``max_new_tokens`` tokens after each prompt, in one jitted program.

    Prefill runs the prompts through the model's attention path and fills a KV cache of
    T + max_new_tokens - 1 positions (compute dtype); a ``lax.while_loop`` then decodes one
    token per sequence per step (attention over the cache in plain XLA, the FFN layers as they
    are) without returning to the host, and ends early once every sequence has stopped.
    Sequences of different lengths batch together: each has its own positions and rotary
    offsets, so a prompt gives the same tokens padded in a batch as alone (up to rounding
    differences of batched matmuls in bf16).

    Args:
      model: the decoder.
      prompts: [B, T] int (left-aligned; with ``prompt_lengths`` the tail of a row is padding),
        or a list of B 1-D int sequences of any lengths.
      max_new_tokens: tokens to generate per sequence, >= 1.
      temperature, top_k, top_p: see ``Sampling``; temperature 0 (default) is greedy.
      key: PRNG key (``jax.random.key(seed)``); required when temperature > 0.
      stop_tokens: ids that end a sequence (kept in the output; later positions are
        ``PAD_TOKEN`` = -1).
      prompt_lengths: [B] int in [1, T], for a padded array; default T for every row.
      return_stats: also return the FFN statistics (without it none is computed).
      stacked: ``model.stack_for_inference()``, made once for many calls: a prefill of at
        least ``layer_scan.SCAN_MIN_TOKENS`` (4096) prompt tokens then reads it instead of
        stacking the parameters (``Transformer.features``).
    Returns:
      tokens [B, max_new_tokens] int32; with ``return_stats``, ``(tokens, stats)`` where
      ``stats["nnz_mean"]`` [max_new_tokens, n_layers] float32 is the mean active FFN units
      per token of the forward that produced token i: row 0 the prefill (over all B * T prompt
      positions, padding included), row i > 0 the decode step (over the B sequences, finished
      ones included); NaN for steps skipped after every sequence stopped.
    Raises:
      ValueError / TypeError: for an empty prompt, a prompt that does not fit max_seq_len with
      the new tokens, max_new_tokens < 1, bad sampling settings or sampling without a key.
    """
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    prompts, lengths, key, stop, cache_len = _prepare(model, prompts, prompt_lengths,
                                                      max_new_tokens, sampling, key, stop_tokens)
    graphdef, state = nnx.split(model)
    tokens, nnz = _generate(graphdef, state, prompts, lengths, key, stop, stacked,
                            sampling=sampling, cache_len=cache_len,
                            steps=int(max_new_tokens) - 1, stats=bool(return_stats))
    return (tokens, {"nnz_mean": nnz}) if return_stats else tokens


def generate_chunks(model: Transformer, prompts, *, max_new_tokens: int, chunk_size: int = 16,
                    temperature: float = 0.0, top_k: int | None = None,
                    top_p: float | None = None, key: jax.Array | None = None, stop_tokens=(),
                    prompt_lengths=None, stacked: nnx.State | None = None):
    """``generate`` as a stream: yields ``(tokens [B, n] int32, nnz_mean [n, n_layers])``
    numpy arrays, first the prefill's token (n = 1), then one jitted ``lax.while_loop`` of up
    to ``chunk_size`` decode steps per yield, until max_new_tokens or every sequence stopped.
    The concatenated tokens equal ``generate``'s with the same arguments (PAD_TOKEN after a
    stop; the stream ends early when all sequences stopped). One compile serves every chunk.
    ``stacked``: as in ``generate``."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    prompts, lengths, key, stop, cache_len = _prepare(model, prompts, prompt_lengths,
                                                      max_new_tokens, sampling, key, stop_tokens)
    graphdef, state = nnx.split(model)
    decode_state, token, nnz, p99 = generation_start(graphdef, state, prompts, lengths, key,
                                                     stop, sampling=sampling,
                                                     cache_len=cache_len, stacked=stacked)
    yield np.asarray(token)[:, None], np.asarray(nnz)[None]
    dense_ffn = bool(decode_runs_dense(model.cfg, nnz, prompts.shape[0], p99))
    produced = 1
    while produced < max_new_tokens and not bool(np.all(np.asarray(decode_state.done))):
        n = min(chunk_size, max_new_tokens - produced)
        decode_state, tokens, nnz = generation_steps(graphdef, state, decode_state, jnp.int32(n),
                                                     sampling=sampling, chunk=chunk_size,
                                                     dense_ffn=dense_ffn)
        ran = int(decode_state.step) - produced
        produced += ran
        yield np.asarray(tokens)[:, :ran], np.asarray(nnz)[:ran]

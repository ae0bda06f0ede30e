"""The jitted device steps of the batching engine: prefill of one chunk into one slot, a decode step
of every slot, and a decode step of a group of slots. Each donates the cache and the sampling state,
and takes `config`, `precision` and `kv_len` (the cache slots it reads) as static arguments, so the
engine's compiled shapes are exactly the (bucket | group) x kv_len pairs it warms up."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gemmax.engine.sampling import sample, set_row
from gemmax.model.forward import forward


def _rows(tree, slot, size=1):
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, size, axis=0), tree)


def _put_rows(tree, rows, slot):
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=0), tree, rows)


@functools.partial(jax.jit, static_argnames=("config", "precision", "kv_len"), donate_argnames=("cache", "state"))
def prefill_step(params, cache, state, tokens, slot, start, num_new, last_chunk, want_logprobs, *, config, precision,
                 kv_len=None):
    """Prefill one chunk [1, bucket] of slot `slot`. On the prompt's last chunk (`last_chunk`, traced:
    no extra shape) sample the row's first token from its last real position; earlier chunks leave
    the row's sampling state (step counter, penalty counts) untouched."""
    row_cache = cache.rows(slot)
    logits, row_cache = forward(params, row_cache, tokens, start[None], num_new[None], config=config,
                                precision=precision, kv_len=kv_len)
    ids, lp, top_ids, top_lp, row_state = sample(logits, _rows(state, slot), want_logprobs[None], last_chunk[None])
    return cache.put_rows(row_cache, slot), _put_rows(state, row_state, slot), (ids[0], lp[0], top_ids[0], top_lp[0])


def _decode(params, cache, state, tokens, positions, remaining, want_logprobs, config, precision, kv_len):
    """One decode step for rows [B] of the given state. Rows with remaining == 0 are idle: they write
    nothing and keep their token, position and sampling state."""
    active = remaining > 0
    logits, cache = forward(params, cache, tokens[:, None], positions, active.astype(jnp.int32),
                            config=config, precision=precision, kv_len=kv_len)
    ids, lp, top_ids, top_lp, state = sample(logits, state, want_logprobs, active)
    ids = jnp.where(active, ids, tokens)
    step = active.astype(jnp.int32)
    return cache, state, ids, positions + step, remaining - step, (ids, lp, top_ids, top_lp, active)


@functools.partial(jax.jit, static_argnames=("config", "precision", "kv_len"), donate_argnames=("cache", "state"))
def decode_step(params, cache, state, tokens, positions, remaining, want_logprobs, *, config, precision, kv_len=None):
    """One decode step for every slot (the engine's full-batch shape); `kv_len` >= every position."""
    return _decode(params, cache, state, tokens, positions, remaining, want_logprobs, config, precision, kv_len)


@functools.partial(jax.jit, static_argnames=("config", "precision", "kv_len"), donate_argnames=("cache", "state"))
def decode_rows(params, cache, state, tokens, positions, remaining, want_logprobs, rows, *, config, precision,
                kv_len=None):
    """One decode step for the k slots `rows` [k] only (k < slots): their cache rows and sampling state
    are gathered, stepped and scattered back. A decode step costs about its batch in weight re-reads
    on CPU (a batch-8 step ~3x a batch-1 step), so few active requests run in a small group.
    Outputs are per row of `rows`.

    Of the cache, only the first kv_len slots of each row move (`KVCache.gather`): moving whole rows
    cost ~20% of a step of the built-in model."""
    sub_cache, sub_state, ids, pos, rem, out = _decode(
        params, cache.gather(rows, kv_len), jax.tree.map(lambda a: a[rows], state),
        tokens[rows], positions[rows], remaining[rows], want_logprobs[rows], config, precision, kv_len)
    cache = cache.scatter(rows, sub_cache, kv_len)
    state = jax.tree.map(lambda a, sub: a.at[rows].set(sub), state, sub_state)
    return (cache, state, tokens.at[rows].set(ids), positions.at[rows].set(pos), remaining.at[rows].set(rem), out)


set_sampling_row = jax.jit(set_row, donate_argnums=0)  # one request's sampling settings into its slot

"""Single-request generation: the plain reference path behind `gemmax generate`.

Prefill the whole prompt at once (padded to a power of two), then decode one token per step with
batch 1. The batched engine must reproduce these tokens exactly for greedy requests, whatever
shares its batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gemmax.engine.api import SamplingParams
from gemmax.engine.sampling import SamplingState, row_values, sample, set_row
from gemmax.model.config import ModelConfig
from gemmax.model.forward import Precision, forward
from gemmax.model.kv_cache import init_cache
from gemmax.model.params import Params


@functools.partial(jax.jit, static_argnames=("config", "precision"), donate_argnames=("cache",))
def _step(params, cache, tokens, start, num_new, state, *, config, precision):
    logits, cache = forward(params, cache, tokens, start, num_new, config=config, precision=precision)
    ids, _, _, _, state = sample(logits, state, jnp.zeros(tokens.shape[0], jnp.bool_))
    return ids, cache, state


def generate(
    params: Params,
    config: ModelConfig,
    prompt_ids: list[int],
    max_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    precision: Precision = Precision(),
    stop_ids: tuple[int, ...] | None = None,
) -> list[int]:
    """Token ids generated after `prompt_ids` (the stop id that ended generation is not included)."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    stop = set(config.eos_token_ids if stop_ids is None else stop_ids)
    max_len = -(-(len(prompt_ids) + max_tokens) // 256) * 256  # rounded so calls share compiled shapes
    cache = init_cache(config, 1, max_len, precision.kv_cache)
    state = set_row(SamplingState.empty(1, config.vocab_size), 0, row_values(sampling, prompt_ids, config.vocab_size))
    # The prompt padded to a power of two (at least 16, at most the cache): a compiled prefill per
    # length class, not per prompt length (seven prompts of 3-40 tokens compiled seven prefills of
    # 5-9 s each on a 6-layer test model). Padding is never written to the cache (gemmax.model.kv_cache).
    padded = min(max(16, 1 << (len(prompt_ids) - 1).bit_length()), max_len)
    tokens = jnp.asarray([list(prompt_ids) + [0] * (padded - len(prompt_ids))], jnp.int32)
    start, num_new, out = 0, len(prompt_ids), []
    for _ in range(max_tokens):
        ids, cache, state = _step(params, cache, tokens, jnp.asarray([start], jnp.int32),
                                  jnp.asarray([num_new], jnp.int32), state, config=config, precision=precision)
        token = int(np.asarray(ids)[0])
        if token in stop:
            break
        out.append(token)
        start, num_new = start + num_new, 1
        tokens = jnp.asarray([[token]], jnp.int32)
    return out

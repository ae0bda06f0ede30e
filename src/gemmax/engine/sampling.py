"""Per-row sampling as one pure function, so a decode batch can mix settings.

Each row has its own temperature, top-k, top-p, min-p, penalties and PRNG key. A row's random draw at
generation step n uses `fold_in(key(seed), n)`, so the same seed gives the same tokens whatever else
shares the batch; temperature 0 is greedy and ignores the seed. The expensive parts (penalties, the
full-vocabulary sort behind top-p, log-softmax for logprobs) sit behind `lax.cond`, so a batch that
does not need them does not pay for them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gemmax.engine.api import MAX_LOGPROBS, SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingState:
    """Struct of per-row arrays; B rows (one per decode slot), V vocabulary entries."""

    temperature: jax.Array  # [B] f32, 0 -> greedy
    top_k: jax.Array  # [B] i32, 0 -> off
    top_p: jax.Array  # [B] f32
    min_p: jax.Array  # [B] f32
    presence: jax.Array  # [B] f32
    frequency: jax.Array  # [B] f32
    repetition: jax.Array  # [B] f32, 1 -> off
    key: jax.Array  # [B, 2] u32 raw PRNG key per row
    step: jax.Array  # [B] i32 tokens sampled so far
    output_counts: jax.Array  # [B, V] i32 generated-token counts (penalties)
    prompt_mask: jax.Array  # [B, V] bool tokens of the prompt (repetition penalty)

    @classmethod
    def empty(cls, batch: int, vocab: int) -> SamplingState:
        f = lambda v: jnp.full((batch,), v, jnp.float32)  # noqa: E731
        return cls(f(0.0), jnp.zeros(batch, jnp.int32), f(1.0), f(0.0), f(0.0), f(0.0), f(1.0),
                   jnp.zeros((batch, 2), jnp.uint32), jnp.zeros(batch, jnp.int32),
                   jnp.zeros((batch, vocab), jnp.int32), jnp.zeros((batch, vocab), jnp.bool_))


def row_values(params: SamplingParams, prompt_ids, vocab: int) -> dict[str, np.ndarray]:
    """Host-side values of one row, to be written into slot b of a SamplingState."""
    seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy % (2**31)
    mask = np.zeros(vocab, np.bool_)
    mask[np.asarray([t for t in prompt_ids if 0 <= t < vocab], np.int64)] = True
    return {
        "temperature": np.float32(params.temperature), "top_k": np.int32(params.top_k),
        "top_p": np.float32(params.top_p), "min_p": np.float32(params.min_p),
        "presence": np.float32(params.presence_penalty), "frequency": np.float32(params.frequency_penalty),
        "repetition": np.float32(params.repetition_penalty),
        "key": np.asarray(jax.random.key_data(jax.random.key(int(seed) % (2**32))), np.uint32),
        "step": np.int32(0), "output_counts": np.zeros(vocab, np.int32), "prompt_mask": mask,
    }


def set_row(state: SamplingState, row, values: dict) -> SamplingState:
    """Write one row's values (from `row_values`) into slot `row` (a traced index is fine)."""
    return dataclasses.replace(state, **{name: getattr(state, name).at[row].set(value) for name, value in values.items()})


def apply_penalties(logits: jax.Array, state: SamplingState) -> jax.Array:
    """vLLM semantics: repetition over prompt + output (divide positive, multiply negative logits);
    presence and frequency over output tokens only (subtract)."""
    seen = state.prompt_mask | (state.output_counts > 0)
    rep = state.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = state.output_counts.astype(jnp.float32)
    return logits - state.frequency[:, None] * counts - state.presence[:, None] * (counts > 0)


def _filtered_sample(logits: jax.Array, state: SamplingState) -> jax.Array:
    """Temperature, then top-k, top-p (on the renormalised top-k), min-p; one categorical draw per row."""
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(state.temperature, 1e-6)[:, None]
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, V)  # [B, V] descending
    rank = jnp.arange(V)[None, :]
    keep = (state.top_k[:, None] <= 0) | (rank < state.top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < state.top_p[:, None]  # the first token is always kept
    keep &= probs >= state.min_p[:, None] * probs[:, :1]
    keys = jax.vmap(lambda k, n: jax.random.fold_in(jax.random.wrap_key_data(k), n))(state.key, state.step)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, sorted_logits, -jnp.inf))
    return jnp.take_along_axis(sorted_ids, choice[:, None], axis=1)[:, 0]


def _argmax(logits: jax.Array) -> jax.Array:
    """First index of the row maximum, [B, V] -> [B] i32. Same result as jnp.argmax for finite logits,
    ~6x faster on CPU over 262,144 entries (a max, then a min over matching indices)."""
    V = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jnp.where(logits == top, jnp.arange(V, dtype=jnp.int32)[None, :], V)
    return jnp.minimum(jnp.min(index, axis=-1), V - 1)


def sample(logits: jax.Array, state: SamplingState, want_logprobs: jax.Array):
    """logits [B, V] f32 -> (ids [B] i32, logprob [B] f32, top ids [B, K] i32, top logprobs [B, K] f32,
    new state). Logprobs are of the model's distribution (before penalties and temperature) and are
    computed only when some row asks (`want_logprobs` [B] bool)."""
    penalised = jax.lax.cond(
        jnp.any((state.repetition != 1.0) | (state.presence != 0.0) | (state.frequency != 0.0)),
        apply_penalties, lambda x, _: x, logits, state,
    )
    greedy = _argmax(penalised)
    sampling = state.temperature > 0
    ids = jax.lax.cond(
        jnp.any(sampling),
        lambda: jnp.where(sampling, _filtered_sample(penalised, state), greedy).astype(jnp.int32),
        lambda: greedy,
    )

    def logprobs():
        lp = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return jnp.take_along_axis(lp, ids[:, None], axis=1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def no_logprobs():
        B = logits.shape[0]
        return (jnp.zeros(B, jnp.float32), jnp.zeros((B, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((B, MAX_LOGPROBS), jnp.float32))

    chosen_lp, top_ids, top_lp = jax.lax.cond(jnp.any(want_logprobs), logprobs, no_logprobs)
    rows = jnp.arange(logits.shape[0])
    new_state = dataclasses.replace(state, step=state.step + 1, output_counts=state.output_counts.at[rows, ids].add(1))
    return ids, chosen_lp, top_ids, top_lp, new_state

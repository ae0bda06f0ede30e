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
        """Every row greedy, without penalties, nothing counted."""
        f = lambda v: jnp.full((batch,), v, jnp.float32)  # noqa: E731
        return cls(temperature=f(0.0), top_k=jnp.zeros(batch, jnp.int32), top_p=f(1.0), min_p=f(0.0),
                   presence=f(0.0), frequency=f(0.0), repetition=f(1.0), key=jnp.zeros((batch, 2), jnp.uint32),
                   step=jnp.zeros(batch, jnp.int32), output_counts=jnp.zeros((batch, vocab), jnp.int32),
                   prompt_mask=jnp.zeros((batch, vocab), jnp.bool_))


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


def _argmax(logits: jax.Array, block: int = 512) -> jax.Array:
    """First index of the row maximum, [B, V] -> [B] i32; the same result as jnp.argmax for finite
    logits. Two levels over blocks of `block` entries: the block maxima, then the first block that
    holds the row maximum, then the first match inside it. Nothing of the logits' size is written: on
    CPU a plain max-then-match materialised the maximum broadcast to [B, V] (2.4-5.9 ms at batch 8
    over 262,144 entries, against ~0.5 ms here)."""
    B, V = logits.shape
    if V % block:
        block = V
    blocks = logits.reshape(B, V // block, block)
    block_max = jnp.max(blocks, axis=-1)  # [B, V / block]
    top = jnp.max(block_max, axis=-1, keepdims=True)  # [B, 1]
    first_block = jnp.argmax(block_max == top, axis=-1)  # [B]: argmax of a bool is its first True
    candidates = jnp.take_along_axis(blocks, first_block[:, None, None], axis=1)[:, 0]  # [B, block]
    return (first_block * block + jnp.argmax(candidates == top, axis=-1)).astype(jnp.int32)


def sample(logits: jax.Array, state: SamplingState, want_logprobs: jax.Array, advance: jax.Array | None = None):
    """logits [B, V] f32 -> (ids [B] i32, logprob [B] f32, top ids [B, K] i32, top logprobs [B, K] f32,
    new state). Logprobs are of the model's distribution (before penalties and temperature) and are
    computed only when some row asks (`want_logprobs` [B] bool). Only rows with `advance` [B] bool
    (default all) count the token in their state (step, penalty counts); the others keep it as it was,
    without a select over the [B, V] arrays."""
    sampling = state.temperature > 0

    def choose(penalised: jax.Array) -> jax.Array:  # [B, V] -> ids [B]
        greedy = _argmax(penalised)
        return jax.lax.cond(
            jnp.any(sampling),
            lambda: jnp.where(sampling, _filtered_sample(penalised, state), greedy).astype(jnp.int32),
            lambda: greedy,
        )

    # Both branches return only ids: a branch that passed the logits through would copy all [B, V].
    ids = jax.lax.cond(
        jnp.any((state.repetition != 1.0) | (state.presence != 0.0) | (state.frequency != 0.0)),
        lambda: choose(apply_penalties(logits, state)), lambda: choose(logits),
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
    count = jnp.ones_like(state.step) if advance is None else advance.astype(state.step.dtype)
    new_state = dataclasses.replace(state, step=state.step + count,
                                    output_counts=state.output_counts.at[rows, ids].add(count))
    return ids, chosen_lp, top_ids, top_lp, new_state

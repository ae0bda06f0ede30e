"""Speculative decoding with a draft model: a small model sharing the target's tokenizer proposes k
tokens per verify step from its own KV cache (docs/speculative.md).

The draft keeps one cache row per target slot (`init_cache` with the same max_model_len and ring
slack, so a rollback is a shorter cached length there too: gemmax.model.kv_cache). Its cached
length per slot is host-side (`Drafter.cached`), and after every verify step it is within one token
of the target's:

    target: n tokens cached, its last token t_n (at position n) is the next input
    draft:  n or n - 1 tokens cached (n - 1 when it proposed k tokens and all k were kept: the k-th
            proposal was drawn but never fed to it)

`propose_rows` first feeds the one or two tokens the draft lacks ([t_{n-1},] t_n: one forward of 2
positions, about the cost of one), then feeds each proposal it draws for k - 1 more steps, writing
positions n .. n + k - 1. After the verify step keeps a of them, positions up to n + min(a, k - 1)
hold accepted tokens; the rest lie past the cached length and are overwritten later, exactly as in
the target's cache. When a row decoded plainly for a while (back-off, a constrained row in the
group), `Drafter.catch_up` prefills the tokens it missed in the prefill buckets first.

Acceptance (`draft_rule`): for a sampled row the draft draws proposal x_j from its own distribution
q_j (the row's temperature / top-k / top-p / min-p applied to the draft's logits: `probabilities`);
the verify step keeps x_j with probability min(1, p_j(x_j) / q_j(x_j)) while every earlier one was
kept, and draws the token at the first rejected index from norm(max(0, p_j - q_j)), or from p_k
after k kept proposals. This leaves every output token distributed as the target's sampler would
draw it (Leviathan et al. 2023, Chen et al. 2023); `tests/test_speculative_draft.py` checks it on a
small vocabulary with a bound that ignoring q fails. Greedy rows keep the longest prefix equal to the
target's argmax, as with prompt lookup. Every random number comes from the row's key folded with the
generation step it belongs to and a purpose tag, so a seeded request draws the same tokens again.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gemmax.engine.sampling import SamplingState, _argmax
from gemmax.engine.shapes import ShapePlan, plan_chunks
from gemmax.model.config import ModelConfig
from gemmax.model.forward import Precision, forward
from gemmax.model.kv_cache import KVCache, cache_bytes, init_cache

# Purpose tags folded into fold_in(key(seed), step): the draft's own draw, the accept test, the
# token drawn at the first rejection (or after k kept proposals). The plain sampler uses the step key
# itself, so none of these correlates with it or with each other.
_DRAFT_TAG, _ACCEPT_TAG, _RESIDUAL_TAG = 1, 2, 3


class DraftMismatch(ValueError):
    """The draft model cannot draft for this target (vocabulary or tokenizer differ)."""


def check_draft(target, draft) -> None:
    """Refuse (DraftMismatch, with both values) a draft whose vocabulary or tokenizer is not the
    target's: its token ids would mean other text. `target`, `draft`: gemmax.engine.loading.LoadedModel."""
    t, d = target.checkpoint.config, draft.checkpoint.config
    if t.vocab_size != d.vocab_size:
        raise DraftMismatch(f"draft model {draft.name} has a vocabulary of {d.vocab_size:,} tokens, the target "
                            f"{target.name} {t.vocab_size:,}: a draft must share the target's tokenizer")
    if (target.tokenizer is None) != (draft.tokenizer is None):
        raise DraftMismatch(f"only one of the target ({target.name}) and the draft ({draft.name}) has a tokenizer: "
                            "cannot check that they share it")
    if target.tokenizer is not None:
        tv, dv = target.tokenizer.backend.get_vocab(), draft.tokenizer.backend.get_vocab()
        if tv != dv:
            differ = sorted(set(tv.items()) ^ set(dv.items()), key=lambda item: item[1])[:3]
            raise DraftMismatch(f"draft model {draft.name} has another tokenizer than the target {target.name} "
                                f"({len(set(tv.items()) ^ set(dv.items())):,} token <-> id pairs differ, e.g. "
                                f"{differ}): a draft must share the target's tokenizer")
    if t.eos_token_ids != d.eos_token_ids or t.bos_token_id != d.bos_token_id:
        raise DraftMismatch(f"draft model {draft.name} has other special ids (bos {d.bos_token_id}, eos "
                            f"{d.eos_token_ids}) than the target (bos {t.bos_token_id}, eos {t.eos_token_ids})")


# ---------------------------------------------------------------------------------------- numerics
def probabilities(logits: jax.Array, state: SamplingState) -> jax.Array:
    """The distribution a row's sampler draws from, as a dense vector: logits [B, V] -> [B, V] f32.
    Sampled rows: softmax(logits / temperature), then top-k, top-p on the renormalised top-k and
    min-p relative to the best token (`sampling._window`'s rule over the sorted row), renormalised;
    the sort runs only when some row filters. Greedy rows (temperature 0): one-hot at the argmax."""
    B, V = logits.shape
    sampled = state.temperature > 0
    t = jnp.maximum(state.temperature, 1e-6)[:, None]
    w = jnp.exp((logits - jnp.max(logits, axis=-1, keepdims=True)) / t)  # [B, V]: p / p_max
    k = jnp.where((state.top_k > 0) & (state.top_k < V), state.top_k, V)
    filters = sampled & ((k < V) | (state.top_p < 1.0) | (state.min_p > 0.0))

    def kept() -> jax.Array:  # [B, V] bool, on the row in descending order (ties to the lower index)
        order = jnp.argsort(-logits, axis=-1, stable=True)
        ws = jnp.take_along_axis(w, order, axis=-1)
        rank = jnp.arange(V)[None, :]
        in_k = rank < k[:, None]
        probs = ws / jnp.sum(jnp.where(in_k, ws, 0.0), axis=-1, keepdims=True)
        running = jnp.cumsum(probs, axis=-1)
        keep = in_k & (ws >= state.min_p[:, None])
        keep &= (state.top_p[:, None] >= 1.0) | (running - probs < state.top_p[:, None])
        keep |= rank == 0
        return jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], order].set(keep)

    mask = lax.cond(jnp.any(filters), kept, lambda: jnp.ones((B, V), bool))
    w = jnp.where(mask, w, 0.0)
    dense = w / jnp.sum(w, axis=-1, keepdims=True)
    greedy = jax.nn.one_hot(_argmax(logits), V, dtype=jnp.float32)
    return jnp.where(sampled[:, None], dense, greedy)


def _step_keys(key: jax.Array, steps: jax.Array, tag: int) -> jax.Array:
    """Raw keys [B, 2] u32 and steps [B, ...] -> typed keys [B, ...]: fold_in(fold_in(key, step), tag)."""
    def one(raw, step):
        return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(raw), step), tag)
    per_row = jax.vmap(one, in_axes=(None, 0))
    return jax.vmap(per_row)(key, steps.reshape(steps.shape[0], -1)).reshape(steps.shape)


def _categorical(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """One draw per key from probs [..., V] (rows summing to > 0) -> [...] i32."""
    flat = probs.reshape(-1, probs.shape[-1])
    draws = jax.vmap(lambda key, p: jax.random.categorical(key, jnp.log(p)))(keys.reshape(-1), flat)
    return draws.reshape(probs.shape[:-1]).astype(jnp.int32)


def draft_rule(p: jax.Array, q: jax.Array, proposals: jax.Array, num_proposed: jax.Array, key: jax.Array,
               step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The speculative rejection rule (module docstring) for rows whose proposals [B, k] were drawn
    from q [B, k, V]; p [B, k + 1, V]: the target's distribution after each verify input; the first
    num_proposed [B] proposals are real. Random numbers from the rows' raw keys [B, 2] at generation
    steps step[B] + j. Returns (drawn [B, k + 1]: the proposals kept, then the drawn token; accepted [B])."""
    B, k = proposals.shape
    j = jnp.arange(k)[None, :]
    steps = step[:, None] + jnp.arange(k + 1)[None, :]  # [B, k + 1]
    px = jnp.take_along_axis(p[:, :k], proposals[..., None], axis=-1)[..., 0]  # [B, k]
    qx = jnp.take_along_axis(q, proposals[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.random.uniform)(_step_keys(key, steps[:, :k], _ACCEPT_TAG).reshape(-1)).reshape(B, k)
    keep = (u * qx < px) & (j < num_proposed[:, None])  # u < p / q, without dividing by q
    accepted = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)
    # At a real proposal's index a rejection draws from max(0, p - q); past them (all kept) from p.
    residual = jnp.where((j < num_proposed[:, None])[..., None], jnp.maximum(p[:, :k] - q, 0.0), p[:, :k])
    residual = jnp.concatenate([residual, p[:, k:]], axis=1)  # [B, k + 1, V]
    total = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(total > 0, residual, p)  # p <= q everywhere: a rejection rounding let through
    draws = _categorical(_step_keys(key, steps, _RESIDUAL_TAG), residual)  # [B, k + 1]
    padded = jnp.concatenate([proposals, jnp.zeros((B, 1), jnp.int32)], axis=1)
    drawn = jnp.where(jnp.arange(k + 1)[None, :] < accepted[:, None], padded, draws)
    return drawn, accepted


# ------------------------------------------------------------------------------------ device steps
STATIC = ("config", "precision", "kv_len")


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("cache",))
def draft_prefill(params, cache: KVCache, tokens, slot, start, num_new, *, config, precision, kv_len=None) -> KVCache:
    """Prefill one chunk [1, bucket] (its first num_new real) after `start` cached tokens of the
    draft's slot `slot`, written in place (`kv_len`: the tuple of KV buckets, as `prefill_step`);
    nothing is sampled."""
    return forward(params, cache, tokens, start[None], num_new[None], config=config, precision=precision,
                   kv_len=kv_len, rows=slot[None])[1]


def draw_proposal(logits: jax.Array, j, state: SamplingState) -> tuple[jax.Array, jax.Array]:
    """Proposal j of every row from a drafter's logits [g, V]: (the token [g], drawn at the row's
    generation step + j from q_j, or the argmax of a greedy row; q_j [g, V], `probabilities`)."""
    stepped = dataclasses.replace(state, step=state.step + j)
    q = probabilities(logits, stepped)
    sampled = _categorical(_step_keys(state.key, stepped.step, _DRAFT_TAG), jnp.maximum(q, 0.0))
    return jnp.where(state.temperature > 0, sampled, _argmax(logits)), q


def light_rows(state: SamplingState, rows) -> SamplingState:
    """The settings, keys and steps of rows `rows` (not the [B, V] counts)."""
    light = dataclasses.replace(state, output_counts=None, prompt_mask=None)
    return jax.tree.map(lambda a: a[rows], light)


@functools.partial(jax.jit, static_argnames=(*STATIC, "k"), donate_argnames=("cache",))
def propose_rows(params, cache: KVCache, sampling: SamplingState, rows, tokens, start, num_new, table, *, k,
                 config, precision, kv_len=None):
    """k proposals for each drafting row of the group `rows` [g] (module docstring): tokens [g, 2]
    the one or two tokens the draft's slot lacks (the first num_new [g] real: 1 or 2; 0: the row does
    not draft and its draft cache is untouched) after `start` [g] cached tokens; `sampling`: the
    target's per-slot sampling state (the rows' settings, keys and generation steps). kv_len must
    cover start + num_new + k - 1. Returns (cache, proposals [g, k] (the draft's on drafting rows,
    `table` [g, k] on the others), q [g, k, V]: the distribution each proposal was drawn from)."""
    state = light_rows(sampling, rows)
    active = num_new > 0
    sub = cache.gather(rows, kv_len)
    logits, sub = forward(params, sub, tokens, start, num_new, config=config, precision=precision, kv_len=kv_len)

    draw = functools.partial(draw_proposal, state=state)

    def step(carry, j):
        sub, logits, position = carry
        x, q = draw(logits, j)
        logits, sub = forward(params, sub, x[:, None], position, active.astype(jnp.int32), config=config,
                              precision=precision, kv_len=kv_len)
        return (sub, logits, position + 1), (x, q)

    (sub, logits, _), (xs, qs) = lax.scan(step, (sub, logits, start + num_new), jnp.arange(k - 1))
    x_last, q_last = draw(logits, k - 1)
    proposals = jnp.concatenate([xs.T, x_last[:, None]], axis=1)  # [g, k]
    q = jnp.concatenate([jnp.moveaxis(qs, 0, 1), q_last[:, None]], axis=1)  # [g, k, V]
    proposals = jnp.where(active[:, None], proposals, table)
    return cache.scatter(rows, sub, kv_len), proposals, q


# ------------------------------------------------------------------------------------ host side
class Drafter:
    """The draft model of one engine: its params, cache (one row per target slot) and each slot's
    cached length; the host half of `propose_rows` (which tokens each row lacks) and of the catch-up
    after plain decoding. `loaded`: gemmax.engine.loading.LoadedModel."""

    def __init__(self, loaded, max_model_len: int, slots: int, precision: Precision, ring_slack: int,
                 shapes: ShapePlan):
        self.loaded = loaded
        self.config: ModelConfig = loaded.checkpoint.config
        self.params = loaded.checkpoint.params
        self.precision = precision  # the target's dtypes: one device policy
        self.max_model_len, self.slots, self.ring_slack, self.shapes = max_model_len, slots, ring_slack, shapes
        self.cache: KVCache | None = None
        self.cached = np.zeros(slots, np.int64)  # tokens the draft holds per slot

    @property
    def kv_bytes(self) -> int:
        return cache_bytes(self.config, self.max_model_len, self.slots, self.precision.kv_cache, self.ring_slack)

    def describe(self) -> dict:
        return {"model": self.loaded.name, "family": self.config.family, "layers": len(self.config.layers),
                "weight_bytes": self.loaded.checkpoint.weight_bytes, "kv_cache_bytes": self.kv_bytes}

    def reset(self) -> None:
        self.cache = init_cache(self.config, self.slots, self.max_model_len, self.precision.kv_cache, self.ring_slack)
        self.cached[:] = 0

    def prefill(self, slot: int, ids, start: int = 0) -> None:
        """Prefill ids[start:] into slot `slot` after its first `start` tokens (in the prefill buckets)."""
        for real, bucket in plan_chunks(len(ids) - start, self.shapes.buckets):
            chunk = np.zeros((1, bucket), np.int32)
            chunk[0, :real] = ids[start : start + real]
            self.run_prefill(chunk, slot, start, real)
            start += real
        self.cached[slot] = start

    def run_prefill(self, chunk: np.ndarray, slot: int, start: int, real: int) -> None:
        self.cache = draft_prefill(self.params, self.cache, jnp.asarray(chunk), jnp.int32(slot), jnp.int32(start),
                                   jnp.int32(real), config=self.config, precision=self.precision,
                                   kv_len=self.shapes.kv_buckets)

    def propose(self, rows, contexts: dict[int, np.ndarray], sampling: SamplingState, table: np.ndarray, k: int,
                kv_len: int):
        """k proposals for the rows j in `contexts` ({j: prompt + output so far}) of the group `rows`;
        the other rows' proposals are `table`'s. A row the draft has fallen behind by more than one
        token first catches up (prefill). Returns (proposals [g, k], q [g, k, V]) on the device."""
        g = len(rows)
        tokens, start, num_new = np.zeros((g, 2), np.int32), np.zeros(g, np.int32), np.zeros(g, np.int32)
        for j, context in contexts.items():
            slot, n = int(rows[j]), len(context) - 1  # n: the target's cached length; context[n] its input
            if self.cached[slot] < n - 1:
                self.prefill(slot, context[: n - 1], int(self.cached[slot]))
            lacking = context[self.cached[slot] : n + 1]  # 1 or 2 tokens
            tokens[j, : len(lacking)], start[j], num_new[j] = lacking, self.cached[slot], len(lacking)
        self.cache, proposals, q = propose_rows(
            self.params, self.cache, sampling, jnp.asarray(rows, jnp.int32), jnp.asarray(tokens), jnp.asarray(start),
            jnp.asarray(num_new), jnp.asarray(table, jnp.int32), k=k, config=self.config, precision=self.precision,
            kv_len=kv_len)
        return proposals, q

    def observe(self, slot: int, target_cached: int, accepted: int, k: int) -> None:
        """After a verify step that kept `accepted` of the k drafted tokens of a row whose target had
        `target_cached` tokens cached: the draft holds them all but (when all k were kept) the last."""
        self.cached[slot] = target_cached + min(accepted + 1, k)

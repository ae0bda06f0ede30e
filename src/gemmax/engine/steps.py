"""The jitted device steps of the batching engine: prefill of one chunk into one slot (`prefill_step`),
prefill of several whole short prompts into several slots in one forward (`prefill_rows`), both
returning the last chunk's logits, a decode step's forward of every slot or of a group of slots
(`decode_forward`: cache write and logits), the sampler that draws from either (`draw`: a prompt's
first token or a decode step's next, one program per row count, not a copy in every bucket, KV
bound and group's program), and the speculative verify step of a group of slots, over one
`DeviceState` pytree that each donates and returns. Each takes `config`, `precision` and `kv_len`
as static arguments: the cache slots it reads, or for `prefill_step`, `decode_forward` and
`verify_rows` the tuple of KV buckets among which each layer reads the one its rows need, chosen on
the device. So the engine's compiled shapes are exactly what it warms up: one prefill program per
bucket, one decode forward per group, the batched prefill steps per shape (at the smallest KV
bucket) and a verify step per group and k. `decode_step`
is the two halves of a full-batch step in one program: what the profiler traces and the decode
benchmarks time (one module per step).

Batch invariance (`row_invariant`, static): a batched decode step multiplies every weight by all its
rows at once (a GEMM), which sums in another order than the one-row matrix-vector form, so a greedy
text can change at a near-tie with what shares its batch (docs/server.md). With `row_invariant` the
decode steps compute each row as the one-row step does, one row after another, each reading the
KV-length bucket its own context needs: a row's logits are then bit-identical whatever the group
size and the other rows (tested), at the cost of one weight read per row (about a single stream's
speed per row).

Speculative verify (`verify_rows`): each row's last token and up to k proposed tokens [B, k+1] at
positions n..n+k go through one forward; the target's token after each input is drawn as the
decode step would draw it at that generation step (argmax, or the row's seeded draw at step s+j),
and the row keeps the longest prefix of proposals equal to those draws, plus the draw after it.
For a sampled row this is the speculative rejection rule with a one-hot proposal: the proposal x is
kept with probability p(x), and when it is not, the draw y != x is distributed as p with x removed,
renormalised. A rollback is a shorter cached length (`kv_cache` docstring: rings have k_max slots of
slack). Rows whose proposals a draft model drew from a known distribution q take the rejection rule
with q instead when sampled (gemmax.engine.draft): keep x with min(1, p(x) / q(x)), else draw from
norm(max(0, p - q))."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from gemmax.engine.draft import draft_rule, probabilities
from gemmax.engine.sampling import (
    SamplingState,
    apply_penalties,
    choose_ids,
    counted,
    logprobs_of,
    sample,
    set_row,
)
from gemmax.model.config import ModelConfig
from gemmax.model.forward import Precision, forward
from gemmax.model.kv_cache import KVCache, init_cache
from gemmax.model.ops import opaque


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceState:
    """Everything the device keeps per decode slot, B slots: one pytree the steps donate and return."""

    cache: KVCache  # B rows of max_model_len positions (rings on sliding layers)
    sampling: SamplingState  # per-row settings, PRNG key, penalty counts
    tokens: jax.Array  # [B] i32: each slot's last token (the next step's input)
    positions: jax.Array  # [B] i32: tokens cached per slot
    remaining: jax.Array  # [B] i32: tokens the slot still owes (0: idle, writes nothing)
    # [B, H]: the target's final-normed hidden state at the position that produced each slot's token
    # (what an MTP assistant reads, gemmax.engine.mtp); None without one: the steps then compute none.
    hidden: jax.Array | None = None

    def with_slot(self, slot: int, *, token: int | None = None, position: int | None = None,
                  remaining: int | None = None) -> DeviceState:
        """This state with slot `slot`'s token, position or remaining budget set (host-side, eager)."""
        updates = {name: getattr(self, name).at[slot].set(value)
                   for name, value in (("tokens", token), ("positions", position), ("remaining", remaining))
                   if value is not None}
        return dataclasses.replace(self, **updates)


def init_device_state(config: ModelConfig, slots: int, max_len: int, precision: Precision,
                      ring_slack: int = 0, hidden: bool = False) -> DeviceState:
    """The zeroed state of `slots` decode slots of up to `max_len` positions, every slot idle; sliding
    rings with `ring_slack` extra slots (speculative decoding's k_max); `hidden`: keep each slot's
    last hidden state (an MTP assistant drafts)."""
    return DeviceState(cache=init_cache(config, slots, max_len, precision.kv_cache, ring_slack),
                       sampling=SamplingState.empty(slots, config.vocab_size), tokens=jnp.zeros(slots, jnp.int32),
                       positions=jnp.zeros(slots, jnp.int32), remaining=jnp.zeros(slots, jnp.int32),
                       hidden=jnp.zeros((slots, config.hidden_size), precision.activation) if hidden else None)


def init_committed_state(*args, **kwargs) -> DeviceState:
    """`init_device_state` committed to the device where it lies (no copy), as every step's output is,
    and as a mesh's jitted init returns it (gemmax.engine.mesh): an uncommitted state is another cache
    key for the engine's jitted helpers, so after warm-up's fresh state the first request's
    `set_sampling_row` (run before any step) traced and loaded a second program."""
    state = init_device_state(*args, **kwargs)
    return jax.tree.map(lambda array: jax.device_put(array, array.sharding, may_alias=True), state)


def _keep_hidden(old: jax.Array | None, new: jax.Array | None, rows_taking: jax.Array) -> jax.Array | None:
    """The hidden state [B, H] with `new` in the rows `rows_taking` [B] bool (None: none is kept)."""
    if old is None:
        return None
    return jnp.where(rows_taking[:, None], new.astype(old.dtype), old)


def _rows(tree, slot):
    """Row `slot` of every array of `tree`, as buffers of their own (`KVCache.rows` says why)."""
    return opaque(slot >= 0, lambda t: jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0), t),
                  tree)


def _put_rows(tree, rows, slot):
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=0), tree, rows)


# Static arguments of the steps (gemmax.engine.mesh compiles the same functions for a mesh with these).
PREFILL_STATIC = ("config", "precision", "kv_len")
DECODE_STATIC = (*PREFILL_STATIC, "row_invariant")


@functools.partial(jax.jit, static_argnames=PREFILL_STATIC, donate_argnames=("device",))
def prefill_step(params, device: DeviceState, tokens, slot, start, num_new, last_chunk, *, config, precision,
                 kv_len=None):
    """Prefill one chunk [1, bucket] of slot `slot`. Returns (device, logits [1, V] f32 at the last
    real position): computed on the prompt's last chunk only (`last_chunk`, traced: no extra shape;
    earlier chunks skip the LM head), where `draw` takes the row's first token from them. `kv_len`:
    the tuple of KV buckets, among which each layer's attention reads the smallest that its context
    needs, chosen on the device (`forward`): one program per bucket for every chunk start (None:
    every slot). The chunk is written into the slot's row of the cache in place. The slot's token,
    position and budget are the scheduler's to set."""
    if isinstance(kv_len, int):
        raise ValueError(f"prefill_step takes the tuple of KV buckets or None, not the bound {kv_len}")
    logits, cache, *h = forward(params, device.cache, tokens, start[None], num_new[None], config=config,
                                precision=precision, kv_len=kv_len, hidden=device.hidden is not None,
                                head_on=last_chunk, rows=slot[None])
    hidden = device.hidden
    if hidden is not None:  # the first token's hidden state, on the prompt's last chunk
        hidden = _put_rows(hidden, _keep_hidden(_rows(hidden, slot), h[0], last_chunk[None]), slot)
    return dataclasses.replace(device, cache=cache, hidden=hidden), logits


@functools.partial(jax.jit, static_argnames=PREFILL_STATIC, donate_argnames=("device",))
def prefill_rows(params, device: DeviceState, tokens, rows, start, num_new, last_chunk, *, config, precision, kv_len):
    """One prefill chunk of several prompts at once: tokens [P, bucket] (row j's first num_new[j]
    real, the rest padding) into the slots `rows` [P] (distinct), every row's chunk starting at the
    same position `start` (prompts with the same chunk plan: every chunk but the last is full).
    One forward over P x bucket tokens reads the weights once for all P prompts, where P one-slot
    prefills read them P times. Rows with num_new 0 are padding (any other slots, running or not):
    they write nothing. Only the first `kv_len` cache slots of each row move, so every row's
    start + bucket must be within kv_len. Returns (device, logits [P, V] f32), computed on the
    prompts' last chunk (`last_chunk`) for `draw`."""
    sub = _gather(device, rows, kv_len)
    starts = jnp.full(num_new.shape, start, jnp.int32)
    logits, cache, *h = forward(params, sub.cache, tokens, starts, num_new, config=config, precision=precision,
                                kv_len=kv_len, hidden=sub.hidden is not None, head_on=last_chunk)
    hidden = _keep_hidden(sub.hidden, h[0] if h else None, (num_new > 0) & last_chunk)
    return _scatter(device, dataclasses.replace(sub, cache=cache, hidden=hidden), rows, kv_len), logits


@functools.partial(jax.jit, donate_argnames=("device",))
def draw(device: DeviceState, logits, want_logprobs, rows, take, advance, mask=None):
    """The sampler of every step, one program per row count: the next token of each row of `rows`
    [k] (None: every slot, whose state is then read and written where it lies: a gather of the
    sampling state would copy its [B, V] counts and masks on every decode step) from its logits
    [k, V] (`prefill_step` / `prefill_rows` on a prompt's last chunk, `decode_forward`), for the
    rows with `take` [k]; the other rows keep their state. `advance`
    (traced [] bool): a decode step's draw, where only rows with budget left (remaining > 0) draw
    and move on (token, position, remaining); else a prompt's first token, where only the sampling
    state moves (the scheduler sets the slot's token, position and budget). One program serves
    both, and every bucket, KV bound and group of the forwards: the sampler compiles as slowly as a
    forward. `want_logprobs` [k]; `mask` [k, ceil(V / 32)] i32: allowed tokens per row (constrained
    decoding; None: no mask work compiled in). Returns (device, (ids, logprobs, top ids, top
    logprobs, drew)) per row of `rows`; a row that did not draw reports its current token."""
    if rows is None:  # every slot: the sampling state's [B, V] counts and masks stay where they are
        return _draw(device, logits, want_logprobs, take, advance, mask)
    sub, out = _draw(_gather(device, rows, cache=False), logits, want_logprobs, take, advance, mask)
    return _scatter(device, sub, rows, cache=False), out


def _forward_rows(params, cache: KVCache, tokens, positions, active, config, precision, kv_len, row_invariant,
                  hidden: bool = False, rows=None):
    """forward of one new token per row: tokens, positions, active [B] -> (logits [B, V], cache) and,
    with `hidden` (one device, not row-invariant: speculative decoding), the hidden states [B, H].
    `rows` [B]: the cache row of each row (None: row b). `row_invariant`: row by row, each exactly the
    one-row computation (module docstring)."""
    if hidden or not row_invariant or tokens.shape[0] == 1:
        return forward(params, cache, tokens[:, None], positions, active.astype(jnp.int32), config=config,
                       precision=precision, kv_len=kv_len, hidden=hidden, rows=rows)
    logits = []
    for b in range(tokens.shape[0]):
        row = (tokens[b : b + 1], positions[b : b + 1], active[b : b + 1])
        if logits:
            # Row b's inputs depend on row b-1's logits: XLA can neither merge the rows' products into
            # one GEMM (its dot merger) nor fuse across rows, so every row compiles as a one-row step.
            logits[-1], row = lax.optimization_barrier((logits[-1], row))
        # The row's cache as a buffer of its own (`KVCache.rows`): read in place, the next row's
        # in-place write would have to wait for this row's reads, and XLA copied every cache array.
        # A constant slot would let XLA inline `rows`' conditional, and it copied them too (every
        # cache array of the all-slots step, before 2026-12-05): the barrier keeps it a traced value.
        slot = lax.optimization_barrier(jnp.int32(b)) if rows is None else rows[b]
        row_logits, row_cache = forward(params, cache.rows(slot), row[0][:, None], row[1], row[2].astype(jnp.int32),
                                        config=config, precision=precision, kv_len=kv_len)
        cache = cache.put_rows(row_cache, slot)
        logits.append(row_logits)
    return jnp.concatenate(logits, axis=0), cache


def _draw(device: DeviceState, logits, want_logprobs, take, advance, mask=None):
    """`draw` on the rows of `device` itself (every row of its state is a row of the logits)."""
    advance = jnp.asarray(advance, jnp.bool_)
    drew = take & ((device.remaining > 0) | jnp.logical_not(advance))
    ids, lp, top_ids, top_lp, sampling = sample(logits, device.sampling, want_logprobs, drew, mask)
    ids = jnp.where(drew, ids, device.tokens)
    step = (drew & advance).astype(jnp.int32)
    device = dataclasses.replace(device, sampling=sampling, tokens=jnp.where(step > 0, ids, device.tokens),
                                 positions=device.positions + step, remaining=device.remaining - step)
    return device, (ids, lp, top_ids, top_lp, drew)


def _decode(params, device: DeviceState, want_logprobs, config, precision, kv_len, row_invariant=False):
    """One decode step for every row of `device`: forward, then `_draw`. Rows with remaining == 0
    are idle: they write nothing and keep their token, position and sampling state."""
    active = device.remaining > 0
    logits, cache, *h = _forward_rows(params, device.cache, device.tokens, device.positions, active,
                                      config, precision, kv_len, row_invariant, device.hidden is not None)
    hidden = device.hidden if not h else _keep_hidden(device.hidden, h[0], active)
    return _draw(dataclasses.replace(device, cache=cache, hidden=hidden), logits, want_logprobs, active, True)


_ROW_FIELDS = ("sampling", "tokens", "positions", "remaining", "hidden")  # per-slot state besides the cache


def _gather(device: DeviceState, rows, kv_len=None, cache: bool = True) -> DeviceState:
    """The rows `rows` [k] of the per-slot state, and of the cache's first kv_len slots (`cache`; else
    the whole cache, untouched, rides along)."""
    per_row = {name: jax.tree.map(lambda a: a[rows], getattr(device, name)) for name in _ROW_FIELDS}
    return DeviceState(cache=device.cache.gather(rows, kv_len) if cache else device.cache, **per_row)


def _scatter(device: DeviceState, sub: DeviceState, rows, kv_len=None, cache: bool = True) -> DeviceState:
    """`device` with rows `rows` replaced by `sub` (from `_gather` with the same `cache`)."""
    per_row = {name: jax.tree.map(lambda a, b: a.at[rows].set(b), getattr(device, name), getattr(sub, name))
               for name in _ROW_FIELDS}
    return DeviceState(cache=device.cache.scatter(rows, sub.cache, kv_len) if cache else sub.cache, **per_row)


@functools.partial(jax.jit, static_argnames=DECODE_STATIC, donate_argnames=("device",))
def decode_step(params, device: DeviceState, want_logprobs, *, config, precision, kv_len=None,
                row_invariant=False):
    """One decode step for every slot in one program (`decode_forward` then `draw`, as the profiler
    traces it); `kv_len` >= every position. Returns (device, (ids, logprobs, top ids, top
    logprobs, active)), each per slot."""
    return _decode(params, device, want_logprobs, config, precision, kv_len, row_invariant)


# The engine's decode step is two dispatches: `decode_forward` (cache update, logits), then `draw`
# (next tokens; with a mask for constrained decoding, whose host fills step n's token masks while
# the device runs step n's forward: the engine's `_decode_constrained`).

@functools.partial(jax.jit, static_argnames=DECODE_STATIC, donate_argnames=("device",))
def decode_forward(params, device: DeviceState, rows=None, *, config, precision, kv_len=None, row_invariant=False):
    """The forward half of a decode step of every slot (`rows` None) or of the group `rows` [k]:
    returns (device with its cache written, logits [B or k, V] f32 of each row's next token).

    A group's state is gathered, stepped and scattered back: a decode step costs about its batch in
    weight re-reads on CPU (a batch-8 step ~3x a batch-1 step), so few active requests run in a
    small group. Its cache rows are not moved: the forward writes each row's new position into the
    cache in place and reads the rows it needs (`forward`'s `rows`). `kv_len`: a bound, or the
    tuple of bounds (the shape plan's KV buckets) the step chooses from at run time (`forward`)."""
    sub = device if rows is None else _gather(device, rows, cache=False)
    logits, cache, *h = _forward_rows(params, device.cache, sub.tokens, sub.positions, sub.remaining > 0, config,
                                      precision, kv_len, row_invariant, sub.hidden is not None, rows)
    hidden = _keep_hidden(sub.hidden, h[0] if h else None, sub.remaining > 0)  # the token `draw` takes
    if rows is None:
        return dataclasses.replace(device, cache=cache, hidden=hidden), logits
    return dataclasses.replace(device, cache=cache,
                               hidden=None if hidden is None else device.hidden.at[rows].set(hidden)), logits


def _per_position(state: SamplingState, n: int) -> SamplingState:
    """Each row's settings repeated for its next n generation steps ([B * n] rows, steps s .. s+n-1),
    without the [B, V] counts (`choose_ids` and `probabilities` do not read them)."""
    light = dataclasses.replace(state, output_counts=None, prompt_mask=None)
    repeated = jax.tree.map(lambda a: jnp.repeat(a, n, axis=0), light)
    steps = (state.step[:, None] + jnp.arange(n, dtype=state.step.dtype)[None, :]).reshape(-1)
    return dataclasses.replace(repeated, step=steps)


def _verify(params, device: DeviceState, want_logprobs, proposals, num_proposed, config, precision, kv_len,
            q=None, drafted=None, rows=None):
    """One verify step (module docstring) for every row: proposals [B, k] i32, of which the first
    num_proposed [B] are real. A row with none proposed steps exactly as a decode step; rows with
    remaining == 0 are idle. A row never gets more tokens than it still owes. Proposed positions of
    rows with penalties are drawn without them: the engine proposes nothing for such rows.
    `q` [B, k, V]: the distributions a draft model drew the proposals of the rows `drafted` [B] bool
    from; those rows, when sampled, take the rejection rule with q (gemmax.engine.draft.draft_rule).
    `rows` [B]: the cache row of each row, written and read in place (`forward`; None: row b)."""
    B, k = proposals.shape
    active = device.remaining > 0
    num_proposed = jnp.where(active, jnp.clip(num_proposed, 0, device.remaining - 1), 0)
    tokens = jnp.concatenate([device.tokens[:, None], proposals], axis=1)  # [B, k+1]
    logits, cache, *h = forward(params, device.cache, tokens, device.positions,
                                jnp.where(active, num_proposed + 1, 0), config=config, precision=precision,
                                logits="all", kv_len=kv_len, hidden=device.hidden is not None, rows=rows)  # [B, k+1, V]
    # Every position's draw in one sampler (a program with one copy of it, where `sample` and a
    # second call held three): the first as the decode step draws it (`sample`: with the row's
    # penalties, which leave a row without them exactly as it is: x / 1, x * 1, x - 0), the later ones
    # at steps s+1 .. s+k without them (rows with penalties get no proposals). The penalised first
    # position is selected in as the sampler's input is written, in one pass. Set into the logits
    # instead (`.at[:, 0].set`), which are read again below, it made XLA copy all [B, k+1, V] four
    # times (75 MB each at 8 rows and k = 8 on the built-in model).
    first = apply_penalties(logits[:, 0], device.sampling)[:, None]  # [B, 1, V]
    at_first = (jnp.arange(k + 1) == 0)[None, :, None]
    drawn = choose_ids(jnp.where(at_first, first, logits).reshape(B * (k + 1), -1),
                       _per_position(device.sampling, k + 1))
    drawn = drawn.reshape(B, k + 1)  # the target's token after each input
    lp, top_ids, top_lp = logprobs_of(logits[:, 0], drawn[:, 0], want_logprobs)
    sampling = counted(device.sampling, drawn[:, 0], active)
    agree = (proposals == drawn[:, :k]) & (jnp.arange(k)[None, :] < num_proposed[:, None])
    accepted = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)  # [B] leading agreements
    if q is not None:
        ruled = drafted & (device.sampling.temperature > 0)
        drawn, accepted, sampling = lax.cond(
            jnp.any(ruled), lambda: _draft_ruled(logits, device.sampling, sampling, proposals, num_proposed, q, ruled,
                                                 drawn, accepted, active),
            lambda: (drawn, accepted, sampling))
    emitted = jnp.where(active, accepted + 1, 0)  # drawn[:, :accepted + 1]
    last = jnp.take_along_axis(drawn, accepted[:, None], axis=1)[:, 0]
    kept_later = (jnp.arange(k)[None, :] < accepted[:, None]).astype(jnp.int32)  # drawn[:, 1:] emitted
    sampling = dataclasses.replace(
        sampling, step=sampling.step + accepted,
        output_counts=sampling.output_counts.at[jnp.arange(B)[:, None], drawn[:, 1:]].add(kept_later))
    hidden = device.hidden
    if hidden is not None:  # the hidden state after the last kept input, which drew the row's last token
        hidden = _keep_hidden(hidden, jnp.take_along_axis(h[0], accepted[:, None, None], axis=1)[:, 0], active)
    device = DeviceState(cache=cache, sampling=sampling, tokens=jnp.where(active, last, device.tokens),
                         positions=device.positions + emitted, remaining=device.remaining - emitted, hidden=hidden)
    return device, (drawn, accepted, lp, top_ids, top_lp, active)


def _draft_ruled(logits, before: SamplingState, after: SamplingState, proposals, num_proposed, q, ruled, drawn,
                 accepted, active):
    """The rows `ruled` [B] (sampled, draft-proposed) of a verify step redrawn by the rejection rule
    with q: logits [B, k+1, V] of the target; `before` / `after` the sampling state before and after
    the first position's draw (its count moves to the rule's first token). -> (drawn, accepted, after)."""
    B, k = proposals.shape
    p = probabilities(logits.reshape(B * (k + 1), -1), _per_position(before, k + 1)).reshape(B, k + 1, -1)
    ruled_drawn, ruled_accepted = draft_rule(p, q, proposals, num_proposed, before.key, before.step)
    new_first = jnp.where(ruled, ruled_drawn[:, 0], drawn[:, 0])
    count = active.astype(jnp.int32)
    rows = jnp.arange(B)
    counts = after.output_counts.at[rows, drawn[:, 0]].add(-count).at[rows, new_first].add(count)
    return (jnp.where(ruled[:, None], ruled_drawn, drawn), jnp.where(ruled, ruled_accepted, accepted),
            dataclasses.replace(after, output_counts=counts))


@functools.partial(jax.jit, static_argnames=PREFILL_STATIC, donate_argnames=("device",))
def verify_rows(params, device: DeviceState, want_logprobs, rows, proposals, num_proposed, q=None, drafted=None, *,
                config, precision, kv_len=None):
    """One verify step (`_verify`) for the slots `rows` [g]: proposals [g, k], num_proposed [g];
    with a draft model, q [g, k, V] and drafted [g] bool (`_verify`). The rows' k + 1 positions are
    written into their cache rows in place, and each layer reads its rows' past as a prefill chunk
    does (`forward`'s `rows`). `kv_len`: the tuple of KV buckets, among which the step reads the
    smallest that holds every row's past, chosen on the device: one program per group and k for every
    context length (or a bound at least every row's position). Returns (device, (drawn [g, k+1],
    accepted [g], logprob, top ids, top logprobs of each row's first draw, active [g]))."""
    sub, out = _verify(params, _gather(device, rows, cache=False), want_logprobs[rows], proposals, num_proposed,
                       config, precision, kv_len, q, drafted, rows)
    return _scatter(device, sub, rows, cache=False), out


@functools.partial(jax.jit, donate_argnames=("device",))
def set_sampling_row(device: DeviceState, slot, values: dict) -> DeviceState:
    """One request's sampling settings (`sampling.row_values`) into its slot."""
    return dataclasses.replace(device, sampling=set_row(device.sampling, slot, values))

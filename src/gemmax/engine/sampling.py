"""Per-row sampling as one pure function, so a decode batch can mix settings.

Each row has its own temperature, top-k, top-p, min-p, penalties and PRNG key. A row's random draw at
generation step n uses `fold_in(key(seed), n)`, so the same seed gives the same tokens whatever else
shares the batch; temperature 0 is greedy and ignores the seed. The expensive parts (penalties, the
block masses behind temperature and top-p, wider candidate windows, log-softmax for logprobs) sit
behind `lax.cond`, so a batch that does not need them does not pay for them.

No path sorts the vocabulary (`_filtered_sample`): temperature alone is an inverse-CDF draw over
64-token blocks; top-k, top-p and min-p run on the best 64 (then on CPU 256, 1,024) tokens, found exactly
from block maxima, and a row whose kept set is not provably inside those takes the rule over its
whole row by thresholds found by a search over the logits' bits (`_threshold_ids`). The
distribution is the sorted rule's (`tests/test_sampling.py` checks it against float64 probabilities).
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


_BLOCK = 64  # entries per block of the sampled paths' block maxima and block masses
_TIERS = (64, 256, 1024)  # candidate windows: a top-k up to 64 fits the first; larger kept sets widen (`_tiers`)
_OFF = np.iinfo(np.int32).max  # top-k switched off


def _uniforms(state: SamplingState) -> jax.Array:
    """[B, 2] f32 in [0, 1): row b's two draws at its step, from fold_in(key(seed), step) alone."""
    keys = jax.vmap(lambda k, n: jax.random.fold_in(jax.random.wrap_key_data(k), n))(state.key, state.step)
    return jax.vmap(lambda k: jax.random.uniform(k, (2,)))(keys)


def _search(weights: jax.Array, u: jax.Array) -> jax.Array:
    """weights [B, n] >= 0, u [B] -> [B] i32: the first index whose running sum exceeds u * total,
    so index i with probability weights[i] / total. Never an entry of weight 0 (when rounding puts the
    target past the last running sum, the last positive entry)."""
    n = weights.shape[-1]
    running = jnp.cumsum(weights, axis=-1)
    index = jnp.sum(running <= u[:, None] * running[:, -1:], axis=-1)
    last_positive = n - 1 - jnp.argmax((weights > 0)[:, ::-1], axis=-1)
    return jnp.minimum(index, last_positive).astype(jnp.int32)


def _draw(block_mass: jax.Array, block_weights, u: jax.Array) -> jax.Array:
    """Inverse-CDF draw in two levels, so nothing runs a sum along a whole row: a block with
    probability proportional to its mass (`block_mass` [B, nb]), then an entry inside it by weight
    (`block_weights(j)` -> [B, block] for block indices j [B]), each level with its own uniform
    (u [B, 2]). -> [B] i32 index into the row."""
    j = _search(block_mass, u[:, 0])
    inner = block_weights(j)
    return j * inner.shape[-1] + _search(inner, u[:, 1])


def _take_block(blocks: jax.Array, j: jax.Array) -> jax.Array:
    """blocks [B, nb, block], j [B] -> [B, block]."""
    return jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k kept whole: XLA:CPU otherwise turns a top-k whose indices a later op does not need
    straight away into a full sort of its operand (13 ms instead of 0.5 ms on [8, 4096] for k = 64).
    Not under a mesh (gemmax.engine.mesh): XLA's SPMD pipeline aborts in its TopK decomposer on a
    top-k read by an optimization barrier (jaxlib 0.10.2, "optimization_barrier ... cannot be
    downcasted to HloGetTupleElementInstruction")."""
    if not jax.sharding.get_abstract_mesh().empty:
        return jax.lax.top_k(x, k)
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k))


def _candidates(blocks: jax.Array, block_max: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """The same (values, ids) [B, count] as lax.top_k over the row (descending, ties to the lower
    index) without sorting the row: the `count` best entries lie in the `count` blocks with the best
    maxima (a block left out has `count` blocks ahead of it, each with an entry ahead of all of its
    own), gathered in index order so that top_k's tie order is the row's."""
    B, nb, block = blocks.shape
    _, best = _top_k(block_max, min(count, nb))
    best = jnp.sort(best, axis=-1)  # [B, n] block ids, ascending
    gathered = jnp.take_along_axis(blocks, best[:, :, None], axis=1).reshape(B, -1)  # [B, n * block]
    values, at = _top_k(gathered, count)
    return values, jnp.take_along_axis(best, at // block, axis=1) * block + at % block


def _window(values, ids, t, k, top_p, min_p, mass, u):
    """The rule on the first W entries of each row's descending order (values [B, W] raw logits, ids
    [B, W]): top-k; top-p on the top-k renormalised; min-p; one draw among the kept. Returns (ids [B],
    proven [B], held [B], last [B]): proven, whether the kept set provably lies inside the window (the
    top-k does; or, with top-p over the whole row, the window already holds top_p of the mass, so no
    later entry starts below it; or the window's last entry is under the min-p bar, and every later
    one is no larger); held and last, the window's mass and its last entry (p / p_max), which bound
    what a wider window can hold (`_can_prove`'s `reach`). Outside the window the kept set is unknown,
    so an unproven row takes a larger window. `mass` [B] is the row's sum of exp((x - max) / t),
    needed only by top-p with top-k off."""
    B, W = values.shape
    w = jnp.exp((values - values[:, :1]) / t)  # [B, W], descending from 1: p / p_max
    rank = jnp.arange(W)[None, :]
    in_k = rank < k[:, None]
    k_inside = k <= W
    p_on = top_p < 1.0
    probs = w / jnp.where(k_inside, jnp.sum(jnp.where(in_k, w, 0.0), axis=-1), mass)[:, None]
    running = jnp.cumsum(probs, axis=-1)
    keep = in_k & (w >= min_p[:, None])
    keep &= ~p_on[:, None] | (running - probs < top_p[:, None])  # nothing before it reached top_p
    keep |= rank == 0
    proven = k_inside | ((~p_on | (k == _OFF)) & ((p_on & (running[:, -1] >= top_p)) | (w[:, -1] < min_p)))
    blocks = jnp.where(keep, w, 0.0).reshape(B, -1, min(W, _BLOCK))
    index = _draw(jnp.sum(blocks, axis=-1), lambda j: _take_block(blocks, j), u)
    return jnp.take_along_axis(ids, index[:, None], axis=1)[:, 0], proven, jnp.sum(w, axis=-1), w[:, -1]


def _can_prove(size: int, reach, k, top_p, min_p, mass, over_bar) -> jax.Array:
    """[B] bool: whether a window of the best `size` entries can prove a row's kept set (`_window`),
    known before building it: a necessary condition of `_window`'s `proven`. A top-k inside the
    window proves (k <= size). Otherwise (top-p off, or top-k off) top-p proves only if the window
    holds top_p of the mass, and its entries hold at most `reach` [B] (in units of p_max): `size`
    (each entry is p / p_max <= 1), or less where a narrower window of W entries was built, its mass
    plus its last entry for each of the size - W entries after it (each is no larger); a row whose
    top_p x mass exceeds that cannot (0.999: slack for the sums' rounding); and min-p proves only if
    fewer than `size` entries clear its bar, so not when `over_bar` [B] blocks already have an entry
    that does. On flat rows (a small model's, a high temperature) every window used to be built and
    failed before the whole-row thresholds (`benchmarks/sampling.py --flat`, 262,144 entries, with
    `_ranks_if_tied`: min_p 0.05 1.8 -> 0.6 ms at batch 1 and 22.8 -> 14.4 ms at batch 8;
    docs/bench.md), and on rows less flat the wider windows still were, by `size` alone
    (docs/bench.md, "The windows' reach"). The window of the whole row (a vocabulary of at most
    1,024) is always built: every kept set lies in it."""
    k_off, p_on = k == _OFF, top_p < 1.0
    by_mass = p_on & (reach >= 0.999 * top_p * mass)
    by_bar = (min_p > 0.0) & (over_bar < size)
    return (k <= size) | ((~p_on | k_off) & (by_mass | by_bar))


def _blocks_over_bar(block_best: jax.Array, min_p: jax.Array) -> jax.Array:
    """[B]: the blocks whose best entry (`block_best` [B, nb], p / p_max) clears the min-p bar, with
    slack for rounding (never more than clear it): `_can_prove`'s `over_bar`."""
    return jnp.sum(block_best >= min_p[:, None] * (1 + 1e-4), axis=-1)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 [..] -> uint32 [..] in the same order (-0.0 counted as +0.0; -inf lowest)."""
    bits = jax.lax.bitcast_convert_type(x + 0.0, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000))


def _highest_key(keys: jax.Array, holds, ways: int) -> jax.Array:
    """[B] u32: per row, the largest key value tau (over `keys` [B, n]) with holds(tau) true, where
    holds falls as tau rises and holds at the row's lowest key; `holds` maps candidates [B, m] to
    [B, m] bool. Each pass tries `ways - 1` candidates that split [lo, hi] into `ways` parts, so
    ceil(32 / log2(ways)) passes over the row and no sort. The answer is one key whatever `ways`."""
    assert ways >= 2, ways
    lo = jnp.min(keys, axis=-1)
    hi = jnp.max(keys, axis=-1)
    i = jnp.arange(1, ways, dtype=jnp.uint32)[None, :]  # [1, ways - 1]

    def step(_, bounds):  # invariant: holds(lo); tau <= hi
        lo, hi = bounds
        span = (hi - lo)[:, None] + 1  # [B, 1]: under 2^32 (finite keys, -inf, +inf)
        cuts = lo[:, None] + i * (span // ways) + (i * (span % ways) + ways - 1) // ways  # lo + ceil(i span / ways)
        cuts = jnp.minimum(cuts, hi[:, None])
        ok = holds(cuts)  # [B, ways - 1], falling along the cuts
        lo_next = jnp.max(jnp.where(ok, cuts, lo[:, None]), axis=-1)
        return lo_next, jnp.min(jnp.where(ok, hi[:, None], cuts - 1), axis=-1)

    return jax.lax.fori_loop(0, -(-32 // (ways.bit_length() - 1)), step, (lo, hi))[0]


def _tie_rank(tie: jax.Array) -> jax.Array:
    """tie [B, n * _BLOCK] bool -> [B, n * _BLOCK] i32: each entry's count of tied entries before it
    (in index order), summed in two levels (block counts, then inside a block), no row-long scan."""
    B = tie.shape[0]
    blocks = tie.reshape(B, -1, _BLOCK).astype(jnp.int32)
    counts = jnp.sum(blocks, axis=-1)
    before = jnp.cumsum(counts, axis=-1) - counts
    return (jnp.cumsum(blocks, axis=-1) - blocks + before[:, :, None]).reshape(B, -1)


def _ranks_if_tied(tie: jax.Array, on: jax.Array) -> jax.Array:
    """`_tie_rank(tie)`, computed only when a row that uses the threshold (`on` [B, 1]) has two or
    more tied entries: a lone entry's rank is 0 (the other rows' ranks are never read; a row with
    the rule off ties at its lowest key, the -inf of masked tokens). Real logits seldom tie at a
    threshold, and the ranks' two-level running sums cost 9-13 ms at batch 8 over 262,144 entries
    (the whole-row path runs them once per threshold)."""
    return jax.lax.cond(jnp.any(on[:, 0] & (jnp.sum(tie, axis=-1) > 1)), lambda: _tie_rank(tie),
                        lambda: jnp.zeros(tie.shape, jnp.int32))


def _search_ways() -> int:
    """`_highest_key`'s parts a pass: a bisection (2: 32 passes of one candidate) on CPU, where a pass
    costs its compares; 4 (16 passes of 3) elsewhere, where a pass of the loop has a fixed cost of its
    own. The same for every row count, so a row's sums do not depend on what shares its batch.
    `benchmarks/sampling.py --flat`, top_p 0.9 over 262,144 entries, with `_tiles`: TPU v5e one row
    0.409 -> 0.319 ms, 8 rows 0.537 -> 0.612 ms (measured there; a GPU follows it untested); CPU
    (row by row) 2.1-2.2 -> 3.0-3.2 ms a row (benchmarks/results/tpu/sampler-2026-12-06/)."""
    return 2 if jax.default_backend() == "cpu" else 4


def _tiers() -> tuple[int, ...]:
    """The candidate windows `_filtered_sample` tries before the whole-row thresholds: every one of
    `_TIERS` on CPU, where the thresholds cost 2-5 ms a row; only the first elsewhere. On a TPU
    v5e a window's exact top-k costs more than the thresholds it would spare: top_p 0.9 at
    temperature 0.7 over bfloat16-rounded Gaussian rows of 262,144 (std 1 to 3, so the 256- and
    1,024-windows are built and seldom prove), one row, ms: every window 0.95-1.15, the first only
    0.31-0.34, the thresholds alone 0.30; 8 rows 1.56-1.75, 0.97-1.02, 0.96; the serving engine's
    draw took 1.09 ms a step at one stream (benchmarks/results/tpu/sampler-windows-2026-12-06/). A GPU
    follows the TPU untested. Per backend, so a row's window never depends on its batch."""
    return _TIERS if jax.default_backend() == "cpu" else _TIERS[:1]


def _tiles(a: jax.Array) -> jax.Array:
    """[B, n] -> [B, n / 128, 128] (n / 64 rows of 64 when n is not a multiple of 128): what
    `_threshold_ids`' passes reduce, so that one row fills a TPU's [8, 128] registers (as [1, n]
    it fills one sublane in 8). TPU v5e, top_p 0.9 over 262,144 flat entries: one row 0.46 -> 0.41
    ms, 8 rows 0.87 -> 0.54 ms; CPU unchanged (docs/bench.md)."""
    lanes = 128 if a.shape[-1] % 128 == 0 else _BLOCK
    return a.reshape(a.shape[0], -1, lanes)


def _threshold_ids(x: jax.Array, w: jax.Array, k, top_p, min_p, u) -> jax.Array:
    """The rule over a whole row without sorting it, for rows whose kept set no window proved
    (x [B, n * _BLOCK] logits padded with -inf, w [B, n * _BLOCK] = p / p_max): top-k is the
    entries above the k-th best logit plus, of those equal to it, the first ones by index; top-p is,
    of the top-k, the entries above the largest logit whose top-k entries at or above it hold
    top_p of the top-k's mass, plus those equal to it while the mass before them (ties in index
    order) is under top_p; then min-p and one draw among the kept (`_draw`). Each threshold is a
    search over the logits' bits (`_highest_key`, `_search_ways`): 16 or 32 passes over the row (as
    `_tiles`), where a sort of 262,144 entries at batch 8 took 543 ms on 2 CPU cores."""
    B = x.shape[0]
    keys = _order_keys(x)
    tiles = _tiles(keys)  # what the searches' passes reduce
    k_on, p_on = (k != _OFF)[:, None], (top_p < 1.0)[:, None]
    ways = _search_ways()

    def top_k_set():
        tau = _highest_key(keys, lambda t: jnp.sum(tiles[:, None] >= t[:, :, None, None], axis=(2, 3)) >= k[:, None],
                           ways)[:, None]
        above = keys > tau
        tie = keys == tau
        room = (k - jnp.sum(above, axis=-1))[:, None]
        return ~k_on | above | (tie & (_ranks_if_tied(tie, k_on) < room))

    in_k = jax.lax.cond(jnp.any(k_on), top_k_set, lambda: jnp.ones(x.shape, jnp.bool_))
    w_k = jnp.where(in_k, w, 0.0)
    goal = top_p[:, None] * jnp.sum(w_k, axis=-1, keepdims=True)  # [B, 1]

    def top_p_set():
        w_tiles = _tiles(w_k)

        def holds(t):  # [B, m] candidates -> whether the top-k mass at or above each reaches goal
            return jnp.sum(jnp.where(tiles[:, None] >= t[:, :, None, None], w_tiles[:, None], 0.0), axis=(2, 3)) >= goal

        tau = _highest_key(keys, holds, ways)
        tau = tau[:, None]
        above = keys > tau
        tie = in_k & (keys == tau)
        mass_above = jnp.sum(jnp.where(above, w_k, 0.0), axis=-1, keepdims=True)
        tie_w = jnp.max(jnp.where(tie, w, 0.0), axis=-1, keepdims=True)  # the tied entries' common weight
        # the first tied entry always stays (the search proved the mass above tau under goal; its sums
        # may round otherwise than this flat one), the later ones while the mass before them is under it
        rank = _ranks_if_tied(tie, p_on)
        return above | (tie & ((rank == 0) | (mass_above + rank * tie_w < goal)))

    keep = in_k & jax.lax.cond(jnp.any(p_on), lambda: ~p_on | top_p_set(), lambda: jnp.ones(x.shape, jnp.bool_))
    keep &= w >= min_p[:, None]
    keep |= jnp.arange(x.shape[-1])[None, :] == _argmax(x)[:, None]  # the best token always stays
    blocks = jnp.where(keep, w, 0.0).reshape(B, -1, _BLOCK)
    return _draw(jnp.sum(blocks, axis=-1), lambda j: _take_block(blocks, j), u)


def _threshold_ids_by_row(x: jax.Array, top: jax.Array, t: jax.Array, k, top_p, min_p, u, need) -> jax.Array:
    """`_threshold_ids` one row at a time (`lax.map`), only for the rows with `need` [B] (the others
    get 0, never read): x [B, n] logits padded with -inf, top [B] their maxima, t [B] temperatures, k
    [B] (`_OFF`: off), top_p and min_p [B], u [B, 2]. The same ids as the batched call, row by row.
    On CPU only (`_by_row`): flat rows at batch 8 (`benchmarks/sampling.py --flat --against` the
    batched version, one process, 2-core Zen 4) took 16.2 ms for top_p 0.9 against 34.2, and 2.7 ms
    for min_p 0.05 against 10.3 (docs/bench.md: part of that is the harness's order); one row alone
    2.2 and 0.5 ms either way. Our reading: a row's arrays stay in cache through the path's passes."""

    def row(args):
        x_r, top_r, t_r, k_r, top_p_r, min_p_r, u_r, need_r = args  # row r: x_r [n], u_r [2], the rest []

        def ids():
            w_r = jnp.exp((x_r - top_r) / t_r)  # p / p_max
            return _threshold_ids(x_r[None], w_r[None], k_r[None], top_p_r[None], min_p_r[None], u_r[None])[0]

        return jax.lax.cond(need_r, ids, lambda: jnp.int32(0))

    return jax.lax.map(row, (x, top, t, k, top_p, min_p, u, need))


def _by_row() -> bool:
    """Whether the whole-row thresholds run row by row: on CPU, where it was measured. A GPU or TPU
    would run a search's passes once per row instead of once per batch, and under a mesh the map
    would gather rows split over the data-parallel axis; neither is measured, so they keep the
    batched call."""
    return jax.default_backend() == "cpu" and jax.sharding.get_abstract_mesh().empty


def _filtered_sample(logits: jax.Array, state: SamplingState) -> jax.Array:
    """Temperature, then top-k, top-p (on the renormalised top-k), min-p; one draw per row; [B] i32
    (meaningless on greedy rows). Nothing sorts the row:
    - temperature alone: inverse CDF over 64-entry blocks of the row as it is (block masses, then
      one block's entries), no sort and no random numbers beyond two per row;
    - top-k, top-p, min-p: the rule on the best 64 entries (found from block maxima, `_candidates`),
      then (on CPU, `_tiers`) on the best 256 and 1,024 for rows it did not prove, then by whole-row thresholds
      (`_threshold_ids`, row by row on CPU) for the rest; a window in which no row still open can be
      proven (`_can_prove`, with what a narrower window built bounds) is not built.
    Each row's token depends only on its own logits, settings and key: which window decides a row
    follows from the row alone, and each window runs the same arithmetic whatever else asked for it."""
    B, V = logits.shape
    sampling = state.temperature > 0
    t = jnp.maximum(state.temperature, 1e-6)[:, None]  # [B, 1]
    k = jnp.where((state.top_k > 0) & (state.top_k < V), state.top_k, _OFF)
    top_p, min_p = state.top_p, state.min_p
    plain = (k == _OFF) & (top_p >= 1.0) & (min_p <= 0.0)
    filtered, plain = sampling & ~plain, sampling & plain
    u = _uniforms(state)
    x = jnp.pad(logits, ((0, 0), (0, -V % _BLOCK)), constant_values=-jnp.inf) if V % _BLOCK else logits
    blocks = x.reshape(B, -1, _BLOCK)  # [B, nb, block]
    block_max = jnp.max(blocks, axis=-1)  # [B, nb]
    top = jnp.max(block_max, axis=-1)[:, None, None]  # [B, 1, 1]
    weights = lambda b: jnp.exp((b - top) / t[:, :, None])  # noqa: E731  [B, n, block]: p / p_max

    block_mass = jax.lax.cond(  # [B, nb]; only temperature-alone rows and top-p over the whole row use it
        jnp.any(plain | (filtered & (top_p < 1.0) & (k == _OFF))),
        lambda: jnp.sum(weights(blocks), axis=-1), lambda: jnp.zeros_like(block_max))
    mass = jnp.sum(block_mass, axis=-1)  # [B]
    over_bar = _blocks_over_bar(weights(block_max[:, :, None])[:, :, 0], min_p)
    zeros = jnp.zeros(B, jnp.int32)

    def plain_ids():
        return _draw(block_mass, lambda j: weights(_take_block(blocks, j)[:, None])[:, 0], u)

    def window(values, ids):
        return _window(values, ids, t, k, top_p, min_p, mass, u)

    tiers = _tiers()

    def filtered_ids(tier: int = 0, open_=filtered, base=jnp.full(B, jnp.inf, mass.dtype),
                     last=jnp.zeros(B, mass.dtype)) -> jax.Array:
        """The rule on the best tiers[tier] entries for the rows `open_` [B] (no narrower window
        proved them), then wider. A window of n entries holds at most base + n x last [B]
        (`_can_prove`'s reach): from the last window built, of W entries, its mass less W x last,
        and its last entry; nothing known (inf, 0) before one is built."""
        size = min(tiers[tier], x.shape[-1])

        def build():
            found, proven, held, window_last = window(*_candidates(blocks, block_max, size))
            return found, proven, held - size * window_last, window_last

        if size >= V:  # a window of the whole row holds every kept set: no wider window or sort follows
            return build()[0]  # (a 128-token vocabulary: on CPU two windows and no thresholds)
        reach = jnp.minimum(size, base + size * last)
        found, proven, base, last = jax.lax.cond(  # a window no open row can be proven in is not built
            jnp.any(open_ & _can_prove(size, reach, k, top_p, min_p, mass, over_bar)),
            build, lambda: (zeros, jnp.zeros(B, jnp.bool_), base, last))
        still_open = open_ & ~proven
        if tier + 1 < len(tiers):
            wider = lambda: filtered_ids(tier + 1, still_open, base, last)  # noqa: E731
        else:
            def wider():
                if _by_row():
                    return _threshold_ids_by_row(x, top[:, 0, 0], t[:, 0], k, top_p, min_p, u, still_open)
                return _threshold_ids(x, weights(blocks).reshape(B, -1), k, top_p, min_p, u)
        return jnp.where(proven, found, jax.lax.cond(jnp.any(still_open), wider, lambda: found))

    plain_ids = jax.lax.cond(jnp.any(plain), plain_ids, lambda: zeros)
    return jnp.where(plain, plain_ids, jax.lax.cond(jnp.any(filtered), filtered_ids, lambda: zeros))


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


def unpack_mask(mask: jax.Array, vocab: int) -> jax.Array:
    """Packed token masks [B, ceil(V / 32)] i32 (bit j of word i: token 32 i + j allowed) -> [B, V] bool."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    return bits.reshape(mask.shape[0], -1)[:, :vocab].astype(jnp.bool_)


def choose_ids(logits: jax.Array, state: SamplingState) -> jax.Array:
    """The token of each row from logits [B, V] as they are (penalties and masks already applied):
    argmax on greedy rows, the filtered draw at the row's step on the others -> [B] i32. Reads only
    the settings, keys and steps of `state` (not its counts)."""
    sampling = state.temperature > 0
    greedy = _argmax(logits)
    return jax.lax.cond(
        jnp.any(sampling),
        lambda: jnp.where(sampling, _filtered_sample(logits, state), greedy).astype(jnp.int32),
        lambda: greedy,
    )


def sample(logits: jax.Array, state: SamplingState, want_logprobs: jax.Array, advance: jax.Array | None = None,
           mask: jax.Array | None = None):
    """logits [B, V] f32 -> (ids [B] i32, logprob [B] f32, top ids [B, K] i32, top logprobs [B, K] f32,
    new state). Logprobs are of the model's distribution (before penalties and temperature) and are
    computed only when some row asks (`want_logprobs` [B] bool). Only rows with `advance` [B] bool
    (default all) count the token in their state (step, penalty counts); the others keep it as it was,
    without a select over the [B, V] arrays. `mask` [B, ceil(V / 32)] i32 (constrained decoding,
    `unpack_mask`): tokens whose bit is 0 are never chosen; an all-ones row leaves its logits as they
    are, so a free row draws the same token as without a mask. None (a separate compiled variant):
    no mask work at all."""
    logits_in = logits
    if mask is not None:
        logits = jnp.where(unpack_mask(mask, logits.shape[-1]), logits, -jnp.inf)

    # Both branches return only ids: a branch that passed the logits through would copy all [B, V].
    ids = jax.lax.cond(
        jnp.any((state.repetition != 1.0) | (state.presence != 0.0) | (state.frequency != 0.0)),
        lambda: choose_ids(apply_penalties(logits, state), state), lambda: choose_ids(logits, state),
    )

    return (ids, *logprobs_of(logits_in, ids, want_logprobs), counted(state, ids, advance))


def logprobs_of(logits: jax.Array, ids: jax.Array, want_logprobs: jax.Array):
    """(logprob of ids [B], top ids [B, K] i32, top logprobs [B, K]) of the model's distribution
    (logits [B, V] before penalties and temperature); computed only when some row asks
    (`want_logprobs` [B] bool), zeros otherwise."""

    def logprobs():
        lp = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return jnp.take_along_axis(lp, ids[:, None], axis=1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def no_logprobs():
        B = logits.shape[0]
        return (jnp.zeros(B, jnp.float32), jnp.zeros((B, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((B, MAX_LOGPROBS), jnp.float32))

    return jax.lax.cond(jnp.any(want_logprobs), logprobs, no_logprobs)


def counted(state: SamplingState, ids: jax.Array, advance: jax.Array | None = None) -> SamplingState:
    """`state` after the rows with `advance` [B] bool (None: all) drew ids [B]: their step moves on
    and the token is counted for the penalties."""
    count = jnp.ones_like(state.step) if advance is None else advance.astype(state.step.dtype)
    return dataclasses.replace(state, step=state.step + count,
                               output_counts=state.output_counts.at[jnp.arange(ids.shape[0]), ids].add(count))

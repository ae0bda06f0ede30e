"""The sampler against exact references: the greedy argmax (first index of the maximum, as
jnp.argmax), which rows' state a step advances, the sampled distribution of every rule against its
probabilities computed by a float64 sort, and seeds that give the same tokens whatever shares the batch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmax.engine import sampling
from gemmax.engine.sampling import (
    _OFF,
    _TIERS,
    SamplingState,
    _argmax,
    _blocks_over_bar,
    _can_prove,
    _candidates,
    _filtered_sample,
    _window,
    sample,
)


@pytest.mark.parametrize("vocab", [262144, 4096, 1000])  # 1000: not a multiple of the block
def test_argmax_is_the_first_index_of_the_maximum(vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((8, vocab)).astype(np.float32)
    logits[1, [7, 600, vocab - 1]] = 9.0  # ties in different blocks: the first wins
    logits[2, [vocab - 2, vocab - 1]] = 9.0  # ties in the last block
    logits[3, vocab - 1] = 9.0  # the very last entry
    logits[4, :] = 1.5  # all equal
    logits[5, :] = -np.inf  # nothing finite
    logits[6, [513, 512]] = 9.0  # a tie across a block boundary
    got = np.asarray(jax.jit(_argmax)(jnp.asarray(logits)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert list(got[1:7]) == [7, vocab - 2, vocab - 1, 0, 0, 512]


def test_only_advancing_rows_count_their_token():
    vocab = 64
    state = SamplingState.empty(3, vocab)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, vocab)), jnp.float32)
    ids, _, _, _, new = sample(logits, state, jnp.zeros(3, jnp.bool_), jnp.asarray([True, False, True]))
    np.testing.assert_array_equal(np.asarray(ids), np.argmax(np.asarray(logits), axis=-1))
    np.testing.assert_array_equal(np.asarray(new.step), [1, 0, 1])
    counts = np.asarray(new.output_counts)
    assert counts[0, int(ids[0])] == 1 and counts[2, int(ids[2])] == 1
    assert counts.sum() == 2 and counts[1].sum() == 0
    _, _, _, _, every = sample(logits, state, jnp.zeros(3, jnp.bool_))  # default: every row advances
    np.testing.assert_array_equal(np.asarray(every.step), [1, 1, 1])


# --- the sampled distribution against the rule, computed exactly in float64 by a sort ---------------

def _rule_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The probability of each token under the documented rule (as vLLM applies it): temperature; the
    top_k best (ties to the lower index); top_p on the renormalised top-k, keeping each token whose
    predecessors hold less than top_p; min_p against the best token; renormalise."""
    V = logits.shape[0]
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    s = scaled[order]
    keep = np.ones(V, bool)
    if 0 < top_k < V:
        keep[top_k:] = False
    p = np.where(keep, np.exp(s - s[0]), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        keep &= np.cumsum(p) - p < top_p
    keep &= p >= min_p * p[0]
    keep[0] = True
    q = np.where(keep, np.exp(s - s[0]), 0.0)
    out = np.zeros(V)
    out[order] = q / q.sum()
    return out


def _row_keys(seeds) -> jax.Array:
    """[B] seeds -> [B, 2] u32: each row's raw PRNG key, as `SamplingState.key` holds it."""
    return jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(jnp.asarray(seeds)).astype(jnp.uint32)


def _draws(logits: np.ndarray, temperature, top_k, top_p, min_p, n: int, batch: int = 2000, run=None) -> np.ndarray:
    """n independent draws of the sampler on one row of logits, `batch` rows (seeds) per call."""
    V = logits.shape[0]
    f = lambda v, dtype=jnp.float32: jnp.full(batch, v, dtype)  # noqa: E731
    run = run or jax.jit(_filtered_sample)
    out = []
    for start in range(0, n, batch):
        state = SamplingState(temperature=f(temperature), top_k=f(top_k, jnp.int32), top_p=f(top_p), min_p=f(min_p),
                              presence=f(0.0), frequency=f(0.0), repetition=f(1.0),
                              key=_row_keys(jnp.arange(start, start + batch)), step=f(7, jnp.int32), output_counts=jnp.zeros((batch, 1), jnp.int32),
                              prompt_mask=jnp.zeros((batch, 1), jnp.bool_))
        out.append(np.asarray(run(jnp.broadcast_to(jnp.asarray(logits), (batch, V)), state)))
    return np.concatenate(out)[:n]


def _peaked(vocab: int, seed: int) -> np.ndarray:
    """A language-model-like row: a few strong tokens (spread so that every boundary of the rules
    below cuts between tokens of a few percent) over a long Gaussian tail."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(vocab).astype(np.float32)
    head = rng.choice(vocab, 24, replace=False)
    logits[head] += np.linspace(7.0, 3.5, 24, dtype=np.float32)
    return logits


_FLAT = np.random.default_rng(3).standard_normal(1280).astype(np.float32) * 0.5  # top-p 0.95 keeps ~1,190

# (name, logits, temperature, top_k, top_p, min_p); "wide" cases need the 1,024-window, "sorted" the
# whole-row thresholds
_CASES = [
    ("temperature", _peaked(1280, 0), 1.0, 0, 1.0, 0.0),
    ("temperature 0.7, top_p 0.9", _peaked(1280, 1), 0.7, 0, 0.9, 0.0),
    ("top_k 40", _peaked(1280, 2), 1.0, 40, 1.0, 0.0),
    ("top_k 5", _peaked(1280, 2), 1.0, 5, 1.0, 0.0),
    ("min_p 0.05", _peaked(1280, 4), 1.0, 0, 1.0, 0.05),
    ("top_k 1100, min_p 0.05 (the bar proves the first window, the top-k none)", _peaked(1280, 8), 1.0, 1100, 1.0, 0.05),
    ("top_k 50, top_p 0.8, min_p 0.02, temperature 0.8", _peaked(1280, 5), 0.8, 50, 0.8, 0.02),
    ("wide: top_k 600, top_p 0.97", _peaked(1280, 6), 1.5, 600, 0.97, 0.0),
    ("wide: min_p 0.3 on a flat row", _FLAT, 1.0, 0, 1.0, 0.3),
    ("wide: top_k 900, min_p 0.3 on a flat row", _FLAT, 1.0, 900, 1.0, 0.3),
    ("sorted: top_p 0.95 on a flat row", _FLAT, 1.0, 0, 0.95, 0.0),
    ("sorted: top_k 1100", _FLAT, 1.0, 1100, 1.0, 0.0),
    ("small vocabulary, top_p 0.9", _peaked(100, 7), 1.0, 0, 0.9, 0.0),
]


@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_sampled_distribution_equals_the_rule(case):
    """Chi-square of 20,000 draws against the exact probabilities, over bins of at least 20 expected
    draws (token by token where a token carries that much, then consecutive ranks pooled), and no draw
    outside the kept set. A wrong rule fails this: an off-by-one at the top-k, top-p or min-p boundary
    moves a token of several percent."""
    _assert_draws_follow_the_rule(*case[1:])


def _assert_draws_follow_the_rule(logits, temperature, top_k, top_p, min_p, run=None):
    n = 20_000
    expected = _rule_probs(logits, temperature, top_k, top_p, min_p)
    counts = np.bincount(_draws(logits, temperature, top_k, top_p, min_p, n, run=run), minlength=logits.shape[0])
    assert counts[expected == 0].sum() == 0, "drew a token outside the kept set"
    order = np.argsort(-expected, kind="stable")
    order = order[expected[order] > 0]
    bins, observed, pending, pending_n = [], [], 0.0, 0
    for token in order:
        pending, pending_n = pending + expected[token] * n, pending_n + counts[token]
        if pending >= 20:
            bins.append(pending), observed.append(pending_n)
            pending, pending_n = 0.0, 0
    bins[-1] += pending
    observed[-1] += pending_n
    assert len(bins) >= 5
    bins = np.asarray(bins) * n / np.sum(bins)
    statistic, df = float(np.sum((np.asarray(observed) - bins) ** 2 / bins)), len(bins) - 1
    assert statistic < _chi2_bound(df), f"chi-square {statistic:.1f} over {df} degrees of freedom"


def _counting_windows(built: list[int]):
    """`_candidates` that also appends each window's size to `built` when the window is built (a
    callback in the branch that builds it): the windows `_filtered_sample` builds."""
    candidates = sampling._candidates

    def counted(blocks, block_max, count):
        jax.debug.callback(lambda _: built.append(count), block_max[0, 0])
        return candidates(blocks, block_max, count)

    return counted


_WIDE = [c for c in _CASES if c[0].startswith("wide")]


@pytest.mark.parametrize(("case", "windows"), list(zip(_WIDE, [set(), {64}, {64}], strict=True)), ids=[c[0] for c in _WIDE])
def test_an_accelerators_single_window_keeps_the_distribution(case, windows, monkeypatch):
    """Off CPU only the first window is tried (`_tiers`): the rows that the 256- and 1,024-windows
    decide on CPU take the whole-row thresholds there, with the same distribution, and no wider
    window is built (top_k 600 with top-p: not even the first, which cannot hold the top-k)."""
    built: list[int] = []
    monkeypatch.setattr(sampling, "_tiers", lambda: _TIERS[:1])
    monkeypatch.setattr(sampling, "_candidates", _counting_windows(built))
    _assert_draws_follow_the_rule(*case[1:], run=jax.jit(lambda x, s: _filtered_sample(x, s)))  # traced anew
    jax.effects_barrier()
    assert set(built) == windows, built


def _chi2_bound(df: int, z: float = 3.72) -> float:
    """The chi-square value exceeded with probability 1e-4 (z = 3.72), by Wilson and Hilferty's cube."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * np.sqrt(c)) ** 3


def test_the_cases_reach_every_window():
    """The cases above exercise the first window, the wider ones and the whole-row thresholds."""
    for name, logits, temperature, top_k, top_p, min_p in _CASES:
        kept = int((_rule_probs(logits, temperature, top_k, top_p, min_p) > 0).sum())
        if name.startswith("wide"):
            assert _TIERS[0] < kept <= _TIERS[-1], name
        elif name.startswith("sorted"):
            assert kept > _TIERS[-1], name
        elif name != "temperature":
            assert kept <= _TIERS[0], name


def _spread_row(vocab: int, kept: int, seed: int, low: float = 0.0) -> np.ndarray:
    """`kept` tokens of logits `low`-2, each in its own 64-token block, over a floor 10 below them."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(vocab).astype(np.float32) * 0.3 - 10.0
    blocks = rng.choice(vocab // 64, kept, replace=False)
    logits[blocks * 64 + rng.integers(0, 64, kept)] = rng.uniform(low, 2.0, kept).astype(np.float32)
    return logits


def test_skipping_the_windows_that_cannot_prove_changes_no_token(monkeypatch):
    """`_can_prove` lets a window go unbuilt when no row can be proven in it. It must never say so of
    a row the window would prove: the row would go on to wider windows and, where none proves it, to
    the whole-row thresholds (the same distribution, but another token for its seed). Every case
    draws the same tokens as with every window built, and so do rows that only the widest window
    proves, close to each condition's edge: a min_p row of 131,072 tokens whose 900 kept ones lie in
    as many blocks, a top_p row whose mass (~950 x p_max) nearly fills it, and top_k 1024. Flat top-p
    and min-p rows do skip the narrower windows: `_filtered_sample` builds only the 1,024-window. A
    Gaussian row (std 2, mass ~57 x p_max, 47,199 entries to reach top_p 0.95) builds the 64-window,
    which bounds what the wider ones can hold (49.6 x p_max at 1,024), so they are not built, even
    beside a row that the 64-window proves (wider windows are built for the rows still open); and a
    row of one entry at p_max and 150 at 0.4 builds the 64-window, fails there, and is proven by the
    256-window, which that bound (103 x p_max) lets be built, as it must (top_p 0.95: 58 x p_max)."""
    spread = ("min_p 0.05, 900 kept in 900 blocks", _spread_row(131072, 900, 9), 1.0, 0, 1.0, 0.05)
    heavy = ("top_p 0.95, ~950 x p_max", _spread_row(131072, 1000, 10, low=1.9), 1.0, 0, 0.95, 0.0)
    edges = [spread, heavy, ("top_k 1024 on a flat row", _FLAT, 1.0, 1024, 1.0, 0.0)]
    for _, logits, temperature, top_k, top_p, min_p in edges:
        assert 256 < (_rule_probs(logits, temperature, top_k, top_p, min_p) > 0).sum() <= _TIERS[-1]
    gaussian = np.random.default_rng(11).standard_normal(131072).astype(np.float32) * 2.0
    tail = ("top_p 0.95 on a Gaussian row", gaussian, 1.0, 0, 0.95, 0.0)
    assert (_rule_probs(*tail[1:]) > 0).sum() > _TIERS[-1]
    shoulder = np.full(131072, -30.0, np.float32)
    shoulder[0], shoulder[1:151] = 0.0, np.log(0.4)
    shoulder = ("top_p 0.95 on one entry and 150 at 0.4 of it", shoulder, 1.0, 0, 0.95, 0.0)
    assert _TIERS[0] < (_rule_probs(*shoulder[1:]) > 0).sum() <= _TIERS[1]

    built: list[int] = []
    monkeypatch.setattr(sampling, "_tiers", lambda: _TIERS)  # every window, as on CPU (a TPU tries the first)
    with monkeypatch.context() as patch:
        patch.setattr(sampling, "_candidates", _counting_windows(built))
        flat_top_p = next(c for c in _CASES if c[0] == "sorted: top_p 0.95 on a flat row")
        for case, windows in ((flat_top_p, [1024]), (spread, [1024]), (heavy, [1024]), (_CASES[3], [64]),
                              (tail, [64]), (shoulder, [64, 256])):
            built.clear()
            _draws(*case[1:], n=2, batch=2, run=jax.jit(lambda x, s: _filtered_sample(x, s)))
            jax.effects_barrier()
            assert built == windows, (case[0], built)
        # beside a top_k 5 row, which the 64-window proves, the Gaussian row still builds no wider one
        built.clear()
        state = dataclasses.replace(SamplingState.empty(2, 1), temperature=jnp.asarray([1.0, 1.0]),
                                    top_k=jnp.asarray([0, 5], jnp.int32), top_p=jnp.asarray([0.95, 1.0]))
        jax.jit(lambda x, s: _filtered_sample(x, s))(jnp.asarray(np.stack([gaussian, gaussian])), state)
        jax.effects_barrier()
        assert built == [64], built

    def draws():  # a fresh function each time: jit traces it again under the current `_can_prove`
        run = jax.jit(lambda x, s: _filtered_sample(x, s))
        wide = [spread, heavy, tail, shoulder]  # 131,072 tokens a row: fewer draws
        return {case[0]: _draws(*case[1:], n=200 if case in wide else 2000, batch=200 if case in wide else 2000,
                                run=run) for case in [*_CASES, *edges, tail, shoulder]}

    skipping = draws()
    monkeypatch.setattr(sampling, "_can_prove", lambda size, reach, k, *_: jnp.ones(k.shape, jnp.bool_))
    building_every_window = draws()
    for name, ids in skipping.items():
        np.testing.assert_array_equal(ids, building_every_window[name], err_msg=name)


def test_can_prove_holds_wherever_a_window_proves_a_row():
    """`_can_prove` is a necessary condition of `_window`'s `proven` at every window size, on rows at
    the edge of each condition: n entries of weight 1 and the rest masked (top-p mass exactly n),
    m blocks with an entry over the min-p bar, top-k either side of each size; and some edge rows are
    proven (the rows do reach the condition)."""
    V = 64 * 300
    rows, settings = [], []  # (temperature, top_k, top_p, min_p)
    for n in (63, 64, 65, 255, 256, 257, 1023, 1024, 1025):
        for top_p in (0.9, 0.95, 0.999, 0.9999):
            row = np.full(V, -np.inf, np.float32)
            row[np.random.default_rng(n).choice(V, n, replace=False)] = 1.0
            rows.append(row), settings.append((1.0, 0, top_p, 0.0))
    for m in (61, 62, 63, 64, 253, 254, 255, 256, 299):
        for temperature, min_p in ((1.0, 0.05), (0.3, 0.3), (2.0, 1.0)):
            row = np.full(V, -30.0, np.float32)
            blocks = np.random.default_rng(m).choice(V // 64, m, replace=False)
            row[blocks * 64 + 5] = np.float32(temperature * np.log(min(1.0, 1.5 * min_p)))  # p / p_max above the bar
            row[0] = 0.0
            rows.append(row), settings.append((temperature, 0, 1.0, min_p))
    for top_k in (63, 64, 65, 256, 257, 1024, 1025):
        rows.append(_FLAT.repeat(15)), settings.append((1.0, top_k, 0.9, 0.05))
    x = jnp.asarray(np.stack(rows))
    temperature, top_k, top_p, min_p = (np.asarray(column) for column in zip(*settings, strict=True))
    t = jnp.asarray(temperature, jnp.float32)[:, None]
    k = jnp.asarray(np.where(top_k > 0, top_k, _OFF), jnp.int32)
    blocks = x.reshape(len(rows), -1, 64)
    block_max = jnp.max(blocks, axis=-1)
    weights = jnp.exp((blocks - jnp.max(block_max, axis=-1)[:, None, None]) / t[:, :, None])
    mass = jnp.sum(weights, axis=(1, 2))
    over_bar = _blocks_over_bar(jnp.max(weights, axis=-1), jnp.asarray(min_p, jnp.float32))
    proven_somewhere = np.zeros(len(rows), bool)
    narrower = []  # (size, held, last) of each narrower window
    for size in _TIERS:
        _, proven, held, last = _window(*_candidates(blocks, block_max, size), t, k, jnp.asarray(top_p, jnp.float32),
                                        jnp.asarray(min_p, jnp.float32), mass, jnp.full((len(rows), 2), 0.5))
        # what the window can hold: its size, or, as `_filtered_sample` passes it from any narrower
        # window built, that one's mass plus its last entry for each entry more
        for reach in [size, *(jnp.minimum(size, h + (size - n) * lst) for n, h, lst in narrower)]:
            can = _can_prove(size, reach, k, jnp.asarray(top_p, jnp.float32), jnp.asarray(min_p, jnp.float32),
                             mass, over_bar)
            assert not np.any(np.asarray(proven) & ~np.asarray(can)), size
        narrower.append((size, held, last))
        proven_somewhere |= np.asarray(proven)
    assert proven_somewhere.sum() > len(rows) // 2


def test_ties_at_the_top_k_boundary_keep_the_lower_indices():
    logits = np.zeros(300, np.float32)
    logits[[250, 10, 200, 40]] = 2.0  # four tied best tokens; top_k 3 keeps 10, 40, 200
    drawn = set(_draws(logits, 1.0, 3, 1.0, 0.0, 2000).tolist())
    assert drawn == {10, 40, 200}
    logits[:] = 1.0  # all tied: top_k 70 (wider than the first window) keeps 0..69
    drawn = np.unique(_draws(logits, 1.0, 70, 1.0, 0.0, 4000))
    np.testing.assert_array_equal(drawn, np.arange(70))


@pytest.mark.parametrize(("top_k", "top_p", "kept"), [(1100, 1.0, 1100), (0, 0.9, 1152)])
def test_ties_beyond_every_window_keep_the_lower_indices(top_k, top_p, kept):
    """A row of 1,280 tied logits, cut beyond the widest window (the whole-row thresholds): top_k 1100
    keeps 0..1099; top_p 0.9 keeps each token whose predecessors in index order hold under 0.9 of the
    mass, 0..1151. 20,000 draws: a token kept one too many would be drawn ~18 times."""
    assert kept > _TIERS[-1]
    drawn = _draws(np.ones(1280, np.float32), 1.0, top_k, top_p, 0.0, 20_000)
    assert drawn.min() >= 0 and drawn.max() == kept - 1
    assert len(np.unique(drawn)) > 0.95 * kept


def test_a_row_draws_the_same_token_whatever_shares_the_batch():
    """Each row's token depends only on its logits, settings and seed: the same rows alone, or beside
    rows that need the 1,024-entry window, the full sort or the whole-row draw, give the same ids."""
    V = 1280
    settings = [  # temperature, top_k, top_p, min_p
        (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 40, 1.0, 0.0), (1.0, 0, 1.0, 0.05),
        (1.0, 600, 0.97, 0.0), (1.0, 0, 0.95, 0.0), (1.0, 1100, 1.0, 0.0), (0.8, 50, 0.8, 0.02),
    ]
    logits = np.stack([_peaked(V, i) if i != 6 else _FLAT for i in range(len(settings))])
    logits[7] = _FLAT

    def run(rows, steps):
        B = len(rows)
        state = SamplingState.empty(B, V)
        pick = lambda i: jnp.asarray([settings[r][i] for r in rows])  # noqa: E731
        state = dataclasses.replace(
            state, temperature=pick(0).astype(jnp.float32), top_k=pick(1).astype(jnp.int32),
            top_p=pick(2).astype(jnp.float32), min_p=pick(3).astype(jnp.float32),
            key=_row_keys(jnp.asarray(rows) + 100),
            step=jnp.asarray(steps, jnp.int32))
        ids, *_ = jax.jit(sample)(jnp.asarray(logits[rows]), state, jnp.zeros(B, jnp.bool_))
        return np.asarray(ids)

    everything = list(range(len(settings)))
    together = np.stack([run(everything, [s] * len(settings)) for s in range(6)])  # [steps, rows]
    for r in everything:
        alone = [run([r], [s])[0] for s in range(6)]
        np.testing.assert_array_equal(together[:, r], alone, err_msg=f"row {r} {settings[r]}")
    assert together[:, 0].tolist() == [int(np.argmax(logits[0]))] * 6  # greedy ignores the seed
    assert len(set(together[:, 1].tolist())) > 1  # the sampled rows do move between steps
    reordered = run(everything[::-1], [3] * len(settings))
    np.testing.assert_array_equal(reordered[::-1], together[3])


def test_penalties_follow_vllms_rule():
    """`apply_penalties` against the rule written out in numpy (vLLM's): the repetition penalty divides a
    positive and multiplies a negative logit of every token seen in the prompt or the output; presence
    subtracts once per token generated at least once, frequency once per time it was generated. Rows mix
    the three; a row without any is left exactly as it is."""
    rng = np.random.default_rng(11)
    B, V = 5, 700
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)  # both signs
    counts = rng.choice([0, 0, 0, 1, 3], size=(B, V)).astype(np.int32)
    prompt = rng.random((B, V)) < 0.1
    rep = np.asarray([1.3, 1.0, 1.0, 0.8, 1.0], np.float32)
    presence = np.asarray([0.0, 0.5, 0.0, 0.4, 0.0], np.float32)
    frequency = np.asarray([0.0, 0.0, -0.7, 0.3, 0.0], np.float32)
    seen = prompt | (counts > 0)
    want = np.where(seen, np.where(logits > 0, logits / rep[:, None], logits * rep[:, None]), logits)
    want = want - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    state = dataclasses.replace(SamplingState.empty(B, V), repetition=jnp.asarray(rep), presence=jnp.asarray(presence),
                                frequency=jnp.asarray(frequency), output_counts=jnp.asarray(counts),
                                prompt_mask=jnp.asarray(prompt))
    got = np.asarray(jax.jit(sampling.apply_penalties)(jnp.asarray(logits), state))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[4], logits[4])
    assert (got[:4] != logits[:4]).any(axis=-1).all()


def test_penalised_rows_beside_plain_rows_draw_what_they_draw_alone():
    """A row's token depends on its own settings only, penalties included: rows with a repetition, or a
    presence and frequency penalty, beside greedy and sampled rows without one give what each gives alone
    (a batch with a penalised row takes `sample`'s penalties branch for every row), and the penalties move
    their rows off the tokens they have seen."""
    V, B = 1280, 4
    logits = jnp.asarray(np.stack([_peaked(V, 40 + r) for r in range(B)]))
    # temperature, top_k, repetition, presence, frequency; every row has generated its own best two tokens
    settings = [(0.0, 0, 1.0, 0.0, 0.0), (0.0, 0, 3.0, 0.0, 0.0), (1.0, 0, 1.0, 0.0, 0.0), (0.8, 2, 1.0, 4.0, 2.0)]
    best = np.argsort(-np.asarray(logits), axis=-1)[:, :3]

    def run(rows, penalties=True):
        pick = lambda i, dtype=jnp.float32: jnp.asarray([settings[r][i] for r in rows], dtype)  # noqa: E731
        counts = np.zeros((len(rows), V), np.int32)
        for i, r in enumerate(rows):
            counts[i, best[r, :2]] = 1
        # without penalties the three stay at `SamplingState.empty`'s: repetition 1, presence and frequency 0
        penalty = dict(repetition=pick(2), presence=pick(3), frequency=pick(4)) if penalties else {}
        state = dataclasses.replace(
            SamplingState.empty(len(rows), V), temperature=pick(0), top_k=pick(1, jnp.int32), **penalty,
            output_counts=jnp.asarray(counts), key=_row_keys(jnp.asarray(rows) + 7))
        ids, *_ = jax.jit(sample)(logits[jnp.asarray(rows)], state, jnp.zeros(len(rows), jnp.bool_))
        return np.asarray(ids)

    together = run(list(range(B)))
    np.testing.assert_array_equal(together, [run([r])[0] for r in range(B)])
    unpenalised = run(list(range(B)), penalties=False)
    assert together[0] == unpenalised[0] == best[0, 0]  # greedy without a penalty
    assert unpenalised[1] == best[1, 0] and together[1] == best[1, 2]  # repetition 3: the third best leads
    # top_k 2: one of the best two without penalties; with them (6 off each) the best two are others
    assert unpenalised[3] in best[3, :2] and together[3] not in best[3, :2]


def _threshold_rows():
    """(x, w, top, t, k, top_p, min_p) of five rows that take the whole-row thresholds: flat rows, ties,
    top-k, top-p, min-p and their mixes."""
    rows = [_FLAT, np.ones(1280, np.float32), _FLAT[::-1].copy(), _peaked(1280, 3), _FLAT * 2.0]
    settings = [(1.0, _OFF, 0.95, 0.0), (1.0, 0, 0.9, 0.0), (0.7, 1100, 1.0, 0.0), (1.0, 1100, 0.97, 0.02),
                (1.3, _OFF, 1.0, 0.3)]  # temperature, k (_OFF: off), top_p, min_p
    x = jnp.asarray(np.stack(rows))
    t, k, top_p, min_p = (jnp.asarray(c, dtype) for c, dtype in zip(zip(*settings, strict=True),
                                                                     (jnp.float32, jnp.int32, jnp.float32, jnp.float32),
                                                                     strict=True))
    k = jnp.where(k == 0, _OFF, k)
    top = jnp.max(x, axis=-1)
    return x, jnp.exp((x - top[:, None]) / t[:, None]), top, t, k, top_p, min_p


def test_the_row_by_row_thresholds_give_the_batched_ids():
    """On CPU the whole-row thresholds run row by row (`_threshold_ids_by_row`); GPUs, TPUs and meshes
    keep the batched call (`_threshold_ids`). Both give every row the same token (several seeds); rows
    not asked for get 0 and no work."""
    x, w, top, t, k, top_p, min_p = _threshold_rows()
    rows = x.shape[:1]
    for seed in range(4):
        u = jax.random.uniform(jax.random.key(seed), (*rows, 2))
        batched = jax.jit(sampling._threshold_ids)(x, w, k, top_p, min_p, u)
        need = jnp.ones(rows, jnp.bool_)
        by_row = jax.jit(sampling._threshold_ids_by_row)(x, top, t, k, top_p, min_p, u, need)
        np.testing.assert_array_equal(np.asarray(by_row), np.asarray(batched), err_msg=f"seed {seed}")
    some = jax.jit(sampling._threshold_ids_by_row)(x, top, t, k, top_p, min_p, u, jnp.asarray([1, 0, 1, 0, 0], bool))
    np.testing.assert_array_equal(np.asarray(some)[[1, 3, 4]], 0)
    np.testing.assert_array_equal(np.asarray(some)[[0, 2]], np.asarray(batched)[[0, 2]])


@pytest.mark.parametrize("ways", [2, 4, 16])
def test_the_threshold_search_finds_the_highest_key_that_holds(ways):
    """`_highest_key` with `ways` parts a pass (CPU 2, a TPU 4) finds the k-th highest key exactly,
    the count being an integer, against numpy's sort: rows with ties, -inf, values near 0 and up to
    a sixth of float32's largest."""
    rng = np.random.default_rng(ways)
    for scale in (1.0, 1e-3, 1e37):
        x = rng.integers(-6, 6, (32, 1000)).astype(np.float32) * np.float32(scale)
        x[:, rng.integers(0, 1000, 40)] = -np.inf
        x[:16] += rng.standard_normal((16, 1000)).astype(np.float32) * np.float32(scale)  # half without ties
        keys = sampling._order_keys(jnp.asarray(x))
        k = jnp.asarray(rng.integers(1, 1000, 32), jnp.int32)
        got = sampling._highest_key(keys, lambda t, keys=keys, k=k: jnp.sum(keys[:, None] >= t[:, :, None], axis=-1)
                                    >= k[:, None], ways)
        want = np.sort(np.asarray(keys), axis=-1)[:, ::-1][np.arange(32), np.asarray(k) - 1]
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"scale {scale}")


def test_an_accelerators_search_draws_the_same_tokens(monkeypatch):
    """A TPU searches its thresholds 4 ways a pass (`_search_ways`), CPU by bisection: both give each
    whole-row case, alone and in one batch, the same token for every seed."""
    x, w, _, _, k, top_p, min_p = _threshold_rows()
    draws = {}
    for ways in (2, 4):
        monkeypatch.setattr(sampling, "_search_ways", lambda ways=ways: ways)
        ids = jax.jit(lambda *a: sampling._threshold_ids(*a))  # a new function: traced with this `ways`
        for seed in range(8):
            u = jax.random.uniform(jax.random.key(seed), (x.shape[0], 2))
            draws[ways, seed] = np.asarray(ids(x, w, k, top_p, min_p, u)).tolist()
            for r in range(x.shape[0]):
                alone = ids(*(a[r : r + 1] for a in (x, w, k, top_p, min_p, u)))
                assert int(alone[0]) == draws[ways, seed][r], f"ways {ways} seed {seed} row {r}"
    for seed in range(8):
        assert draws[2, seed] == draws[4, seed], f"seed {seed}"

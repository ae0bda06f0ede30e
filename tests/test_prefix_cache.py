"""Prefix caching in the batching engine (gemmax.engine.prefix_cache) on the tiny Gemma 4 config with
sliding layers (window 4, shorter than every prompt here) and KV sharing: a request whose prompt
starts with cached blocks gives exactly the tokens and logprobs of the same request prefilled from
scratch through the same engine (a salt no other request uses: nothing to share), with prefixes
shared over partial blocks, single blocks and whole prompts, under a budget that evicts, and
`cached_tokens` is what the block arithmetic says. A copy that put one position in the wrong slot
(full or ring) changes the logprobs of every later token, so the logprob check catches it. A second
engine widens the windows to 32, so that rings hold a block and a prompt's tail shares its last chunk."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from engine_faults import consume_the_state_and_fail, fail_the_start_of
from gemmax.engine.api import GenerationRequest, InvalidRequest
from gemmax.engine.engine import BatchEngine
from gemmax.engine.loading import load_model
from gemmax.engine.policy import CPU_PREFILL_BUCKETS, PREFILL_BUCKETS
from gemmax.engine.prefix_cache import PrefixCache, block_keys, plan_cached_chunks
from gemmax.engine.shapes import ShapePlan

BLOCK = 8  # the engine's smallest prefill bucket
BASE_LEN = 70  # 8 full blocks + 6 tokens; the sliding window is 4


@pytest.fixture(scope="module")
def engine(hf_checkpoints):
    loaded = load_model(str(hf_checkpoints["g4_shared"][0]), "float32")
    eng = BatchEngine(loaded, max_model_len=96, max_batch=3, buckets=(BLOCK, 32), steps_per_dispatch=3,
                      prefix_cache_bytes=1 << 20).start()
    assert eng.wait_ready(300)
    assert eng.prefix_cache.block == BLOCK and eng.prefix_cache.ring == 4
    yield eng
    eng.shutdown(drain_timeout=5)


@pytest.fixture(scope="module")
def wide_engine(hf_checkpoints):
    """The same tiny config with its sliding windows widened to 32: rings that hold a block, so a
    prompt's tail shares its last chunk (`plan_cached_chunks`). Buckets 8, 32 and 64, so that two
    prompts of one 32-token chunk have a batched shape (2 x 32 within the largest bucket)."""
    loaded = load_model(str(hf_checkpoints["g4_shared"][0]), "float32")
    config = loaded.checkpoint.config
    wide = dataclasses.replace(config, layers=tuple(
        dataclasses.replace(spec, sliding_window=32) if spec.sliding_window else spec for spec in config.layers))
    loaded = dataclasses.replace(loaded, checkpoint=dataclasses.replace(loaded.checkpoint, config=wide))
    eng = BatchEngine(loaded, max_model_len=96, max_batch=2, buckets=(BLOCK, 32, 64), steps_per_dispatch=3,
                      prefix_cache_bytes=1 << 20).start()
    assert eng.wait_ready(300)
    assert eng.prefix_cache.ring == 32 and (2, 32) in eng.shapes.prefill_groups
    yield eng
    eng.shutdown(drain_timeout=5)


def _tokens(rng, n):
    return tuple(int(t) for t in rng.integers(3, 128, n))


def _request(prompt, max_tokens, salt=None):
    return GenerationRequest(prompt, max_tokens=max_tokens, ignore_eos=True, logprobs=1, cache_salt=salt)


def _results(engine, requests):
    """Submit all at once (they share the 3 slots); [(result, logprobs)] in order."""
    return _collected([engine.submit(r) for r in requests])


def _collected(handles):
    """[(result, logprobs)] of submitted requests, in order."""
    out = []
    for h in handles:
        logprobs = [event.logprob for event in h]
        out.append((h.result, logprobs))
    return out


def _same(got, want):
    (result, logprobs), (ref, ref_logprobs) = got, want
    assert result.token_ids == ref.token_ids
    # f32 reduction order differs between chunkings and CPU kernels (2.7e-5 seen on an AVX2-only
    # Zen 3); a position copied to the wrong slot moves later logprobs by far more.
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-4)


def test_block_keys_name_the_whole_prefix_and_its_salt():
    rng = np.random.default_rng(0)
    a = _tokens(rng, 40)
    b = a[:20] + tuple((t + 1) % 128 for t in a[20:])  # differs from block 2 (tokens 16..23) on
    ka, kb = block_keys(a, BLOCK), block_keys(b, BLOCK)
    assert len(ka) == 5 and block_keys(a[:23], BLOCK) == ka[:2]  # only full blocks
    assert ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:], strict=True))
    assert not set(block_keys(a, BLOCK, "t1")) & set(ka) and not set(block_keys(a, BLOCK, "t1")) & set(block_keys(a, BLOCK, "t2"))


def test_cached_chunks_keep_every_block_they_complete():
    """Every planned chunk starts on a block boundary, every one but the last is full (a batched
    prefill starts a chunk at the same position in every prompt: with 96 real tokens in a 128 chunk
    before a 4-token one, two such prompts failed their batched prefill), and once a chunk is written
    each block it completes still has its kept positions in the ring (the store's own rule,
    `PrefixCache._saves_sliding`).
    A ring that holds a block takes the tail in the last chunk (41 tokens: one chunk of 64, not
    32 + 9); with a ring shorter than a block, chunks end on block boundaries and the tail is alone."""
    buckets = (32, 64, 128, 512, 2048)
    for ring in (None, 512, 100, 64, 32, 16):
        rule = types.SimpleNamespace(block=32, rings=() if ring is None else (ring,))
        for length in range(1, 1600, 13):
            for start in range(0, length, 96):
                plan = plan_cached_chunks(start, length, 32, buckets, ring)
                written = start
                assert all(real == bucket for real, bucket in plan[:-1]), (ring, length, start, plan)  # as batched prefill needs
                for real, bucket in plan:
                    assert written % 32 == 0 and 0 < real <= bucket and bucket in buckets, (ring, length, start, plan)
                    for index in range(written // 32, (written + real) // 32):
                        assert PrefixCache._saves_sliding(rule, index, written + real), (ring, length, start, plan)
                    written += real
                assert written == length
    assert plan_cached_chunks(0, 41, 32, buckets, 512) == [(41, 64)]
    assert plan_cached_chunks(0, 100, 32, buckets, 512) == [(100, 128)]
    assert plan_cached_chunks(0, 1500, 32, buckets, 512) == [(512, 512), (512, 512), (476, 512)]
    assert plan_cached_chunks(0, 41, 32, buckets, 16) == [(32, 32), (9, 32)]
    assert plan_cached_chunks(64, 64 + 5, BLOCK, (BLOCK, 32), 4) == [(5, 8)]


def test_cached_chunk_plans_need_only_warmed_prefill_shapes():
    """Every chunk a cached prefill can run (any cached block count, any prompt length) is of a
    bucket the warm-up compiles for plain prefill (one program per bucket, for every start): a hit
    never pays a prefill compilation."""
    for buckets, ring in ((CPU_PREFILL_BUCKETS, 512), (PREFILL_BUCKETS, 512), (PREFILL_BUCKETS, None)):
        plan = ShapePlan.create(2048, 1, buckets)
        for length in range(1, 2048, 7):
            for start in range(0, length, 32):
                chunks = plan_cached_chunks(start, length, 32, plan.buckets, ring)
                assert sum(real for real, _ in chunks) == length - start
                assert all(0 < real <= bucket and bucket in plan.buckets for real, bucket in chunks), (length, start)


def test_cached_prefixes_decode_exactly_like_a_fresh_prefill(engine):
    """Prefixes shared over 1 token, part of a block, exactly one block, many blocks, the whole prompt;
    the references first (each under its own salt: prefilled from scratch), then the base prompt,
    then every variant at once (3 slots, mixed lengths and budgets)."""
    rng = np.random.default_rng(1)
    base = _tokens(rng, BASE_LEN)
    shared = [1, 7, 8, 9, 15, 16, 21, 33, 40, 47, 56, 64, 69, 70]
    variants = [base[:s] + _tokens(rng, int(rng.integers(0 if s == BASE_LEN else 1, 96 - 12 - s)))[: 80 - s]
                for s in shared]
    budgets = [int(rng.integers(4, 13)) for _ in variants]
    refs = _results(engine, [_request(p, n, salt=f"ref-{i}") for i, (p, n) in enumerate(zip(variants, budgets, strict=True))])
    assert all(r.cached_tokens == 0 for r, _ in refs)
    base_result = _results(engine, [_request(base, 6)])[0][0]
    assert base_result.cached_tokens == 0
    got = _results(engine, [_request(p, n) for p, n in zip(variants, budgets, strict=True)])
    for s, p, g, want in zip(shared, variants, got, refs, strict=True):
        # the base stored its 8 full blocks; a hit leaves at least one prompt token to prefill
        expected = BLOCK * min(s // BLOCK, (len(p) - 1) // BLOCK, BASE_LEN // BLOCK)
        assert g[0].cached_tokens == expected, (s, len(p))
        _same(g, want)
    stats = engine.stats().prefix_cache
    assert stats["hits"] >= sum(s >= BLOCK for s in shared) and stats["evicted_bytes"] == 0
    # every store and hit ran a copy shape compiled at warm-up, none compiled since
    assert not any(r.timings.uncompiled_shape for r, _ in [*refs, *got])
    copies = engine.prefix_cache.steps
    assert copies.store_blocks.size() == len(engine.prefix_cache.store_sizes) == 3  # 1, 4, 16 for 11 blocks
    assert copies.load_blocks.size() == len(engine.prefix_cache.load_sizes) == 3  # 1, 4, 12 (the cap)


def test_cache_salt_isolates_tenants(engine):
    prompt = _tokens(np.random.default_rng(2), 40)
    cached = [_results(engine, [_request(prompt, 3, salt)])[0][0].cached_tokens
              for salt in ("alice", "alice", "bob", None, "bob")]
    assert cached == [0, 32, 0, 0, 32]
    with pytest.raises(InvalidRequest, match="cache_salt"):
        engine.submit(_request(prompt, 3, ""))


def test_a_blocks_ring_part_is_saved_only_while_the_ring_holds_it(engine):
    """Ring of 4, blocks of 8: block 0 keeps positions 4..7, in the ring until the 9th token is written."""
    saves = engine.prefix_cache._saves_sliding
    assert saves(0, 8) and not saves(0, 9) and saves(1, 16) and not saves(1, 17)


def test_eviction_under_a_tiny_budget_keeps_outputs_exact(engine):
    """A pool of 5 blocks: prompts of 4-9 blocks evict each other's blocks (and a prompt never evicts
    its own earlier blocks); every output still equals its fresh prefill."""
    rng = np.random.default_rng(3)
    base = _tokens(rng, 60)
    prompts = [base, base[:44] + _tokens(rng, 20), _tokens(rng, 75), base[:50] + _tokens(rng, 9), base]
    refs = _results(engine, [_request(p, 5, salt=f"evict-{i}") for i, p in enumerate(prompts)])
    roomy = engine.prefix_cache
    tiny = PrefixCache(engine.config, engine.max_model_len, BLOCK, 5 * roomy.block_bytes, engine.precision.kv_cache)
    engine.prefix_cache = tiny  # the engine is idle between requests: swapped for this test only
    try:
        got = [_results(engine, [_request(p, 5)])[0] for p in prompts]  # one at a time: a known order
    finally:
        engine.prefix_cache = roomy
    for g, want in zip(got, refs, strict=True):
        _same(g, want)
    # base keeps its first 5 blocks (its later ones would evict its own); prompt 1 reuses them and
    # stores nothing (every entry is its own prefix); prompt 2 shares nothing and evicts them all;
    # prompt 3 shares 6 blocks with base but finds none, and stores base's first 5 again; base finds them.
    assert [g[0].cached_tokens for g in got] == [0, 40, 0, 0, 40]
    assert tiny.stats()["evicted_bytes"] > 0 and tiny.used_bytes <= tiny.budget_bytes


def test_a_reset_forgets_every_block_and_no_counter_goes_down(engine):
    """After a failed device call the engine gives the prefix cache a new pool (`PrefixCache.reset`,
    from `_fail_all`): every block is forgotten, and the counters, which /metrics exports as
    Prometheus counters, keep their values."""
    rng = np.random.default_rng(11)
    prompt = _tokens(rng, 3 * BLOCK + 2)
    first = _results(engine, [_request(prompt, 3, salt="reset")])[0]
    assert _results(engine, [_request(prompt, 3, salt="reset")])[0][0].cached_tokens > 0
    cache = engine.prefix_cache
    counters = ("hits", "misses", "cached_tokens", "queried_tokens", "evicted_bytes")
    before = cache.stats()
    cache.reset()  # the engine is idle between requests
    after = cache.stats()
    assert after["blocks"] == 0 and after["used_bytes"] == 0
    assert {key: after[key] for key in counters} == {key: before[key] for key in counters}
    again = _results(engine, [_request(prompt, 3, salt="reset")])[0]
    assert again[0].cached_tokens == 0 and cache.stats()["misses"] == before["misses"] + 1  # forgotten
    _same(again, first)


def test_a_failure_that_rebuilds_the_state_requeues_the_prompts_admitted_with_it(engine, monkeypatch):
    """A prefill that fails after its donated state is gone ends its own request, and the engine builds
    a new state and a new, empty prefix-cache pool (`_fail_all`). A prompt admitted in the same round,
    whose lookup found cached blocks, goes back to the queue instead of copying those blocks out of
    the new pool: it is looked up again (nothing cached now) and decodes exactly as a fresh prefill."""
    rng = np.random.default_rng(13)
    prompt = _tokens(rng, 3 * BLOCK + 2)
    fresh = _results(engine, [_request(prompt, 4, salt="requeue-fresh")])[0]
    assert _results(engine, [_request(prompt, 4, salt="requeue")])[0][0].cached_tokens == 0  # now cached
    doomed = _request(_tokens(rng, 5), 3)
    original = engine._prefill_into

    def consumed_then_failed(slot, handle, *rest):
        if handle.request is not doomed:
            return original(slot, handle, *rest)
        consume_the_state_and_fail(engine, engine.prefix_cache.pool)

    monkeypatch.setattr(engine, "_prefill_into", consumed_then_failed)
    counters = ("hits", "misses", "cached_tokens", "queried_tokens")
    before = {key: engine.prefix_cache.stats()[key] for key in counters}
    with engine._lock:  # one admission takes both, the failing one first
        failing = engine.submit(doomed)
        hit = engine.submit(_request(prompt, 4, salt="requeue"))
    got = _collected([hit])[0]
    failed = failing.wait()
    assert failed.finish_reason == "error" and "simulated fault after donation" in failed.error
    assert got[0].finish_reason == "length" and got[0].cached_tokens == 0
    # counted once, as the miss its prefill started with: not the hit it was put back with, nor the
    # failed prompt, whose prefill never started
    after = {key: engine.prefix_cache.stats()[key] for key in counters}
    assert after == {**before, "misses": before["misses"] + 1, "queried_tokens": before["queried_tokens"] + len(prompt)}
    _same(got, fresh)


def test_the_counters_are_shown_only_once_ready_so_no_scrape_sees_them_go_down(hf_checkpoints, monkeypatch):
    """Warm-up's throwaway requests look their prompts up (counted), then warm-up's `clear` zeroes the
    counters: a /metrics scrape in between saw Prometheus counters go down. The engine's stats show
    the prefix cache only once it is ready, from zero."""
    loaded = load_model(str(hf_checkpoints["g4_shared"][0]), "float32")
    # the shapes of the module's engine: its programs are loaded from the session's store
    eng = BatchEngine(loaded, max_model_len=96, max_batch=3, buckets=(BLOCK, 32), steps_per_dispatch=3,
                      prefix_cache_bytes=1 << 20)
    seen = []  # what a scrape saw just before and just after each `clear`
    clear = PrefixCache.clear

    def clear_between_scrapes(cache):
        seen.append(eng.stats().prefix_cache)
        clear(cache)
        seen.append(eng.stats().prefix_cache)

    monkeypatch.setattr(PrefixCache, "clear", clear_between_scrapes)
    try:
        assert eng.start().wait_ready(300)
        assert len(seen) >= 2 and seen[-2] is None and seen[-1] is None  # warm-up's clear: nothing shown
        assert eng.prefix_cache.queried_tokens == 0 and eng.stats().prefix_cache["misses"] == 0
        _results(eng, [_request((5, 6, 7, 8, 9, 10, 11, 12, 13), 2)])
        assert eng.stats().prefix_cache["misses"] == 1
    finally:
        eng.shutdown(drain_timeout=5)


def test_a_prompt_put_back_from_a_group_is_counted_once(engine, monkeypatch):
    """Two prompts prefilled in one forward; starting the first takes the state, so the second goes
    back to the queue (its KV went with the state) and is prefilled again. Each lookup is counted
    once, as its prompt starts: two misses, not three."""
    rng = np.random.default_rng(29)
    doomed, other = _request(_tokens(rng, 6), 3, salt="once"), _request(_tokens(rng, 7), 3, salt="once")
    batches = fail_the_start_of(engine, monkeypatch, lambda request: request is doomed)
    counters = ("hits", "misses", "cached_tokens", "queried_tokens")
    before = {key: engine.prefix_cache.stats()[key] for key in counters}
    with engine._lock:  # one admission, one batched group
        handles = [engine.submit(doomed), engine.submit(other)]
    (failed, _), (put_back, _) = _collected(handles)
    assert batches == [2] and failed.finish_reason == "error" and put_back.finish_reason == "length"
    assert put_back.timings.prefill_batch == 1  # prefilled again, alone
    after = {key: engine.prefix_cache.stats()[key] for key in counters}
    assert after == {**before, "misses": before["misses"] + 2, "queried_tokens": before["queried_tokens"] + 13}


def test_a_rebuild_that_stopped_before_its_pool_is_finished_by_the_next_recovery(engine, monkeypatch):
    """Starting a prompt of a batched group takes the state; the rebuild that follows builds the
    device state but fails to allocate the prefix cache's pool, and its error reaches the admission's
    handler as the group's failure. That recovery rebuilds again (before, it saw no consumed buffer,
    and every later prompt's store or copy failed against the missing pool); prefix caching then
    works as before."""
    rng = np.random.default_rng(31)
    doomed, other = _request(_tokens(rng, 6), 3), _request(_tokens(rng, 7), 3)
    batches = fail_the_start_of(engine, monkeypatch, lambda request: request is doomed)
    cache = engine.prefix_cache
    reset = cache.reset

    def reset_fails_once():
        monkeypatch.setattr(cache, "reset", reset)
        cache.pool = None  # as an allocation that failed leaves it
        raise RuntimeError("simulated pool allocation failure")

    monkeypatch.setattr(cache, "reset", reset_fails_once)
    with engine._lock:  # one admission, one batched group
        handles = [engine.submit(doomed), engine.submit(other)]
    assert [result.finish_reason for result, _ in _collected(handles)] == ["error", "error"]
    assert batches == [2] and cache.pool is not None
    prompt = _tokens(rng, 3 * BLOCK + 2)
    fresh = _results(engine, [_request(prompt, 4, salt="pool-fresh")])[0]
    first = _results(engine, [_request(prompt, 4, salt="pool")])[0]
    again = _results(engine, [_request(prompt, 4, salt="pool")])[0]
    assert first[0].cached_tokens == 0 and again[0].cached_tokens == 3 * BLOCK
    _same(first, fresh)
    _same(again, fresh)


def test_a_hit_found_at_admission_is_not_evicted_by_a_prompt_admitted_before_it(engine):
    """One admission looks every prompt it takes up first, then prefills them in arrival order: a
    prompt that arrived earlier stores its blocks before a later prompt copies its hit. Under a pool
    of 4 blocks the earlier prompt's store evicted the later one's hit blocks and reused their
    entries, and the later prompt decoded from the earlier one's KV (another salt's); the hit blocks
    are held until the admission ends, so the earlier prompt stores fewer and the later one decodes
    exactly as a fresh prefill."""
    rng = np.random.default_rng(17)
    prompt, other = _tokens(rng, 3 * BLOCK + 2), _tokens(rng, 3 * BLOCK + 2)
    fresh = _results(engine, [_request(prompt, 4, salt="held-fresh")])[0]
    roomy = engine.prefix_cache
    tiny = PrefixCache(engine.config, engine.max_model_len, BLOCK, 4 * roomy.block_bytes, engine.precision.kv_cache)
    engine.prefix_cache = tiny  # the engine is idle between requests: swapped for this test only
    try:
        _results(engine, [_request(prompt, 4, salt="held")])  # 3 of the pool's 4 blocks
        with engine._lock:  # one admission takes both, `other` first
            first = engine.submit(_request(other, 4, salt="held-other"))
            hit = engine.submit(_request(prompt, 4, salt="held"))
        got = _collected([hit])[0]
        assert first.wait().finish_reason == "length"
    finally:
        engine.prefix_cache = roomy
    assert got[0].cached_tokens == 3 * BLOCK
    _same(got, fresh)
    # `other` stored only its first block (the free one), evicted nothing, and the holds are gone
    stats = tiny.stats()
    assert stats["evicted_bytes"] == 0 and stats["blocks"] == 4 and not tiny._held


def test_blocks_of_prompts_prefilled_together_are_cached(engine):
    """Two whole 8-token prompts queued together prefill in one forward (a batched shape) and store
    their block; a longer prompt starting with one of them copies that block and decodes exactly as
    a fresh prefill of it."""
    rng = np.random.default_rng(7)
    a, b = _tokens(rng, BLOCK), _tokens(rng, BLOCK)
    longer = a + _tokens(rng, 5)
    fresh = _results(engine, [_request(longer, 6, salt="fresh")])[0]
    with engine._lock:  # one admission sees both
        handles = [engine.submit(_request(p, 3)) for p in (a, b)]
    assert [h.wait().timings.prefill_batch for h in handles] == [2, 2]
    got = _results(engine, [_request(longer, 6)])[0]
    assert got[0].cached_tokens == BLOCK
    _same(got, fresh)


def test_a_tail_in_its_last_chunk_is_batched_cached_and_exact(wide_engine):
    """Rings of 32, blocks of 8: a 27-token prompt prefills as one chunk of 32 (24 + its 3-token tail),
    where the old plan was 24 in a chunk of 32 and then 3 in one of 8 (before d3c00f3 two such prompts
    queued together failed their batched prefill; with `group_buckets`' guard they would prefill one
    at a time). Two of them queued together now prefill in one forward and decode exactly as alone;
    a prompt that starts with one of them copies its 3 blocks (whose ring parts the chunk kept) and
    decodes exactly as a fresh prefill."""
    engine = wide_engine
    assert engine.prefix_cache.plan(0, 27, engine.shapes.buckets) == [(27, 32)]
    rng = np.random.default_rng(11)
    a, b = _tokens(rng, 27), _tokens(rng, 27)
    alone = [_results(engine, [_request(p, 6, salt=f"alone-{i}")])[0] for i, p in enumerate((a, b))]
    with engine._lock:  # one admission sees both
        handles = [engine.submit(_request(p, 6)) for p in (a, b)]
    for got, want in zip(_collected(handles), alone, strict=True):
        assert got[0].finish_reason == "length" and got[0].timings.prefill_batch == 2
        _same(got, want)
    longer = a[:24] + _tokens(rng, 9)
    fresh = _results(engine, [_request(longer, 6, salt="fresh")])[0]
    got = _results(engine, [_request(longer, 6)])[0]
    assert got[0].cached_tokens == 24
    _same(got, fresh)
